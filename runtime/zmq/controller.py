"""A controller process: runs the nodes a plan assigns it, as soon as their inputs arrive.

    python -m runtime.zmq.controller --connect ipc:///tmp/yatt-x/driver      # started by the driver
    yatt-graph controller --connect tcp://HOST:PORT                      # joining from another host

Two threads:

* the **IO thread** owns the control DEALER to the driver: heartbeats both ways and
  SHUTDOWN. It watches the node call in progress, and ends the process if the driver goes
  silent or the parent process dies (a node stuck past SHUTDOWN gets 2 s, then the process
  exits anyway). What it hears for the compute thread it queues and signals on an
  ``inproc://`` pair.
* the **compute thread** (the main thread) owns the work DEALER to the driver (RUN and
  STATE_* in; READY, STEP_DONE, errors and state out), the PULL that peers push data into
  and a PUSH per peer (DATA and shared-memory RELEASEs out). It waits on those sockets
  itself, so a RUN or a peer's DATA wakes the thread that acts on it with no hand-off
  between Python threads (libzmq's own IO thread moves the bytes while a node runs;
  decoding is zero-copy). It keeps, per step, the inputs that have arrived, and runs a node
  for step k once the driver allowed step k, the node has finished step k-1, and all of its
  inputs for step k are in (a delayed edge's input is the producer's value from step
  k-1-max_staleness, None before that). Among ready nodes the lowest step goes first.
  Outputs go to local consumers directly and to each remote controller once.

Faults: the IO thread watches the node call in progress and reports one that runs past its
``BatchPolicy.timeout_s`` (or the run's ``node_timeout_s``) with the stack it is stuck in;
between steps the compute thread sends its nodes' state to the driver (STATE_REQUEST) or
restores it (STATE_LOAD; :mod:`runtime.zmq.controller_state`). A message that does not
decode, is over ``max_message_bytes``, names an edge no node here reads, or a step outside
the window being run is dropped and logged; the run goes on.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import logging
import os
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

from runtime.errors import SendError
from runtime.zmq import messages as m
from runtime.zmq.controller_state import StateMixin
from runtime.zmq.controller_streams import StreamingMixin
from runtime.zmq.keys import is_loopback, load_keys, start_authenticator
from runtime.zmq.serial import DecodeError, UnsupportedValueError, decode_value, encode_value
from runtime.zmq.transport import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Drops,
    ShmPool,
    ShmReader,
    largest_frame,
    make_socket,
    recv,
    send,
)

__all__ = ["Controller", "main"]

_EXIT_GRACE_S = 2.0


class _Stop(Exception):
    pass


class Controller(StreamingMixin, StateMixin):
    """One controller process. :meth:`serve` runs it to the end and returns an exit code."""

    def __init__(
        self,
        connect: str,
        index: int = -1,
        bind: str | None = None,
        parent_pid: int | None = None,
        startup_timeout_s: float = 120.0,
        *,
        keys: str | None = None,
        allow_remote: bool = False,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ):
        self.connect, self.requested, self.parent_pid = connect, index, parent_pid
        self.startup_timeout_s = startup_timeout_s
        self.max_message_bytes = max_message_bytes
        self.keys = load_keys(keys, "controller") if keys else None
        host = ""
        if not bind and connect.startswith("tcp://"):
            host = _advertised_host(connect)
            if not is_loopback(f"tcp://{host}:0") and not allow_remote:
                raise ValueError(
                    f"controller: the driver at {connect} is on another host, so this controller's "
                    f"data socket would listen on {host}, where other hosts can reach it; pass "
                    "--allow-remote to accept that (and --keys DIR so that only the run's peers get in)"
                )
        self.ctx = zmq.Context()
        self.auth = start_authenticator(self.ctx, self.keys) if self.keys is not None else None
        self.driver = self._driver_socket()
        # The work link: the compute thread's own DEALER to the driver (messages.py). Its
        # identity is random, so that no other peer can claim it, and announced in HELLO.
        self.work_identity = b"w" + os.urandom(15)
        self.work = self._driver_socket(self.work_identity, linger_ms=2000)
        self.inbox = make_socket(
            self.ctx, zmq.PULL, max_message_bytes=max_message_bytes, curve=self.keys
        )
        if bind:
            self.inbox.bind(bind)
            self.data_address = bind
        elif host:
            port = self.inbox.bind_to_random_port(f"tcp://{host}")
            self.data_address = f"tcp://{host}:{port}"
        else:
            path = os.path.join(
                os.path.dirname(connect.removeprefix("ipc://")), f"data-{os.getpid()}"
            )
            self.data_address = f"ipc://{path}"
            self.inbox.bind(self.data_address)
        self.events: collections.deque[tuple[Any, ...]] = collections.deque()
        """What the compute thread has still to handle (the IO thread appends and wakes it)."""
        self._wake_address = f"inproc://wake-{id(self)}"
        self._wake_rx = self.ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_address)
        self._wake_tx = self.ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(self._wake_address)
        self.index = -1
        self.reported = 0
        self.epoch = 0
        self.current: tuple[str, int, float, float] | None = None
        """(node, step, monotonic start, limit_s) of the call in progress, read by the IO thread."""
        self._releases: list[tuple[int, str]] = []
        self.pool: ShmPool | None = None
        self.reader: ShmReader | None = None
        self._stopped = threading.Event()
        self.drops = Drops("controller")
        self.driver_lost = False

    def _driver_socket(self, identity: bytes | None = None, linger_ms: int = 0) -> zmq.Socket:
        keys = self.keys
        return make_socket(
            self.ctx,
            zmq.DEALER,
            self.connect,
            identity=identity,
            linger_ms=linger_ms,
            max_message_bytes=self.max_message_bytes,
            curve=keys,
            curve_server_key=keys.driver_public if keys is not None else None,
        )

    # --- start-up ---------------------------------------------------------------------------
    def _handshake(self) -> m.Setup | None:
        hello = m.Hello(
            m.PROTOCOL_VERSION,
            self.requested,
            os.getpid(),
            socket.gethostname(),
            self.data_address,
            self.work_identity,
        )
        send(self.driver, hello)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._parent_gone():
                return None
            if not self.driver.poll(200):
                continue
            try:
                _, kind, msg, _ = recv(self.driver, limit=self.max_message_bytes)
            except m.ProtocolError as exc:
                self.drops.drop("the driver link", exc)
                continue
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
        hint = (
            " (it uses CURVE keys: do the driver and this controller use the same --keys folder?)"
            if self.keys is not None
            else "; if it was started with --keys, pass --keys DIR here too"
            if self.connect.startswith("tcp://")
            else ""
        )
        print(
            f"yatt-graph controller: no SETUP from the driver at {self.connect} within "
            f"{self.startup_timeout_s:.0f}s; is the driver running?{hint}",
            file=sys.stderr,
        )
        return None

    def _setup(self, setup: m.Setup) -> None:
        from runtime.engine.local import run_node

        self.run_node = run_node
        self.index = setup.controller
        self._data_where = f"controller {self.index}'s data socket"
        self.lag = 1 + setup.max_staleness
        self.pipeline_depth = max(1, setup.pipeline_depth)
        if setup.max_message_bytes:
            self.max_message_bytes = setup.max_message_bytes
            self.inbox.setsockopt(zmq.MAXMSGSIZE, setup.max_message_bytes)  # peers connect later
        self.heartbeat_interval_s = setup.heartbeat_interval_s
        self.heartbeat_timeout_s = setup.heartbeat_timeout_s
        if setup.num_threads > 0:
            import torch

            torch.set_num_threads(setup.num_threads)
        if setup.shm_threshold > 0 and setup.run_id and os.path.isdir("/dev/shm"):
            self.pool = ShmPool(setup.run_id, self.index, setup.shm_threshold)
            self.reader = ShmReader(setup.run_id, self._queue_release)
        self.nodes, self.edges, self.outputs = self._build(setup)
        from runtime.sched.splitting import NodeSplitter, device_pool

        pool = device_pool({0: None, -1: "auto"}.get(setup.devices, setup.devices))
        self.splitter = NodeSplitter(self.nodes, pool) if pool is not None else None
        self.order = [n for n in setup.order if n in self.nodes]
        self.limits = {
            name: node.batch_policy.timeout_s or setup.node_timeout_s
            for name, node in self.nodes.items()
        }
        # One PUSH per peer, the compute thread's: DATA and shared-memory RELEASEs.
        self.out_peers: dict[int, zmq.Socket] = {}
        keys = self.keys
        peer_key = keys.controller_public if keys is not None else None
        for c, address in enumerate(setup.peers):
            if c != self.index:
                self.out_peers[c] = make_socket(
                    self.ctx,
                    zmq.PUSH,
                    address,
                    linger_ms=2000,
                    curve=keys,
                    curve_server_key=peer_key,
                )
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
        self.delayed_in = [e for e in self.edges if e.delay and e.dst in self.nodes]
        self._setup_streams()

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
        digest = graph.wiring_digest()
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

    def _post(self, event: tuple[Any, ...]) -> None:
        """From the IO thread: queue an event for the compute thread and wake it."""
        self.events.append(event)
        with contextlib.suppress(zmq.ZMQError):  # a full pipe: it is awake already
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.driver, zmq.POLLIN)
        next_beat = 0.0
        last_driver = time.monotonic()
        exit_by: float | None = (
            None  # after SHUTDOWN or a lost driver: the compute thread's deadline
        )
        timed_out: Any = None
        try:
            while not self._stopped.is_set():
                now = time.monotonic()
                if exit_by is not None and now > exit_by:
                    self._close_resources(destroy=False)
                    os._exit(0)  # the compute thread is stuck in a node; nobody waits for it
                current = self.current
                if current is not None and current is not timed_out and exit_by is None:
                    name, step, t0, limit = current
                    if limit > 0 and now - t0 > limit:
                        timed_out = current
                        self._report_timeout(name, step, now - t0, limit)
                if now >= next_beat:
                    next_beat = now + self.heartbeat_interval_s
                    if exit_by is None:
                        send(self.driver, self._heartbeat(now))
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
                            self.driver_lost = True  # nobody to say GOODBYE to: no linger
                            self._post(("shutdown", why))
                            exit_by = now + _EXIT_GRACE_S
                if poller.poll(max(1, min(100, int((next_beat - now) * 1000)))):
                    last_driver = time.monotonic()
                    if self._receive_control(self.driver, self._post):
                        exit_by = time.monotonic() + _EXIT_GRACE_S
        except Exception:
            self._post(("io_error", traceback.format_exc()))

    def _heartbeat(self, now: float) -> m.Heartbeat:
        current = self.current
        if current is None:
            return m.Heartbeat(self.index, self.reported)
        name, step, t0, _ = current
        return m.Heartbeat(self.index, self.reported, name, now - t0, step)

    def _report_timeout(self, name: str, step: int, seconds: float, limit: float) -> None:
        """Tell the driver a node call ran past its limit, with the stack it is stuck in."""
        frames = sys._current_frames()
        frame = frames.get(self._compute_ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        if self.splitter is not None and name in self.splitter.split_nodes:
            # The compute thread only waits for the micro-batches: show the device workers too.
            for t in threading.enumerate():
                worker = frames.get(t.ident or -1)
                if t.name.startswith(("yatt-cpu", "yatt-cuda")) and worker is not None:
                    stack += f"--- device worker {t.name} ---\n"
                    stack += "".join(traceback.format_stack(worker))
        own = self.nodes[name].batch_policy.timeout_s
        source = "its BatchPolicy.timeout_s" if own else "the run's node_timeout_s"
        message = (
            f"node {name!r} ({type(self.nodes[name]).__name__}) on controller {self.index} has run "
            f"step {step} for {seconds:.1f}s, over {source} of {limit:g}s; the run was stopped. "
            "It is hung (a deadlock, a stuck collective, an endless generate) or needs more time: "
            "raise BatchPolicy(timeout_s=...) on the node, or --node-timeout / node_timeout_s"
        )
        if stack:
            message += f"\n--- where node {name!r} was, on controller {self.index} ---\n{stack}"
        send(
            self.driver, m.Error(self.index, message, name, step, stack, "timeout", seconds, limit)
        )

    def _receive_control(self, sock: zmq.Socket, post: Any) -> bool:
        """One message from the driver (on either link) handed to ``post``; True for SHUTDOWN."""
        try:
            _, kind, msg, value = recv(sock, limit=self.max_message_bytes)
        except m.ProtocolError as exc:
            self.drops.drop("the driver link", exc)
            return False
        if kind is m.Kind.SHUTDOWN:
            post(("shutdown", msg.reason))
            return True
        if kind is m.Kind.RUN:
            post(("run", msg.until))
        elif kind is m.Kind.STATE_REQUEST:
            post(("state_request", msg.step))
        elif kind is m.Kind.STATE_LOAD:
            try:
                state = decode_value(value, where=f"the state sent to controller {self.index}")
            except DecodeError as exc:
                post(("bad_state", str(exc)))
            else:
                post(("state_load", msg, state))
        elif kind is not m.Kind.HEARTBEAT:
            self.drops.drop(
                "the driver link", f"a {kind.name} message, which the driver does not send"
            )
        return False

    def _send_releases(self) -> None:
        while self._releases:
            owner, name = self._releases.pop()
            if owner == self.index and self.pool is not None:
                self.pool.release(name)
            elif owner in self.out_peers:
                send(self.out_peers[owner], m.Release(name))

    def _receive_data(self, sock: zmq.Socket) -> None:
        """One message from a peer."""
        where = self._data_where
        try:
            _, kind, msg, value = recv(sock, limit=self.max_message_bytes)
        except m.ProtocolError as exc:
            self.drops.drop(where, exc)
            return
        if kind is m.Kind.RELEASE:
            if self.pool is not None:
                self.pool.release(msg.segment)
            return
        if kind is not m.Kind.DATA:
            self.drops.drop(where, f"a {kind.name} message, which peers do not send")
            return
        if (msg.src, msg.port) not in self.remote_in:
            self.drops.drop(where, f"data for {msg.src}.{msg.port}, which no node here reads")
            return
        if msg.epoch != self.epoch:
            if msg.epoch > self.epoch:
                self.drops.drop(
                    where, f"data of epoch {msg.epoch}; this controller is at {self.epoch}"
                )
            return  # sent before the last restore: stale by design, dropped quietly
        if msg.end:
            self.events.append(("end", msg.step, msg.src, msg.port, msg.piece, msg.epoch))
            return
        try:
            decoded = decode_value(value, where="", shm=self.reader)
        except DecodeError as exc:
            what = f"data {msg.src}.{msg.port} of step {msg.step} from controller {msg.sender}"
            self.events.append(("bad_data", msg, f"{what}{exc}"))
            return
        if msg.piece >= 0:
            self.events.append(
                ("piece", msg.step, msg.src, msg.port, msg.piece, msg.rows, decoded)
                + (None if msg.size < 0 else msg.size, msg.epoch)
            )
            return
        self.events.append(("data", msg.step, msg.src, msg.port, decoded, msg.epoch))

    def _parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    # --- the compute thread -----------------------------------------------------------------
    def _send(self, dest: int, msg: Any, value: list[Any] | None = None) -> None:
        """To controller ``dest``'s data socket."""
        send(self.out_peers[dest], msg, value)

    def _to_driver(self, msg: Any, value: list[Any] | None = None) -> None:
        """On the work link: READY, STEP_DONE, errors, state replies, GOODBYE."""
        send(self.work, msg, value)

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
            return bool(self.book) and self._stream_ready(name, step)
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
        consumer = self.consumers.get((step, best))
        if consumer is not None:
            self._run_piece(best, step, consumer)
            return True
        inputs = self.pending.pop((step, best), {})
        for e in self.in_edges[best]:
            inputs.setdefault(e.dst_port, None)
        self.starts[step][best] = time.time()
        t0 = time.perf_counter()
        self.current = (best, step, time.monotonic(), self.limits[best])
        streaming = self.nodes[best].streaming
        try:
            if streaming:
                out = self._run_stream(best, step, inputs)
            else:
                out = self.run_node(self.shim.nodes[best], inputs, step, self.index, self.splitter)
        finally:
            self.current = None
        self.seconds[step][best] = time.perf_counter() - t0
        self._finish(best, step, out, streaming)
        return True

    def _finish(self, best: str, step: int, out: dict[str, Any], streamed: bool = False) -> None:
        """A node's call for ``step`` is done: hand its outputs on (those of a streaming node
        went as pieces, except along delayed edges, which get the joined value)."""
        self.next_step[best] = step + 1
        for port, value in out.items():
            for e in self.local_out.get((best, port), ()):
                if streamed and not e.delay:
                    continue
                target = step + (self.lag if e.delay else 0)
                self.pending.setdefault((target, e.dst), {})[e.dst_port] = value
            dests = self.remote_out.get((best, port))
            if dests and not streamed:
                self._send_data(step, best, port, value, dests)
        for key, (node, port) in self.graph_outputs.items():
            if node == best:
                self.step_outputs[step][key] = out[port]
        if self.book:
            self._prune_streams()

    def _send_data(
        self,
        step: int,
        src: str,
        port: str,
        value: Any,
        dests: list[int],
        piece: int = -1,
        rows: list[int] | None = None,
        size: int | None = None,
    ) -> None:
        """Send a value (or piece ``piece`` of a stream, with its ``rows`` and batch ``size``)."""

        def where() -> str:  # only for errors: hot path
            many = "s" if len(dests) > 1 else ""
            return f"node {src!r} output {port!r} (to controller{many} {dests})"

        if self.pool is not None:
            self.pool.refs = len(dests)
        try:
            frames = encode_value(value, where="", shm=self.pool)
        except UnsupportedValueError as exc:
            raise SendError(src, step, f"{where()}{exc}") from None
        self._check_size(frames, where, src, step)
        header = m.Data(
            step,
            src,
            port,
            self.index,
            self.epoch,
            piece,
            rows or [],
            size=-1 if size is None else size,
        )
        for c in dests:
            self._send(c, header, frames)

    def _check_size(self, frames: list[Any], where: Any, node: str, step: int) -> None:
        """``where()`` names the value, for the error."""
        limit = self.max_message_bytes
        if limit and (size := largest_frame(frames)) > limit:
            raise SendError(
                node,
                step,
                f"{where()}: a frame of {size} bytes is over max_message_bytes={limit}, so the "
                "receiver would drop it; raise the limit (ZmqExecutor(max_message_bytes=...), "
                "yatt-graph run --max-message-mb) or send less",
            )

    def _report_done_steps(self) -> None:
        while self.reported < self.until and min(self.next_step.values()) > self.reported:
            step = self.reported
            outputs = self.step_outputs.pop(step, {})

            def where(outputs: dict[str, Any] = outputs) -> str:  # only for errors: hot path
                return f"graph outputs {sorted(outputs)} of controller {self.index}"

            node = next(iter(self.graph_outputs.values()), ("", ""))[0]
            try:
                frames = encode_value(outputs, where="")
            except UnsupportedValueError as exc:
                raise SendError(node, step, f"{where()}{exc}") from None
            self._check_size(frames, where, node, step)
            self._to_driver(
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
        self._state_wanted: int | None = None
        self._compute_ident = threading.get_ident()
        poller = zmq.Poller()
        for sock in (self.work, self.inbox, self._wake_rx):
            poller.register(sock, zmq.POLLIN)
        while True:
            ran = False
            if not self._failed:
                try:
                    ran = self._run_one()
                    self._report_done_steps()
                except Exception as exc:
                    self._fail(exc)
            self._send_releases()
            if not self.events:
                try:
                    self._receive(poller, 0 if ran else 500)
                except Exception as exc:  # a receive that broke: tell the driver, once
                    if not self._failed:
                        self._fail(exc)
                    time.sleep(0.05)
            while self.events:
                try:
                    self._handle(self.events.popleft())
                except _Stop:
                    return
            if not self._failed:
                try:
                    self._report_done_steps()
                    if self._state_wanted is not None:
                        self._send_state()
                except Exception as exc:
                    self._fail(exc)

    def _receive(self, poller: zmq.Poller, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` for the work link, peers' data or the IO thread."""
        # One message per ready socket, then back to running what became ready (the next
        # poll(0) takes the rest): cheaper than reading on until zmq.Again.
        for sock, _ in poller.poll(timeout_ms):
            if sock is self.inbox:
                self._receive_data(sock)
            elif sock is self.work:
                self._receive_control(sock, self.events.append)
            else:
                sock.recv()

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
        elif isinstance(exc, SendError):
            error = m.Error(
                self.index, exc.message, exc.node, exc.step, traceback.format_exc(), exc.during
            )
        else:
            error = m.Error(
                self.index,
                f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(),
                during="io",
            )
        self._to_driver(error)

    def _handle(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "data":
            _, step, src, port, value, epoch = event
            if epoch != self.epoch:
                return  # queued before the last restore
            for e in self.remote_in.get((src, port), ()):
                target = step + (self.lag if e.delay else 0)
                horizon = self.until + self.lag + 2 * self.pipeline_depth
                slot = self.pending.setdefault((target, e.dst), {})
                if not self.next_step[e.dst] <= target < horizon or e.dst_port in slot:
                    why = "a second copy" if e.dst_port in slot else "outside the steps being run"
                    self.drops.drop(
                        f"controller {self.index}'s data socket",
                        f"data {src}.{port} of step {step} for {e.dst}.{e.dst_port}: {why}",
                    )
                    if not slot:
                        del self.pending[(target, e.dst)]
                    continue
                slot[e.dst_port] = value
        elif kind in ("piece", "end"):
            self._handle_stream(event)
        elif kind == "run":
            self.until = max(self.until, event[1])
        elif kind == "shutdown":
            raise _Stop
        elif kind == "state_request":
            self._state_wanted = event[1]
        elif kind == "state_load":
            if not self._failed:
                try:
                    self._load_state(event[1], event[2])
                except Exception as exc:
                    self._fail(exc)
        elif kind in ("bad_data", "bad_state"):
            msg = event[1] if kind == "bad_data" else None
            text = event[-1]
            node, step = (msg.src, msg.step) if msg is not None else ("", -1)
            self._to_driver(m.Error(self.index, text, node, step, during="io"))
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
            # Everything built so far (torch, the models) lives as long as the process: keep
            # it out of the cyclic collector's generations, so a collection scans only what
            # the steps allocate.
            gc.freeze()
            # READY on the work link: once the driver has it, its ROUTER can route RUN there.
            self._to_driver(m.Ready(self.index, list(self.order)))
            io = threading.Thread(target=self._io_loop, name="yatt-io", daemon=True)
            io.start()
            self._compute_loop()
            self._stopped.set()
            if not self.driver_lost:
                self._to_driver(m.Goodbye(self.index))
            io.join(timeout=1.0)
            return 0
        finally:
            self._stopped.set()
            self._close_resources()

    def _wait_for_shutdown(self) -> None:
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and not self._parent_gone():
            if self.driver.poll(200):
                try:
                    _, kind, _, _ = recv(self.driver, limit=self.max_message_bytes)
                except m.ProtocolError as exc:
                    self.drops.drop("the driver link", exc)
                    continue
                if kind is m.Kind.SHUTDOWN:
                    return

    def _close_resources(self, destroy: bool = True) -> None:
        if getattr(self, "splitter", None) is not None:
            self.splitter.close()
        if self.pool is not None:
            self.pool.close()
        if self.reader is not None:
            self.reader.close()
        if destroy and self.auth is not None:
            with contextlib.suppress(Exception):
                self.auth.stop()
        if destroy:  # each socket's own linger: GOODBYE and errors still go out
            with contextlib.suppress(Exception):
                self.ctx.destroy(linger=0 if self.driver_lost else None)


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
    p.add_argument(
        "--keys", default=None, metavar="DIR", help="CURVE keys from `yatt-graph keys DIR`"
    )
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="let the data socket listen on a non-loopback interface (a driver on another host)",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest frame accepted (the driver's limit applies once it is known)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.spawned:
        # Ctrl-C in a terminal reaches the whole process group; the driver shuts us down.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.WARNING, format=f"yatt-graph controller (pid {os.getpid()}): %(message)s"
    )
    try:
        controller = Controller(
            args.connect,
            args.index,
            args.bind,
            args.parent_pid,
            args.startup_timeout,
            keys=args.keys,
            allow_remote=args.allow_remote,
            max_message_bytes=args.max_message_bytes,
        )
    except ValueError as exc:  # refused address or keys: say why, no traceback
        print(f"yatt-graph controller: error: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)
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
