"""A controller process: the step engine of the nodes a plan assigns it, plus sockets.

    python -m runtime.zmq.controller_main --connect ipc:///tmp/yatt-x/driver   # started by the driver
    yatt-graph controller --connect tcp://HOST:PORT                        # joining from another host

The nodes run in a :class:`~runtime.engine.engine.StepEngine`, the one the in-process executor
uses, so both runtimes decide alike what runs when. Around it, two threads:

* the **IO thread** (:mod:`runtime.zmq.control_link`) owns the control DEALER to the driver:
  heartbeats both ways, SHUTDOWN, the watchdog over the node call in progress.
* the **compute thread** (the main thread) owns the work DEALER to the driver (RUN and
  STATE_* in; READY, STEP_DONE, errors and state out), the PULL that peers push data into
  and a PUSH per peer (DATA and shared-memory RELEASEs out). It waits on those sockets
  itself, so a RUN or a peer's DATA reaches the engine with no hand-off between Python
  threads (libzmq's own IO thread moves the bytes while a node runs; decoding is zero-copy).
  The controller is the engine's outbox: an output that another controller reads goes to it
  once, as DATA.

Between steps the compute thread sends its nodes' state to the driver (STATE_REQUEST) or
restores it (STATE_LOAD), through the engine's ``state``/``restore``. A message that does not
decode, is over ``max_message_bytes``, names an edge no node here reads, or a step outside
the window being run is dropped and logged; the run goes on.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from runtime.engine.engine import StateNotReady, StepEngine
from runtime.errors import SendError
from runtime.zmq import messages as m
from runtime.zmq.control_link import ControlLink, IoFailed, ShutdownRequested, thread_stacks
from runtime.zmq.keys import is_loopback, load_keys, start_authenticator
from runtime.zmq.serial import DecodeError, UnsupportedValueError, decode_value, encode_value
from runtime.zmq.transport import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Drops,
    ShmPool,
    ShmReader,
    advertised_host,
    largest_frame,
    make_socket,
    recv,
    send,
)
from yatt_graph import NodeExecutionError
from yatt_graph.stream import Piece

__all__ = ["Controller"]


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
            host = advertised_host(connect)
            if not is_loopback(f"tcp://{host}:0") and not allow_remote:
                raise ValueError(
                    f"controller: the driver at {connect} is on another host, so this controller's "
                    f"data socket would listen on {host}, where other hosts can reach it; pass "
                    "--allow-remote to accept that (and --keys DIR so that only the run's peers get in)"
                )
        self.ctx = zmq.Context()
        self.auth = start_authenticator(self.ctx, self.keys) if self.keys is not None else None
        # Both links to the driver carry no data limit: only the driver talks on them, and
        # SETUP and checkpoint state may be larger than the data plane's max_message_bytes.
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
        self.index = -1
        self.epoch = 0
        self._releases: list[tuple[int, str]] = []
        self.pool: ShmPool | None = None
        self.reader: ShmReader | None = None
        self.splitter: Any = None
        self.link: ControlLink | None = None
        self.drops = Drops("controller")
        self._building = ""
        self._failed = False
        self._state_wanted: int | None = None
        self._longest: dict[str, float] = {}

    def _driver_socket(self, identity: bytes | None = None, linger_ms: int = 0) -> zmq.Socket:
        keys = self.keys
        return make_socket(
            self.ctx,
            zmq.DEALER,
            self.connect,
            identity=identity,
            linger_ms=linger_ms,
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
        remote = self.parent_pid is None
        if remote:
            print(
                f"yatt-graph controller: waiting for the driver at {self.connect} (up to "
                f"{self.startup_timeout_s:.0f}s; start it with `yatt-graph run ... --no-spawn "
                f"--listen {self.connect}`)",
                file=sys.stderr,
                flush=True,
            )
        start = time.monotonic()
        deadline = start + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._parent_gone():
                return None
            if not self.driver.poll(200):
                continue
            try:
                _, kind, msg, _ = recv(self.driver)
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
            " It uses CURVE keys: do the driver and this controller use the same --keys folder? "
            "(A driver holding other keys drops this controller's handshake and logs it.)"
            if self.keys is not None
            else " If the driver was started with --keys, pass --keys DIR here too."
            if self.connect.startswith("tcp://")
            else ""
        )
        print(
            f"yatt-graph controller: error: no SETUP from the driver at {self.connect} within "
            f"{self.startup_timeout_s:.0f}s (--startup-timeout); is the driver running and "
            f"listening there?{hint}",
            file=sys.stderr,
        )
        return None

    def _setup(self, setup: m.Setup) -> None:
        self.index = setup.controller
        self._data_where = f"controller {self.index}'s data socket"
        if setup.max_message_bytes:
            self.max_message_bytes = setup.max_message_bytes
            self.inbox.setsockopt(zmq.MAXMSGSIZE, setup.max_message_bytes)  # peers connect later
        if setup.num_threads > 0:
            import torch

            torch.set_num_threads(setup.num_threads)
        if setup.shm_threshold > 0 and setup.run_id and os.path.isdir("/dev/shm"):
            self.pool = ShmPool(setup.run_id, self.index, setup.shm_threshold)
            self.reader = ShmReader(setup.run_id, self._queue_release)
        nodes, edges, outputs, assignment = self._build(setup)
        from runtime.sched.splitting import NodeSplitter, device_pool

        pool = device_pool({0: None, -1: "auto"}.get(setup.devices, setup.devices))
        self.splitter = NodeSplitter(nodes, pool) if pool is not None else None
        limits = {
            n: node.batch_policy.timeout_s or setup.node_timeout_s for n, node in nodes.items()
        }
        self.engine = StepEngine(
            nodes,
            edges,
            outputs,
            setup.order,
            assignment,
            here=self.index,
            max_staleness=setup.max_staleness,
            window=setup.pipeline_depth,
            outbox=self,
            splitter=self.splitter,
            check_finite=setup.check_finite,
            limits=limits,
        )
        for name in self.engine.order:  # build each node's models here, in the plan's order
            self._building = name
            setup_node = getattr(nodes[name], "setup", None)
            if setup_node is not None:
                setup_node()
        self._building = ""
        # One PUSH per peer, the compute thread's: DATA and shared-memory RELEASEs.
        keys = self.keys
        peer_key = keys.controller_public if keys is not None else None
        self.out_peers = {
            c: make_socket(
                self.ctx, zmq.PUSH, address, linger_ms=2000, curve=keys, curve_server_key=peer_key
            )
            for c, address in enumerate(setup.peers)
            if c != self.index
        }

    def _build(self, setup: m.Setup) -> tuple[dict[str, Any], list[Any], dict[str, Any], dict]:
        """This controller's nodes (constructed, not yet set up), the edges, outputs and assignment."""
        from yatt_graph.serialize import PlanSpec, build_node

        if setup.plan_json:
            spec = msgspec.json.decode(setup.plan_json, type=PlanSpec)
            assignment = dict(spec.assignment)
            specs = {ns.name: ns for ns in spec.graph.nodes}
            nodes = {}
            for name in setup.order:
                if assignment[name] == setup.controller:
                    self._building = name
                    nodes[name] = build_node(specs[name])
            self._building = ""
            return nodes, list(spec.graph.edges), dict(spec.graph.outputs), assignment
        from yatt_graph.refs import load_graph

        assignment = dict(setup.assignment)
        graph = load_graph(setup.graph_ref, **msgspec.json.decode(setup.graph_options_json))
        digest = graph.wiring_digest()
        if setup.digest and digest != setup.digest or set(graph.nodes) != set(assignment):
            raise RuntimeError(
                f"the graph rebuilt from {setup.graph_ref!r} here is wired differently from the driver's "
                f"(nodes {sorted(graph.nodes)} vs {sorted(assignment)}); pass the same graph_options "
                "and run the same code on every host"
            )
        nodes = {n: graph.nodes[n] for n in setup.order if assignment[n] == setup.controller}
        return nodes, graph.edges, dict(graph.graph_outputs), assignment

    # --- the engine's outbox ----------------------------------------------------------------
    def value(self, step: int, src: str, port: str, value: Any, dests: list[int]) -> None:
        self._send_data(step, src, port, value, dests)

    def piece(
        self, step: int, src: str, port: str, index: int, piece: Piece, dests: list[int]
    ) -> None:
        self._send_data(step, src, port, piece.outputs[port], dests, index, piece.rows, piece.size)

    def end(self, step: int, src: str, port: str, count: int, dests: list[int]) -> None:
        header = m.Data(step, src, port, self.index, self.epoch, count, end=True)
        for c in dests:
            send(self.out_peers[c], header)

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
            step, src, port, self.index, self.epoch, piece, rows or [],
            size=-1 if size is None else size,
        )  # fmt: skip
        for c in dests:
            send(self.out_peers[c], header, frames)

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

    # --- what arrives -----------------------------------------------------------------------
    def _on_data(self, sock: zmq.Socket) -> None:
        """One message from a peer, handed to the engine (or dropped, and logged)."""
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
        if not self.engine.reads(msg.src, msg.port):
            self.drops.drop(where, f"data for {msg.src}.{msg.port}, which no node here reads")
            return
        if msg.epoch != self.epoch:
            if msg.epoch > self.epoch:
                self.drops.drop(
                    where, f"data of epoch {msg.epoch}; this controller is at {self.epoch}"
                )
            return  # sent before the last restore: stale by design, dropped quietly
        if msg.end:
            dropped = self.engine.end_stream(msg.step, msg.src, msg.port, msg.piece)
        else:
            try:
                decoded = decode_value(value, where="", shm=self.reader)
            except DecodeError as exc:
                what = f"data {msg.src}.{msg.port} of step {msg.step} from controller {msg.sender}"
                self._to_driver(m.Error(self.index, f"{what}{exc}", msg.src, msg.step, during="io"))
                self._failed = True
                return
            if msg.piece >= 0:
                size = None if msg.size < 0 else msg.size
                piece = Piece(msg.rows, {msg.port: decoded}, size)
                dropped = self.engine.deliver_piece(msg.step, msg.src, msg.port, msg.piece, piece)
            else:
                dropped = self.engine.deliver(msg.step, msg.src, msg.port, decoded)
        for why in dropped:
            self.drops.drop(where, why)

    def _on_work(self, sock: zmq.Socket) -> None:
        """One message on the work link: RUN, STATE_REQUEST or STATE_LOAD."""
        try:
            _, kind, msg, value = recv(sock)
        except m.ProtocolError as exc:
            self.drops.drop("the driver link", exc)
            return
        if kind is m.Kind.RUN:
            self.engine.allow(msg.until)
        elif kind is m.Kind.STATE_REQUEST:
            self._state_wanted = msg.step
        elif kind is m.Kind.STATE_LOAD:
            if self._failed:
                return
            try:
                state = decode_value(value, where=f"the state sent to controller {self.index}")
            except DecodeError as exc:
                self._to_driver(m.Error(self.index, str(exc), during="io"))
                self._failed = True
                return
            self.engine.restore(msg.step, state)
            self.epoch = msg.epoch
            self._to_driver(m.StateLoaded(self.index, msg.step))
        elif kind is m.Kind.SHUTDOWN:
            raise _Stop
        elif kind is not m.Kind.HEARTBEAT:
            self.drops.drop("the driver link", f"a {kind.name} message on the work link")

    def _queue_release(self, owner: int, name: str) -> None:
        self._releases.append((owner, name))

    def _send_releases(self) -> None:
        while self._releases:
            owner, name = self._releases.pop()
            if owner == self.index and self.pool is not None:
                self.pool.release(name)
            elif owner in self.out_peers:
                send(self.out_peers[owner], m.Release(name))

    def _parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    # --- the compute thread -----------------------------------------------------------------
    def _to_driver(self, msg: Any, value: list[Any] | None = None) -> None:
        """On the work link: READY, STEP_DONE, errors, state replies, GOODBYE."""
        send(self.work, msg, value)

    def _report_finished(self) -> None:
        for result in self.engine.finished():
            step, outputs = result.step, result.outputs
            for name, seconds in result.node_seconds.items():
                self._longest[name] = max(seconds, self._longest.get(name, 0.0))

            def where(outputs: dict[str, Any] = outputs) -> str:  # only for errors: hot path
                return f"graph outputs {sorted(outputs)} of controller {self.index}"

            node = next(iter(self.engine.graph_outputs.values()), ("", ""))[0]
            try:
                frames = encode_value(outputs, where="")
            except UnsupportedValueError as exc:
                raise SendError(node, step, f"{where()}{exc}") from None
            self._check_size(frames, where, node, step)
            self._to_driver(
                m.StepDone(self.index, step, result.node_seconds, result.node_start), frames
            )

    def _send_state(self) -> None:
        """Answer a STATE_REQUEST once the engine has every value its state holds."""
        step = self._state_wanted
        assert step is not None
        try:
            state = self.engine.state(step)
        except StateNotReady:
            return  # still finishing the step before
        if state is None:
            return  # a peer's delayed value is still on its way
        self._state_wanted = None
        where = f"the state of controller {self.index}"
        try:
            frames = encode_value(state, where=where, any_keys=True)
        except UnsupportedValueError as exc:
            bad = next((n for n in state["nodes"] if f"['nodes'][{n!r}]" in str(exc)), "")
            raise SendError(
                bad, step, f"{exc}; a checkpoint of a ZeroMQ run needs node state that the wire "
                "carries (tensors, numbers, strings, lists, tuples, dicts)", "state",
            ) from None  # fmt: skip
        first = next(iter(state["nodes"]), "")
        try:
            self._check_size(frames, lambda: where, first, step)
        except SendError as exc:
            raise SendError(exc.node, step, exc.message, "state") from None
        self._to_driver(m.StateReply(self.index, step), frames)

    def _loop(self) -> None:
        assert self.link is not None
        poller = zmq.Poller()
        for sock in (self.work, self.inbox, self.link.wake):
            poller.register(sock, zmq.POLLIN)
        while True:
            ran = False
            if not self._failed:
                try:
                    ran = self.engine.run_one()
                    self._report_finished()
                except Exception as exc:
                    self._fail(exc)
            self._send_releases()
            try:
                self._receive(poller, 0 if ran else 500)
            except _Stop:
                return
            except Exception as exc:  # a receive that broke: tell the driver, once
                if not self._failed:
                    self._fail(exc)
                time.sleep(0.05)
            while self.link.events:
                event = self.link.events.popleft()
                if isinstance(event, IoFailed):
                    # Nothing reaches the driver any more: its heartbeat check reports us.
                    print(
                        f"yatt-graph controller {self.index}: IO thread failed:\n{event.traceback}",
                        file=sys.stderr,
                    )
                    return
                if isinstance(event, ShutdownRequested):
                    return
            if not self._failed:
                try:
                    self._report_finished()
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
                self._on_data(sock)
            elif sock is self.work:
                try:
                    self._on_work(sock)
                except _Stop:
                    raise
                except Exception as exc:
                    self._fail(exc)
            else:
                sock.recv()

    def _fail(self, exc: BaseException) -> None:
        """Tell the driver, then wait for SHUTDOWN (the driver stops the whole run)."""
        self._failed = True
        if isinstance(exc, NodeExecutionError):
            step = int(exc.context.get("step", -1))
            during = str(exc.context.get("during", "step"))
            error = m.Error(self.index, str(exc), exc.node, step, exc.remote_traceback, during)
        elif isinstance(exc, SendError):
            tb = traceback.format_exc()
            error = m.Error(self.index, exc.message, exc.node, exc.step, tb, exc.during)
        else:
            text = f"{type(exc).__name__}: {exc}"
            error = m.Error(self.index, text, traceback=traceback.format_exc(), during="io")
        self._to_driver(error)

    # --- the whole life ---------------------------------------------------------------------
    def serve(self) -> int:
        try:
            setup = self._handshake()
            if setup is None:
                return 3
            try:
                self._setup(setup)
            except Exception as exc:
                self._report_setup_error(setup, exc)
                self._wait_for_shutdown()
                return 1
            # Everything built so far (torch, the models) lives as long as the process: keep
            # it out of the cyclic collector's generations, so a collection scans only what
            # the steps allocate.
            gc.freeze()
            compute = threading.get_ident()
            splitter = self.splitter
            nodes = self.engine.nodes
            self.link = ControlLink(
                self.ctx, self.driver, self.index, setup,
                running=lambda: self.engine.running,
                reported=lambda: self.engine.reported,
                longest=self._longest.get,
                stacks=lambda name: thread_stacks(
                    compute, splitter is not None and name in splitter.split_nodes
                ),
                describe=lambda name: type(nodes[name]).__name__,
                parent_gone=self._parent_gone,
                on_exit=lambda: self._close_resources(destroy=False),
                max_message_bytes=0,
                drops=self.drops,
            )  # fmt: skip
            # READY on the work link: once the driver has it, its ROUTER can route RUN there.
            self._to_driver(m.Ready(self.index, list(self.engine.order)))
            self.link.start()
            self._loop()
            self.link.stop(timeout_s=0)
            if not self.link.driver_lost:
                self._to_driver(m.Goodbye(self.index))
            return 0
        finally:
            if self.link is not None:
                self.link.stop()
            self._close_resources()

    def _report_setup_error(self, setup: m.Setup, exc: Exception) -> None:
        node = self._building
        what = f"{type(exc).__name__}: {exc}"
        text = f"controller {setup.controller} could not build its nodes: {what}"
        if node:
            text = f"node {node!r} could not be built on controller {setup.controller}: {what}"
        error = m.Error(setup.controller, text, node, -1, traceback.format_exc(), "setup")
        send(self.driver, error)

    def _wait_for_shutdown(self) -> None:
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and not self._parent_gone():
            if self.driver.poll(200):
                try:
                    _, kind, _, _ = recv(self.driver)
                except m.ProtocolError as exc:
                    self.drops.drop("the driver link", exc)
                    continue
                if kind is m.Kind.SHUTDOWN:
                    return

    def _close_resources(self, destroy: bool = True) -> None:
        if self.splitter is not None:
            self.splitter.close()
        if self.pool is not None:
            self.pool.close()
        if self.reader is not None:
            self.reader.close()
        if destroy and self.auth is not None:
            with contextlib.suppress(Exception):
                self.auth.stop()
        if destroy:  # each socket's own linger: GOODBYE and errors still go out
            lost = self.link is not None and self.link.driver_lost
            with contextlib.suppress(Exception):
                self.ctx.destroy(linger=0 if lost else None)
