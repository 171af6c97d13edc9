"""A controller process (started as :mod:`runtime.zmq.controller_main` says): the step engine
of the nodes a plan assigns it, plus sockets.

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
import math
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

import zmq

from runtime.children import exit_with_parent
from runtime.codec import DecodeError, UnsupportedValueError, decode_value, encode_value
from runtime.codec.cuda_ipc import OPENED
from runtime.engine.engine import StateNotReady
from runtime.errors import ProcessFault, SendError
from runtime.sched.affinity import apply_resources
from runtime.sched.devices import Resources
from runtime.zmq import STARTUP_TIMEOUT_S
from runtime.zmq import messages as m
from runtime.zmq.control_link import (
    EXIT_GRACE_S,
    ControlLink,
    IoFailed,
    ShutdownRequested,
    wait_for_setup,
    wait_for_shutdown,
)
from runtime.zmq.keys import is_loopback, load_keys, start_authenticator
from runtime.zmq.options import engine_from_setup
from runtime.zmq.peers import Peers
from runtime.zmq.transport import (
    DEFAULT_MAX_MESSAGE_BYTES,
    HANDSHAKE_FAILED,
    Drops,
    advertised_host,
    make_socket,
    recv,
    send,
)
from yatt_graph import NodeBuildError, NodeExecutionError
from yatt_graph.refs import load_module

__all__ = ["Controller"]


IDLE_POLL_MS = 500


def poll_ms(ran: bool, wake_in: float | None) -> int:
    """How long the loop waits for a message: not at all after running something (more may
    be ready), else until a streamed consumer's ``max_queue_delay_s`` runs out (``wake_in``
    seconds, rounded up so the wait has passed on waking) or at most ``IDLE_POLL_MS``."""
    if ran:
        return 0
    if wake_in is None:
        return IDLE_POLL_MS
    return min(IDLE_POLL_MS, math.ceil(wake_in * 1000))


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
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        *,
        keys: str | None = None,
        allow_remote: bool = False,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        preload: tuple[str, ...] = (),
    ):
        self.connect, self.requested, self.parent_pid = connect, index, parent_pid
        self.preload = preload
        self.startup_timeout_s = startup_timeout_s
        self.keys = load_keys(keys, "controller") if keys else None
        self.keys_dir = keys
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
        self.drops = Drops("controller")
        self.peers = Peers(
            self.ctx, connect, bind=bind, host=host, keys=self.keys,
            max_message_bytes=max_message_bytes, drops=self.drops,
        )  # fmt: skip
        self.data_address = self.peers.address
        self.index = -1
        self.workers: Any = None  # what runs its nodes besides itself (engine_from_setup)
        self.link: ControlLink | None = None
        self._building = ""
        self._failed = False
        self._state_wanted: int | None = None
        self._longest: dict[str, float] = {}
        self._opened = OPENED.bytes  # at the last STEP_DONE
        self.pinned_threads: int | None = None
        self.applied = Resources()
        """The cores, threads and GPUs applied (runtime.sched.affinity), told to the driver."""
        self._tell_applied = False

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
        for ref in self.preload:  # while the driver builds the graph: SETUP waits in the socket
            with contextlib.suppress(Exception):  # the build imports it again and says what fails
                load_module(ref)
        remote = self.parent_pid is None
        if remote:
            print(
                f"yatt-graph controller: waiting for the driver at {self.connect} (up to "
                f"{self.startup_timeout_s:.0f}s; start it with `yatt-graph run ... --no-spawn "
                f"--listen {self.connect}`)",
                file=sys.stderr,
                flush=True,
            )
        monitor = self.driver.get_monitor_socket(HANDSHAKE_FAILED) if self.keys else None
        try:
            return wait_for_setup(
                self.driver, self.connect, self.keys is not None, self.startup_timeout_s,
                monitor=monitor, drops=self.drops,
            )  # fmt: skip
        finally:
            if monitor is not None:
                self.driver.disable_monitor()
                monitor.close(linger=0)

    def _setup(self, setup: m.Setup) -> None:
        self.index = setup.controller
        # Cores, threads and GPUs first: CUDA must see only this controller's GPUs when the
        # nodes build their models.
        self.pinned_threads = setup.config.num_threads
        self.applied = apply_resources(
            setup.resources or Resources(), pinned_threads=self.pinned_threads
        )
        self.engine, self.workers = engine_from_setup(
            setup, self.peers, self._track, self.ctx, self.keys, self.keys_dir
        )
        self.peers.connect(setup)

    # --- what arrives -----------------------------------------------------------------------
    def _on_work(self, sock: zmq.Socket) -> None:
        """One message on the work link: RUN, STATE_REQUEST or STATE_LOAD."""
        try:
            _, kind, msg, value = recv(sock)
        except m.ProtocolError as exc:
            self.drops.drop("the driver link", exc)
            return
        if kind is m.Kind.RUN:
            self.engine.allow(msg.until)
        elif kind is m.Kind.RESOURCES:  # on the compute thread, so between node calls
            self.applied = apply_resources(msg.resources, pinned_threads=self.pinned_threads)
            self._tell_applied = True
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
            self.peers.epoch = msg.epoch
            self._to_driver(m.StateLoaded(self.index, msg.step))
        elif kind is m.Kind.SHUTDOWN:
            raise _Stop
        elif kind is not m.Kind.HEARTBEAT:
            self.drops.drop("the driver link", f"a {kind.name} message on the work link")

    def _driver_gone(self) -> None:
        """The parent watch's orderly exit (:func:`runtime.children.exit_with_parent`): once
        the IO thread runs, it shuts the controller down as for a silent driver and returns
        before this does; before that there is nothing to close in order."""
        link = self.link
        if link is None:
            return
        link.driver_gone("the driver process is gone")
        time.sleep(link.setup.config.heartbeat_interval_s + EXIT_GRACE_S + 1.0)

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
            self.peers.check_size(frames, where, node, step)
            applied, self._tell_applied = self.applied if self._tell_applied else None, False
            opened, self._opened = OPENED.bytes - self._opened, OPENED.bytes
            done = m.StepDone(
                self.index, step, result.node_seconds, result.node_start,
                resources=applied, staleness=result.staleness, switches=result.switches,
                replicas=result.replicas, ipc_bytes=opened,
            )  # fmt: skip
            self._to_driver(done, frames)

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
            self.peers.check_size(frames, lambda: where, first, step)
        except SendError as exc:
            raise SendError(exc.node, step, exc.message, "state") from None
        self._to_driver(m.StateReply(self.index, step), frames)

    def _loop(self) -> None:
        assert self.link is not None
        poller = zmq.Poller()
        for sock in (self.work, self.peers.inbox, self.link.wake):
            poller.register(sock, zmq.POLLIN)
        while True:
            ran = False
            if not self._failed:
                try:
                    ran = self.engine.run_one()
                    self._report_finished()
                except Exception as exc:
                    self._fail(exc)
            self.peers.send_releases()
            try:
                self._receive(poller, poll_ms(ran, None if ran else self.engine.wake_in()))
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
            if sock is self.peers.inbox:
                error = self.peers.receive(self.engine)
                if error is not None:
                    self._to_driver(error)
                    self._failed = True
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
            cause = exc.__cause__  # a process it ran on died (a replica, a training rank)
            if isinstance(cause, ProcessFault):
                during = "replica"
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
        if self.parent_pid is not None:  # started by the driver: it ends with the driver
            who = f"yatt-graph controller {self.requested} (pid {os.getpid()})"
            exit_with_parent(self.parent_pid, who, on_gone=self._driver_gone)
        try:
            setup = self._handshake()
            if setup is None:
                return 3
            try:
                self._setup(setup)
            except Exception as exc:
                self._report_setup_error(setup, exc)
                wait_for_shutdown(self.driver, self.drops)
                return 1
            # Everything built so far (torch, the models) lives as long as the process: keep
            # it out of the cyclic collector's generations, so a collection scans only what
            # the steps allocate.
            gc.freeze()
            self.link = ControlLink(
                self.ctx, self.driver, self.index, setup, engine=self.engine,
                compute=threading.get_ident(), longest=self._longest.get,
                on_exit=lambda: self._close_resources(destroy=False),
                drops=self.drops,
            )  # fmt: skip
            # READY on the work link: once the driver has it, its ROUTER can route RUN there.
            self._to_driver(m.Ready(self.index, list(self.engine.order), self.applied))
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

    def _track(self, name: str) -> None:
        self._building = name  # the node being made, for the error if that fails

    def _report_setup_error(self, setup: m.Setup, exc: Exception) -> None:
        c, node, what = setup.controller, self._building, f"{type(exc).__name__}: {exc}"
        text, during = f"controller {c} could not build its nodes: {what}", "setup"
        if isinstance(exc, NodeBuildError):  # the user's input: one line (controller.py: build)
            text, node, during = f"{exc} (on controller {c})", exc.node, "build"
        elif node:
            text = f"node {node!r} could not be built on controller {c}: {what}"
        send(self.driver, m.Error(c, text, node, -1, traceback.format_exc(), during))

    def _close_resources(self, destroy: bool = True) -> None:
        if self.workers is not None:
            self.workers.close()  # its ranks hear "close" before the store's owner leaves
        self.peers.close()
        if destroy and self.auth is not None:
            with contextlib.suppress(Exception):
                self.auth.stop()
        if destroy:  # each socket's own linger: GOODBYE and errors still go out
            lost = self.link is not None and self.link.driver_lost
            with contextlib.suppress(Exception):
                self.ctx.destroy(linger=0 if lost else None)
