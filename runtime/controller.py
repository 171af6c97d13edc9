"""A controller process: runs the nodes a plan assigns it, as soon as their inputs arrive.

    python -m runtime.controller --connect ipc:///tmp/yatt-x/driver      # started by the driver
    yatt-graph controller --connect tcp://HOST:PORT                      # joining from another host

Two threads:

* the **IO thread** owns the receiving side: the control DEALER to the driver (RUN,
  SHUTDOWN, heartbeats both ways), the PULL that peers push data into, and a PUSH per
  peer for shared-memory RELEASEs. It decodes incoming data while the compute thread runs
  nodes, and ends the process if the driver goes silent or the parent process dies (a
  node stuck past SHUTDOWN gets 2 s, then the process exits anyway).
* the compute thread sends on sockets of its own (a results DEALER to the driver, a
  data PUSH per peer), so outputs leave without a hop through another thread.
* the **compute thread** (the main thread) keeps, per step, the inputs that have arrived,
  and runs a node for step k once the driver allowed step k, the node has finished step
  k-1, and all of its inputs for step k are in (a delayed edge's input is the producer's
  value from step k-1-max_staleness, None before that). Among ready nodes the lowest step
  goes first. Outputs go to local consumers directly and to each remote controller once.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
import types
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from runtime import messages as m
from runtime.serial import DecodeError, UnsupportedValueError, decode_value, encode_value
from runtime.transport import ShmPool, ShmReader, make_socket, recv, send

__all__ = ["Controller", "graph_digest", "main"]

_DRIVER = b"d"
_EXIT_GRACE_S = 2.0


def graph_digest(edges: Sequence[Any], outputs: dict[str, Any]) -> str:
    """A hash of a graph's wiring, to check that a graph rebuilt elsewhere is the same one."""
    wiring = sorted((e.src, e.src_port, e.dst, e.dst_port, e.delay) for e in edges)
    outs = sorted((k, h.node, h.port) for k, h in outputs.items())
    return hashlib.sha256(msgspec.json.encode([wiring, outs])).hexdigest()[:16]


class _Stop(Exception):
    pass


class Controller:
    """One controller process. :meth:`serve` runs it to the end and returns an exit code."""

    def __init__(
        self,
        connect: str,
        index: int = -1,
        bind: str | None = None,
        parent_pid: int | None = None,
        startup_timeout_s: float = 120.0,
    ):
        self.connect, self.requested, self.parent_pid = connect, index, parent_pid
        self.startup_timeout_s = startup_timeout_s
        self.ctx = zmq.Context()
        self.driver = make_socket(self.ctx, zmq.DEALER, connect)
        self.inbox = make_socket(self.ctx, zmq.PULL)
        if bind:
            self.inbox.bind(bind)
            self.data_address = bind
        elif connect.startswith("tcp://"):
            host = _advertised_host(connect)
            port = self.inbox.bind_to_random_port("tcp://*")
            self.data_address = f"tcp://{host}:{port}"
        else:
            path = os.path.join(
                os.path.dirname(connect.removeprefix("ipc://")), f"data-{os.getpid()}"
            )
            self.data_address = f"ipc://{path}"
            self.inbox.bind(self.data_address)
        self.events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.index = -1
        self.reported = 0
        self._releases: list[tuple[int, str]] = []
        self.pool: ShmPool | None = None
        self.reader: ShmReader | None = None
        self._stopped = threading.Event()

    # --- start-up ---------------------------------------------------------------------------
    def _handshake(self) -> m.Setup | None:
        hello = m.Hello(
            m.PROTOCOL_VERSION, self.requested, os.getpid(), socket.gethostname(), self.data_address
        )
        send(self.driver, hello)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._parent_gone():
                return None
            if not self.driver.poll(200):
                continue
            _, kind, msg, _ = recv(self.driver)
            if kind is m.Kind.REFUSED:
                print(
                    f"yatt-graph controller: the driver refused this controller: {msg.reason}",
                    file=sys.stderr,
                )
                return None
            if kind is m.Kind.SETUP:
                return msg
            if kind is m.Kind.SHUTDOWN:
                return None
        print(
            f"yatt-graph controller: no SETUP from the driver at {self.connect} within "
            f"{self.startup_timeout_s:.0f}s; is the driver running?",
            file=sys.stderr,
        )
        return None

    def _setup(self, setup: m.Setup) -> None:
        from runtime.local import run_node

        self.run_node = run_node
        self.index = setup.controller
        self.lag = 1 + setup.max_staleness
        self.heartbeat_interval_s = setup.heartbeat_interval_s
        self.heartbeat_timeout_s = setup.heartbeat_timeout_s
        if setup.num_threads > 0:
            import torch

            torch.set_num_threads(setup.num_threads)
        if setup.shm_threshold > 0 and setup.run_id and os.path.isdir("/dev/shm"):
            self.pool = ShmPool(setup.run_id, self.index, setup.shm_threshold)
            self.reader = ShmReader(setup.run_id, self._queue_release)
        self.nodes, self.edges, self.outputs = self._build(setup)
        self.order = [n for n in setup.order if n in self.nodes]
        # The compute thread sends on sockets of its own (no hop through the IO thread); the IO
        # thread keeps the control DEALER, the data PULL and a PUSH per peer for RELEASE.
        self.peers: dict[int, zmq.Socket] = {}
        self.out_peers: dict[int, zmq.Socket] = {}
        for c, address in enumerate(setup.peers):
            if c != self.index:
                self.peers[c] = make_socket(self.ctx, zmq.PUSH, address)
                self.out_peers[c] = make_socket(self.ctx, zmq.PUSH, address, linger_ms=2000)
        self.out_driver = make_socket(self.ctx, zmq.DEALER, self.connect, linger_ms=2000)
        self.in_edges: dict[str, list[Any]] = {n: [] for n in self.nodes}
        self.local_out: dict[tuple[str, str], list[Any]] = defaultdict(list)
        self.remote_out: dict[tuple[str, str], list[int]] = defaultdict(list)
        self.remote_in: dict[tuple[str, str], list[Any]] = defaultdict(list)
        for e in self.edges:
            dst_here, src_here = e.dst in self.nodes, e.src in self.nodes
            if dst_here:
                self.in_edges[e.dst].append(e)
            if src_here and dst_here:
                self.local_out[(e.src, e.src_port)].append(e)
            elif dst_here:
                self.remote_in[(e.src, e.src_port)].append(e)
            elif src_here:
                c = self.assignment[e.dst]
                if c not in self.remote_out[(e.src, e.src_port)]:
                    self.remote_out[(e.src, e.src_port)].append(c)
        self.graph_outputs = {
            k: (h.node, h.port) for k, h in self.outputs.items() if h.node in self.nodes
        }

    def _build(self, setup: m.Setup) -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
        from yatt_graph.serialize import PlanSpec, build_node

        if setup.plan_json:
            spec = msgspec.json.decode(setup.plan_json, type=PlanSpec)
            self.assignment = dict(spec.assignment)
            specs = {ns.name: ns for ns in spec.graph.nodes}
            nodes = {}
            for name in setup.order:
                if self.assignment[name] == setup.controller:
                    self._building = name
                    nodes[name] = build_node(specs[name])
            return nodes, list(spec.graph.edges), dict(spec.graph.outputs)
        from yatt_graph.refs import load_graph

        self.assignment = dict(setup.assignment)
        self._building = ""
        graph = load_graph(setup.graph_ref, **msgspec.json.decode(setup.graph_options_json))
        digest = graph_digest(graph.edges, graph.graph_outputs)
        if setup.digest and digest != setup.digest or set(graph.nodes) != set(self.assignment):
            raise RuntimeError(
                f"the graph rebuilt from {setup.graph_ref!r} here is wired differently from the driver's "
                f"(nodes {sorted(graph.nodes)} vs {sorted(self.assignment)}); pass the same graph_options "
                "and run the same code on every host"
            )
        nodes = {n: graph.nodes[n] for n in setup.order if self.assignment[n] == setup.controller}
        return nodes, graph.edges, dict(graph.graph_outputs)

    # --- the IO thread ----------------------------------------------------------------------
    def _queue_release(self, owner: int, name: str) -> None:
        self._releases.append((owner, name))

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        for sock in (self.driver, self.inbox):
            poller.register(sock, zmq.POLLIN)
        next_beat = 0.0
        last_driver = time.monotonic()
        exit_by: float | None = (
            None  # after SHUTDOWN or a lost driver: the compute thread's deadline
        )
        try:
            while not self._stopped.is_set():
                now = time.monotonic()
                if exit_by is not None and now > exit_by:
                    self._close_resources(destroy=False)
                    os._exit(0)  # the compute thread is stuck in a node; nobody waits for it
                if now >= next_beat:
                    next_beat = now + self.heartbeat_interval_s
                    if exit_by is None:
                        send(self.driver, m.Heartbeat(self.index, self.reported))
                        why = None
                        if now - last_driver > self.heartbeat_timeout_s:
                            why = f"the driver has been silent for {now - last_driver:.1f}s"
                        elif self._parent_gone():
                            why = "the driver process is gone"
                        if why:
                            print(
                                f"yatt-graph controller {self.index}: {why}; exiting",
                                file=sys.stderr,
                            )
                            self.events.put(("shutdown", why))
                            exit_by = now + _EXIT_GRACE_S
                for sock, _ in poller.poll(max(1, min(100, int((next_beat - now) * 1000)))):
                    if sock is self.driver:
                        last_driver = time.monotonic()
                        _, kind, msg, _ = recv(sock)
                        if kind is m.Kind.SHUTDOWN:
                            self.events.put(("shutdown", msg.reason))
                            exit_by = time.monotonic() + _EXIT_GRACE_S
                        elif kind is m.Kind.RUN:
                            self.events.put(("run", msg.until))
                    else:
                        self._receive_data(sock)
                self._send_releases()
        except Exception:
            self.events.put(("io_error", traceback.format_exc()))

    def _send_releases(self) -> None:
        while self._releases:
            owner, name = self._releases.pop()
            if owner == self.index and self.pool is not None:
                self.pool.release(name)
            elif owner in self.peers:
                send(self.peers[owner], m.Release(name))

    def _receive_data(self, sock: zmq.Socket) -> None:
        _, kind, msg, value = recv(sock)
        if kind is m.Kind.RELEASE:
            if self.pool is not None:
                self.pool.release(msg.segment)
            return
        if kind is not m.Kind.DATA:
            raise m.ProtocolError(f"a {kind.name} message on the data socket")
        where = f"data {msg.src}.{msg.port} of step {msg.step} from controller {msg.sender}"
        try:
            decoded = decode_value(value, where=where, shm=self.reader)
        except DecodeError as exc:
            self.events.put(("bad_data", msg, str(exc)))
            return
        self.events.put(("data", msg.step, msg.src, msg.port, decoded))

    def _parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    # --- the compute thread -----------------------------------------------------------------
    def _send(self, dest: bytes, msg: Any, value: list[Any] | None = None) -> None:
        send(self.out_driver if dest == _DRIVER else self.out_peers[int(dest)], msg, value)

    def _ready(self, name: str) -> bool:
        step = self.next_step[name]
        if step >= self.until:
            return False
        have = self.pending.get((step, name), {})
        for e in self.in_edges[name]:
            if e.dst_port in have:
                continue
            if e.delay and step < self.lag:
                continue
            return False
        return True

    def _run_one(self) -> bool:
        """Run the ready node with the lowest (step, topological index); False if none is ready."""
        best = None
        for name in self.order:
            if self._ready(name) and (best is None or self.next_step[name] < self.next_step[best]):
                best = name
        if best is None:
            return False
        step = self.next_step[best]
        inputs = self.pending.pop((step, best), {})
        for e in self.in_edges[best]:
            inputs.setdefault(e.dst_port, None)
        self.starts[step][best] = time.time()
        t0 = time.perf_counter()
        out = self.run_node(self.shim, best, inputs, step, self.index)
        self.seconds[step][best] = time.perf_counter() - t0
        self.next_step[best] = step + 1
        for port, value in out.items():
            for e in self.local_out.get((best, port), ()):
                target = step + (self.lag if e.delay else 0)
                self.pending.setdefault((target, e.dst), {})[e.dst_port] = value
            dests = self.remote_out.get((best, port))
            if dests:
                self._send_data(step, best, port, value, dests)
        for key, (node, port) in self.graph_outputs.items():
            if node == best:
                self.step_outputs[step][key] = out[port]
        return True

    def _send_data(self, step: int, src: str, port: str, value: Any, dests: list[int]) -> None:
        where = (
            f"node {src!r} output {port!r} (to controller{'s' if len(dests) > 1 else ''} {dests})"
        )
        if self.pool is not None:
            self.pool.refs = len(dests)
        try:
            frames = encode_value(value, where=where, shm=self.pool)
        except UnsupportedValueError as exc:
            raise _SendError(src, step, str(exc)) from None
        header = m.Data(step, src, port, self.index)
        for c in dests:
            self._send(str(c).encode(), header, frames)

    def _report_done_steps(self) -> None:
        while self.reported < self.until and all(
            s > self.reported for s in self.next_step.values()
        ):
            step = self.reported
            outputs = self.step_outputs.pop(step, {})
            where = f"graph outputs {sorted(outputs)} of controller {self.index}"
            try:
                frames = encode_value(outputs, where=where)
            except UnsupportedValueError as exc:
                node = next(iter(self.graph_outputs.values()), ("", ""))[0]
                raise _SendError(node, step, str(exc)) from None
            self._send(
                _DRIVER,
                m.StepDone(self.index, step, self.seconds.pop(step, {}), self.starts.pop(step, {})),
                frames,
            )
            self.reported += 1

    def _compute_loop(self) -> None:
        self.shim = types.SimpleNamespace(nodes=self.nodes)
        self.next_step = dict.fromkeys(self.order, 0)
        self.pending: dict[tuple[int, str], dict[str, Any]] = {}
        self.seconds: dict[int, dict[str, float]] = defaultdict(dict)
        self.starts: dict[int, dict[str, float]] = defaultdict(dict)
        self.step_outputs: dict[int, dict[str, Any]] = defaultdict(dict)
        self.until = 0
        self._failed = False
        while True:
            ran = False
            if not self._failed:
                try:
                    ran = self._run_one()
                    self._report_done_steps()
                except Exception as exc:
                    self._fail(exc)
            try:
                event = self.events.get_nowait() if ran else self.events.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self._handle(event)
            except _Stop:
                return
            if not self._failed:
                try:
                    self._report_done_steps()
                except Exception as exc:
                    self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """Tell the driver, then wait for SHUTDOWN (the driver stops the whole run)."""
        from yatt_graph import NodeExecutionError

        self._failed = True
        if isinstance(exc, NodeExecutionError):
            error = m.Error(
                self.index,
                str(exc),
                exc.node,
                int(exc.context.get("step", -1)),
                exc.remote_traceback,
            )
        elif isinstance(exc, _SendError):
            error = m.Error(
                self.index, exc.message, exc.node, exc.step, traceback.format_exc(), "send"
            )
        else:
            error = m.Error(
                self.index,
                f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(),
                during="io",
            )
        self._send(_DRIVER, error)

    def _handle(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "data":
            _, step, src, port, value = event
            for e in self.remote_in.get((src, port), ()):
                target = step + (self.lag if e.delay else 0)
                self.pending.setdefault((target, e.dst), {})[e.dst_port] = value
        elif kind == "run":
            self.until = max(self.until, event[1])
        elif kind == "shutdown":
            raise _Stop
        elif kind == "bad_data":
            _, msg, text = event
            self._send(_DRIVER, m.Error(self.index, text, msg.src, msg.step, during="io"))
            self._failed = True
        elif kind == "io_error":
            # The IO thread is gone, so nothing reaches the driver: its heartbeat check reports us.
            print(
                f"yatt-graph controller {self.index}: IO thread failed:\n{event[1]}",
                file=sys.stderr,
            )
            raise _Stop

    # --- the whole life ---------------------------------------------------------------------
    def serve(self) -> int:
        try:
            setup = self._handshake()
            if setup is None:
                return 3
            try:
                self._setup(setup)
            except Exception as exc:
                node = getattr(self, "_building", "")
                text = f"controller {setup.controller} could not build its nodes: {type(exc).__name__}: {exc}"
                if node:
                    text = f"node {node!r} could not be built on controller {setup.controller}: {type(exc).__name__}: {exc}"
                send(
                    self.driver,
                    m.Error(setup.controller, text, node, -1, traceback.format_exc(), "setup"),
                )
                self._wait_for_shutdown()
                return 1
            send(self.driver, m.Ready(self.index, list(self.order)))
            io = threading.Thread(target=self._io_loop, name="yatt-io", daemon=True)
            io.start()
            self._compute_loop()
            self._stopped.set()
            self._send(_DRIVER, m.Goodbye(self.index))
            io.join(timeout=1.0)
            return 0
        finally:
            self._stopped.set()
            self._close_resources()

    def _wait_for_shutdown(self) -> None:
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and not self._parent_gone():
            if self.driver.poll(200):
                _, kind, _, _ = recv(self.driver)
                if kind is m.Kind.SHUTDOWN:
                    return

    def _close_resources(self, destroy: bool = True) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.reader is not None:
            self.reader.close()
        if destroy:  # each socket's own linger: GOODBYE and errors still go out
            with contextlib.suppress(Exception):
                self.ctx.destroy()


class _SendError(Exception):
    def __init__(self, node: str, step: int, message: str):
        super().__init__(message)
        self.node, self.step, self.message = node, step, message


def _advertised_host(connect: str) -> str:
    """This host's address as seen from the driver (the interface that routes to it)."""
    host = connect.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yatt-graph controller", description="run one controller of a ZeroMQ run"
    )
    p.add_argument(
        "--connect", required=True, help="the driver's address, ipc://PATH or tcp://HOST:PORT"
    )
    p.add_argument(
        "--index", type=int, default=-1, help="controller index (default: the driver assigns one)"
    )
    p.add_argument("--bind", default=None, help="address of this controller's data socket")
    p.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit when this process is no longer the parent",
    )
    p.add_argument(
        "--spawned",
        action="store_true",
        help="started by a local driver: ignore Ctrl-C (the driver stops us)",
    )
    p.add_argument("--startup-timeout", type=float, default=120.0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.spawned:
        # Ctrl-C in a terminal reaches the whole process group; the driver shuts us down.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    controller = Controller(
        args.connect, args.index, args.bind, args.parent_pid, args.startup_timeout
    )
    try:
        code = controller.serve()
    except KeyboardInterrupt:
        code = 130
    # Everything is closed; skip interpreter teardown (torch's can take most of a second).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
