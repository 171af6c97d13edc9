"""The ZeroMQ executor: a driver in this process, N controller processes, data between them.

::

    from runtime.zmq.driver import ZmqExecutor
    plan = load_graph("graphs.toy").plan(3)
    with ZmqExecutor(plan) as ex:
        results = ex.run(10)          # list[StepResult], the same as LocalExecutor's

The driver binds a ROUTER socket (``ipc://`` in a fresh temporary directory, removed at
close), starts the controllers (``python -m runtime.zmq.controller``, plain subprocesses: no
fork of a process that has torch loaded), and then only sends small control messages:
SETUP, RUN(until) and SHUTDOWN. Values flow controller to controller; the driver receives
per-step reports (node seconds and the graph's marked outputs, so keep those small) and
errors. The calling thread uses the socket directly while it waits for results; a
heartbeat thread shares it (under a lock) so controllers notice a dead driver even while
the caller is idle, and the driver notices a dead or silent controller within
``heartbeat_timeout_s`` (a local controller that exits is noticed within 50 ms).

How controllers rebuild their nodes (``rebuild``):

* ``"plan"``: from ``plan.to_json()`` (each node's class reference and constructor
  arguments); a controller builds only the nodes it owns. The default whenever the plan
  serializes.
* ``"graph"``: from ``load_graph(graph_ref, **graph_options)`` in each controller, for
  nodes whose constructor arguments are not JSON-able; every controller builds the whole
  graph and keeps its own nodes, and the wiring is checked against the driver's.
* ``"auto"``: ``"plan"``, falling back to ``"graph"`` when the plan does not serialize
  and a ``graph_ref`` was given.

Either way node state lives in the controllers: a node object in the driver is not
shipped. :meth:`ZmqExecutor.state_dict` asks every controller, between steps, for its
nodes' ``state_dict()``, the delayed-edge values it holds and its RNG states, in the
format of ``LocalExecutor.state_dict()`` (so ``runtime.train.loop.train`` checkpoints and resumes
either executor, and a checkpoint of one loads into the other); :meth:`load_state_dict`
restores such a state into the controllers.

Faults (docs/RELIABILITY.md): a controller that exits is noticed within 50 ms, one that
goes silent within ``heartbeat_timeout_s``, both as a :class:`ControllerError` naming it and
its nodes; a node call that runs past its ``BatchPolicy.timeout_s`` (or the run's
``node_timeout_s``) is a :class:`NodeTimeoutError` naming the node, controller and step,
with the stack it was stuck in. Messages that do not decode, exceed
``max_message_bytes`` or come from a stranger are dropped and logged
(``dropped_messages``); the run goes on. ``keys=DIR`` turns on CURVE
(:mod:`runtime.zmq.keys`).

Pipelining: up to ``pipeline_depth`` steps are allowed at once in :meth:`run`, so a
controller starts step k+1's data source while another still scores step k.
``max_staleness=0`` (on-policy) keeps the reference semantics exactly: an input on a
delayed edge at step k is the producer's value from step k-1, so the rollout waits for
the update. ``max_staleness=N`` makes that input the value from step k-1-N (None for the
first N+1 steps): a fixed lag, so runs stay reproducible, and the rollout (and all
upstream of it) may run N steps ahead of the update. :meth:`step` runs exactly one step
with no run-ahead.
"""

from __future__ import annotations

import collections
import contextlib
import os
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from runtime.engine.local import StepResult
from runtime.errors import ControllerError, HandshakeError, NodeTimeoutError
from runtime.zmq import messages as m
from runtime.zmq.driver_state import StateMixin
from runtime.zmq.keys import check_address, load_keys, start_authenticator
from runtime.zmq.processes import ControllerProc, RunCleanup, sigint_deferred, spawn_controllers
from runtime.zmq.serial import DecodeError, decode_value
from runtime.zmq.transport import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Drops,
    largest_frame,
    make_socket,
    recv_frames,
    send,
)
from yatt_graph import Graph, NodeExecutionError, Plan

__all__ = ["ControllerError", "HandshakeError", "NodeTimeoutError", "ZmqExecutor"]


class _Who:
    """Where a dropped message came from, formatted only when it is logged (hot path)."""

    def __init__(self, c: ControllerProc | None):
        self.c = c

    def __str__(self) -> str:
        c = self.c
        return f"the driver socket (from controller {c.index})" if c else "the driver socket"


_FROM_CONTROLLERS = frozenset(
    {
        m.Kind.READY,
        m.Kind.STEP_DONE,
        m.Kind.ERROR,
        m.Kind.GOODBYE,
        m.Kind.STATE_REPLY,
        m.Kind.STATE_LOADED,
    }
)


class ZmqExecutor(StateMixin):
    """Run a plan on ``plan.controllers`` controller processes. ``step()`` runs the graph once.

    Args:
        plan: a Plan, or a Graph (planned for ``controllers``, default 1).
        graph_ref / graph_options: the graph module or file and its ``build_graph`` options,
            for ``rebuild="graph"`` (see the module docstring).
        max_staleness: 0 = on-policy (reference semantics); N = delayed edges carry the
            value from N+1 steps back, so the graph upstream of them runs N steps ahead.
        pipeline_depth: most steps in flight in :meth:`run` (at least ``max_staleness + 1``).
        spawn: start the controllers here; False waits for ``yatt-graph controller
            --connect ADDRESS`` processes (``address`` must then be given).
        address: the driver's address; default ``ipc://`` in a fresh temporary directory.
            ``tcp://`` needs ``allow_tcp=True``; a non-loopback tcp address also needs
            ``allow_remote=True``. ``tcp://127.0.0.1:*`` picks a free port (see ``address``).
        keys: a ``yatt-graph keys`` folder: CURVE on every socket (:mod:`runtime.zmq.keys`).
        node_timeout_s: the longest one node call may run, for nodes whose
            ``BatchPolicy.timeout_s`` is 0; 0 = no limit.
        max_message_bytes: the largest frame a runtime socket accepts (and a controller
            sends: a larger output is an error naming it); libzmq disconnects a peer that
            sends a larger one (0: no limit). Default 4 GiB.
        state_timeout_s: how long :meth:`state_dict` / :meth:`load_state_dict` wait.
        num_threads: ``torch.set_num_threads`` in each controller (0: torch's default).
        shm_threshold: tensors of at least this many bytes go controller to controller
            through shared memory (one host); 0 sends everything as zmq frames.
        controller_output: ``"capture"`` (to a log file per controller, whose tail errors
            include) or ``"inherit"`` (this process's stdout/stderr).
        devices: CPU slots per controller that splittable nodes' calls are cut across
            (:mod:`runtime.sched.splitting`); None/0: none; ``"auto"``: ``$YATT_CPU_SLOTS`` or the
            usable cores of each controller's host.
        spin_s: how long the driver polls its socket without sleeping when it waits for a
            step's result, before it blocks: a reply that comes within it is read with no
            wake-up of a sleeping thread, which on a VM costs tens of microseconds. It spins
            only while the last step's results came within this time (steps of tiny nodes),
            so real steps never spin; 0 turns it off.
    """

    def __init__(
        self,
        plan: Plan | Graph,
        controllers: int | None = None,
        *,
        graph_ref: str | None = None,
        graph_options: dict[str, Any] | None = None,
        rebuild: str = "auto",
        max_staleness: int = 0,
        pipeline_depth: int = 2,
        spawn: bool = True,
        address: str | None = None,
        allow_tcp: bool = False,
        allow_remote: bool = False,
        keys: str | os.PathLike[str] | None = None,
        node_timeout_s: float = 0.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        state_timeout_s: float = 600.0,
        heartbeat_interval_s: float = 0.5,
        heartbeat_timeout_s: float = 5.0,
        startup_timeout_s: float = 120.0,
        shutdown_grace_s: float = 5.0,
        num_threads: int = 1,
        shm_threshold: int = 1 << 20,
        controller_output: str = "capture",
        devices: int | str | None = None,
        spin_s: float = 0.001,
    ):
        if isinstance(plan, Graph):
            plan = plan.plan(controllers or 1)
        elif controllers is not None and controllers != plan.controllers:
            raise ValueError(
                f"ZmqExecutor: the plan has {plan.controllers} controllers, {controllers} were asked for"
            )
        if max_staleness < 0 or pipeline_depth < 1:
            raise ValueError("ZmqExecutor: max_staleness must be >= 0 and pipeline_depth >= 1")
        if rebuild not in ("auto", "plan", "graph"):
            raise ValueError(
                f"ZmqExecutor: rebuild must be 'auto', 'plan' or 'graph', got {rebuild!r}"
            )
        if controller_output not in ("capture", "inherit"):
            raise ValueError("ZmqExecutor: controller_output must be 'capture' or 'inherit'")
        if not spawn and address is None:
            raise ValueError("ZmqExecutor(spawn=False) needs the address controllers connect to")
        if address:
            check_address(
                address, allow_tcp=allow_tcp, allow_remote=allow_remote, who="ZmqExecutor"
            )
        if devices not in (None, "auto") and not (
            isinstance(devices, int) and not isinstance(devices, bool) and devices >= 0
        ):
            raise ValueError(
                f"ZmqExecutor: devices must be None, a CPU slot count >= 0 or 'auto', got {devices!r}"
            )
        if node_timeout_s < 0 or max_message_bytes < 0:
            raise ValueError("ZmqExecutor: node_timeout_s and max_message_bytes must be >= 0")
        if isinstance(spin_s, bool) or not isinstance(spin_s, (int, float)) or not 0 <= spin_s <= 1:
            raise ValueError(
                f"ZmqExecutor: spin_s must be between 0 and 1 second, got {spin_s!r} "
                "(0.001 is the default; 0 never spins)"
            )
        self.spin_s = float(spin_s)
        self._wait_s = 0.0  # how long the last step's results took to come in
        self.keys = load_keys(keys, "driver") if keys is not None else None
        self.keys_dir = os.fspath(keys) if keys is not None else None
        if address and address.startswith("tcp://") and allow_remote and self.keys is None:
            warnings.warn(
                f"ZmqExecutor: {address} accepts controllers from other hosts without "
                "authentication; create keys with `yatt-graph keys DIR` and pass keys=DIR",
                RuntimeWarning,
                stacklevel=2,
            )
        self.plan, self.graph = plan, plan.graph
        self.graph.validate()
        self.order = self.graph.topological_order()
        self.max_staleness = max_staleness
        self.pipeline_depth = max(pipeline_depth, max_staleness + 1)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_grace_s = shutdown_grace_s
        self.state_timeout_s = state_timeout_s
        self.max_message_bytes = max_message_bytes
        self.next_step = 0
        self._epoch = 0
        self._started = False
        self._spawned = spawn
        self._drops = Drops("driver")
        self._until = 0
        self._partial: dict[int, dict[int, tuple[m.StepDone, dict[str, Any]]]] = {}
        self._closed = False
        self._last_check = 0.0
        self._setup_kw = self._setup_fields(graph_ref, graph_options, rebuild)
        self._setup_kw.update(
            max_staleness=max_staleness,
            heartbeat_interval_s=heartbeat_interval_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            num_threads=num_threads,
            shm_threshold=shm_threshold,
            node_timeout_s=node_timeout_s,
            max_message_bytes=max_message_bytes,
            pipeline_depth=self.pipeline_depth,
            devices=-1 if devices == "auto" else int(devices or 0),
        )

        run_dir = tempfile.mkdtemp(prefix="yatt-")
        self.run_dir = run_dir
        self._res = RunCleanup(run_dir, os.path.basename(run_dir) if spawn else "")
        self._finalizer = weakref.finalize(self, self._res.cleanup)
        self.address = address or f"ipc://{run_dir}/driver"
        owned = {
            c: [n for n in self.order if plan.assignment[n] == c] for c in range(plan.controllers)
        }
        self.controllers = [ControllerProc(c, owned[c]) for c in range(plan.controllers)]
        self._by_identity: dict[bytes, ControllerProc] = {}
        self._last_seen: dict[bytes, float] = {}
        self._events: collections.deque[tuple[Any, ...]] = collections.deque()
        try:
            self._start_io()
            if spawn:
                spawn_controllers(
                    self.controllers,
                    self._res,
                    address=self.address,
                    run_dir=run_dir,
                    output=controller_output,
                    num_threads=num_threads,
                    startup_timeout_s=startup_timeout_s,
                    max_message_bytes=max_message_bytes,
                    keys_dir=self.keys_dir,
                )
            self._handshake()
            self._started = True
        except BaseException:
            self._shutdown("start-up failed")
            raise

    # --- start-up ---------------------------------------------------------------------------
    def _setup_fields(
        self, graph_ref: str | None, graph_options: dict[str, Any] | None, rebuild: str
    ) -> dict[str, Any]:
        plan_json = b""
        if rebuild in ("auto", "plan"):
            try:
                plan_json = self.plan.to_json()
            except TypeError as exc:
                if rebuild == "plan" or not graph_ref:
                    raise TypeError(
                        f"ZmqExecutor: the plan cannot be sent to controllers: {exc}. Either make the "
                        "node's constructor arguments JSON-able, or pass graph_ref='module.or/file.py' "
                        "(and graph_options) so each controller rebuilds the graph itself"
                    ) from exc
        elif not graph_ref:
            raise ValueError("ZmqExecutor(rebuild='graph') needs graph_ref")
        return dict(
            plan_json=plan_json,
            graph_ref="" if plan_json else (graph_ref or ""),
            graph_options_json=msgspec.json.encode(graph_options or {}),
            assignment=dict(self.plan.assignment),
            order=list(self.order),
            digest=self.graph.wiring_digest(),
        )

    def _start_io(self) -> None:
        ctx = self._res.ctx = zmq.Context()
        if self.keys is not None:
            self._res.auth = start_authenticator(ctx, self.keys)
        self._router = make_socket(
            ctx,
            zmq.ROUTER,
            self.address,
            bind=True,
            max_message_bytes=self.max_message_bytes,
            curve=self.keys,
        )
        self._poller = zmq.Poller()  # one, not one per wait (Socket.poll makes a new one)
        self._poller.register(self._router, zmq.POLLIN)
        if self.address.endswith(":*") or self.address.endswith(":0"):
            self.address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        # The calling thread uses the socket itself (no hop through an IO thread: dispatch
        # latency); a lock lets the heartbeat thread share it while the caller is elsewhere.
        self._lock = threading.Lock()
        interval = self._setup_kw["heartbeat_interval_s"]
        thread = threading.Thread(
            target=self._heartbeat_loop, args=(interval,), name="yatt-heartbeat", daemon=True
        )
        self._res.io_thread = thread
        thread.start()

    def _handshake(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while any(c.state is m.State.STARTING for c in self.controllers):
            event = self._next_event(deadline, "to connect")
            if event is None:
                continue
            identity, kind, msg, _ = event
            if kind is m.Kind.HELLO:
                self._admit(identity, msg)
            elif kind is m.Kind.ERROR:
                self._raise_error(msg)
        for c in self.controllers:
            setup = m.Setup(
                controller=c.index,
                peers=[x.data_address for x in self.controllers],
                run_id=self._res.run_id,
                **self._setup_kw,
            )
            self._send(c, setup)
        while any(c.state is not m.State.READY for c in self.controllers):
            event = self._next_event(deadline, "to build their nodes")
            if event is None:
                continue
            identity, kind, msg, _ = event
            if kind is m.Kind.READY:
                self._by_identity[identity].state = m.State.READY
            elif kind is m.Kind.ERROR:
                self._raise_error(msg)

    def _admit(self, identity: bytes, hello: m.Hello) -> None:
        free = [c for c in self.controllers if c.state is m.State.STARTING]
        if hello.controller >= 0:
            match = [c for c in free if c.index == hello.controller]
            reason = f"controller index {hello.controller} is taken or not in 0..{len(self.controllers) - 1}"
        else:
            match, reason = free[:1], f"all {len(self.controllers)} controllers have joined"
        if not match:
            self._send_raw(identity, m.Refused(reason))
            return
        c = match[0]
        if c.popen is not None and hello.pid != c.popen.pid:
            self._send_raw(
                identity, m.Refused(f"controller {c.index} was started as pid {c.popen.pid}")
            )
            return
        if not hello.work_identity or hello.work_identity in self._by_identity:
            self._send_raw(identity, m.Refused("the HELLO has no usable work_identity"))
            return
        c.identity, c.pid, c.state = identity, hello.pid, m.State.CONNECTED
        c.data_address, c.work = hello.data_address, hello.work_identity
        self._by_identity[identity] = self._by_identity[c.work] = c
        self._last_seen[identity] = time.monotonic()

    # --- the socket: heartbeats and receiving -----------------------------------------------
    def _heartbeat_loop(self, interval: float) -> None:
        beat = m.encode_header(m.Heartbeat())
        stop = self._res.io_stop
        while not stop.wait(interval):
            with self._lock:
                if stop.is_set():
                    return
                for c in self.controllers:
                    if c.identity is not None:
                        with contextlib.suppress(zmq.ZMQError):  # gone: the liveness check says
                            self._router.send_multipart([c.identity, *beat])
                self._pump(0)  # keep last-seen times fresh while the caller is away

    def _pump(self, timeout_ms: int, drain: bool = True) -> None:
        """Receive what is waiting (the caller holds the lock) into the event deque: every
        message, or with ``drain=False`` the first one (the caller comes back for more;
        one poll(0) fewer on the dispatch path)."""
        poll = self._poller.poll
        while poll(timeout_ms):
            frames = recv_frames(self._router, zmq.NOBLOCK)
            self._dispatch(frames[0].bytes, frames[1:])
            if not drain:
                return
            timeout_ms = 0

    def _dispatch(self, identity: bytes, frames: list[Any]) -> None:
        """Route one message (the caller holds the lock); drop and log what is not for us.

        Nothing a stranger sends can stop the run: only the controllers that joined are
        heard after start-up, and anything that does not decode is dropped.
        """
        c = self._by_identity.get(identity)
        who = _Who(c)
        if not frames:
            self._drops.drop(who, f"a message of {len(frames)} frames")
            return
        if self.max_message_bytes and (size := largest_frame(frames)) > self.max_message_bytes:
            self._drops.drop(
                who, f"a frame of {size} bytes, over max_message_bytes={self.max_message_bytes}"
            )
            return
        if c is None:
            head = frames[0].bytes[:1]
            if head == m.Kind.HELLO.frame and len(frames[0]) == 1 and len(frames) == 2:
                self._hello(identity, frames[1], legacy=True)  # protocol 2: kind, header
            elif head == m.Kind.HELLO.frame:
                self._hello(identity, frames[0].bytes[1:])
            else:
                self._drops.drop(who, "a message from a peer that has not joined the run")
            return
        try:
            kind, msg = m.decode_header(frames[0])
        except m.ProtocolError as exc:
            self._drops.drop(who, exc)
            return
        self._last_seen[c.identity or identity] = time.monotonic()
        if kind is m.Kind.HEARTBEAT:
            c.last_beat = msg
        elif kind in _FROM_CONTROLLERS:
            self._events.append((identity, kind, msg, frames[1:]))
        else:
            self._drops.drop(who, f"a {kind.name} message, which controllers do not send")

    def _hello(self, identity: bytes, header: Any, legacy: bool = False) -> None:
        """A HELLO from a new peer: admitted during start-up, refused (and logged) otherwise.

        ``header`` is the HELLO without its kind byte; ``legacy``: it came as protocol 2 sent
        it (kind and header in two frames), and the refusal goes back in that form.
        """
        try:
            version = m.hello_protocol(header)
            reason = (
                f"this controller speaks protocol {version}, the driver speaks {m.PROTOCOL_VERSION}; "
                "run the same yatt-graph version on the driver and every controller"
            )
            hello = (
                m.decode_header(m.Kind.HELLO.frame + bytes(header))[1]
                if version == m.PROTOCOL_VERSION and not legacy
                else None
            )
        except m.ProtocolError as exc:
            self._drops.drop("the driver socket", exc)
            return
        if hello is not None and not self._started:
            self._events.append((identity, m.Kind.HELLO, hello, []))
            return
        if hello is not None:
            reason = f"the run has started; all {len(self.controllers)} controllers have joined"
        refused = m.encode_header(m.Refused(reason))
        if legacy:
            refused = [refused[0][:1], refused[0][1:]]
        with contextlib.suppress(zmq.ZMQError):
            self._router.send_multipart([identity, *refused])
        if not self._started and not self._spawned:
            # Waiting for controllers started by hand: a mismatched one is the user's to fix.
            self._events.append(("refused", identity, reason))
        else:
            self._drops.drop("the driver socket", f"refused a HELLO: {reason}")

    def _send_raw(self, identity: bytes, msg: Any, value: list[Any] | None = None) -> None:
        with self._lock:
            try:
                send(self._router, msg, value, prefix=[identity])
            except zmq.ZMQError:  # a gone peer: the liveness check reports it
                return  # (try/except: contextlib.suppress costs more on the dispatch path)

    def _send(self, c: ControllerProc, msg: Any, value: list[Any] | None = None) -> None:
        """To the controller's control link (its IO thread)."""
        if c.identity is not None:
            self._send_raw(c.identity, msg, value)

    def _send_work(self, c: ControllerProc, msg: Any, value: list[Any] | None = None) -> None:
        """To the controller's work link (its compute thread): RUN and STATE_*."""
        if c.work is not None:
            self._send_raw(c.work, msg, value)

    @property
    def dropped_messages(self) -> int:
        """How many messages the driver's socket dropped (garbage, oversized, strangers')."""
        return self._drops.count

    # --- waiting, liveness ------------------------------------------------------------------
    def _next_event(
        self, deadline: float | None, waiting_for: str, spin_s: float = 0.0
    ) -> tuple[Any, ...] | None:
        if not self._events and spin_s > 0:
            until = time.perf_counter() + spin_s
            while not self._events and time.perf_counter() < until:
                with self._lock:
                    self._pump(0, drain=False)
        if not self._events:
            with self._lock:
                self._pump(20, drain=False)
        event = self._events.popleft() if self._events else None
        if event is not None and event[0] == "refused":
            raise HandshakeError(
                f"a controller could not join the driver at {self.address}: {event[2]}"
            )
        self._check_alive()
        if deadline is not None and time.monotonic() > deadline and event is None:
            late = [c for c in self.controllers if c.state is not m.State.READY]
            raise HandshakeError(
                f"controllers {[c.index for c in late]} did not manage {waiting_for} within "
                f"{self.startup_timeout_s:.0f}s (startup_timeout_s)"
                + "".join(c.log_tail() for c in late),
                late[0].index,
                late[0].nodes,
            )
        return event

    def _check_alive(self) -> None:
        now = time.monotonic()
        if now - self._last_check < 0.05:  # waitpid per controller: not on every message
            return
        self._last_check = now
        for c in self.controllers:
            rc = c.popen.poll() if c.popen is not None else None
            if rc is not None and c.state is not m.State.STOPPED:
                c.state = m.State.FAILED
                cls = HandshakeError if self._until == 0 else ControllerError
                how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
                raise cls(
                    f"controller {c.index} (pid {c.pid}) {how} {self._when()}; it owned "
                    f"nodes {c.nodes}{c.doing()}" + c.log_tail(),
                    c.index,
                    c.nodes,
                )
            seen = self._last_seen.get(c.identity or b"")
            if (
                c.state is m.State.READY
                and seen is not None
                and now - seen > self.heartbeat_timeout_s
            ):
                c.state = m.State.FAILED
                raise ControllerError(
                    f"controller {c.index} (pid {c.pid}) has sent nothing for {now - seen:.1f}s "
                    f"(heartbeat_timeout_s={self.heartbeat_timeout_s}) {self._when()}; it owned nodes "
                    f"{c.nodes}{c.doing()}; it is dead, hung outside Python, or its host is "
                    "unreachable",
                    c.index,
                    c.nodes,
                )

    def _when(self) -> str:
        return (
            f"while running step {self.next_step}"
            if self._until > self.next_step
            else "during start-up"
            if self._until == 0
            else f"after step {self.next_step - 1}"
        )

    def _raise_error(self, err: m.Error) -> None:
        c = (
            self.controllers[err.controller]
            if 0 <= err.controller < len(self.controllers)
            else None
        )
        if err.during == "timeout":
            raise NodeTimeoutError(
                err.node,
                err.message,
                err.traceback,
                step=err.step,
                controller=err.controller,
                during="timeout",
                seconds=err.seconds,
                limit_s=err.limit_s,
            )
        if err.node and err.during in ("step", "setup", "send", "state"):
            message = err.message
            if err.during in ("send", "setup", "state"):
                message += (
                    f"\n--- traceback on controller {err.controller} ---\n{err.traceback}"
                    if err.traceback
                    else ""
                )
            raise NodeExecutionError(
                err.node,
                message,
                err.traceback,
                step=err.step,
                controller=err.controller,
                during=err.during,
            )
        raise ControllerError(
            f"controller {err.controller} failed ({err.during}): {err.message}\n{err.traceback}",
            err.controller,
            c.nodes if c else [],
        )

    # --- running ----------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Run one step (no run-ahead) and return what it produced."""
        return self.run(1)[0]

    def run(
        self, steps: int = 1, on_step: Callable[[StepResult], None] | None = None
    ) -> list[StepResult]:
        """Run ``steps`` steps, up to ``pipeline_depth`` of them in flight; results in step order."""
        if self._closed:
            raise RuntimeError(
                "ZmqExecutor: this executor is closed (after close(), an error or Ctrl-C)"
            )
        last = self.next_step + steps
        results = []
        try:
            while self.next_step < last:
                want = min(last, self.next_step + self.pipeline_depth)
                if want > self._until:
                    self._until = want
                    for c in self.controllers:
                        self._send_work(c, m.Run(want))
                result = self._collect(self.next_step)
                self.next_step += 1
                results.append(result)
                if on_step is not None:
                    on_step(result)
        except BaseException as exc:
            self._shutdown(f"{type(exc).__name__} in the driver")
            raise
        return results

    def _collect(self, step: int) -> StepResult:
        # Spin only if the last step's results came within the spin time: a run whose steps
        # take longer (real nodes, a chain over several controllers) never spins, and leaves
        # the cores to the controllers.
        spin = self.spin_s if self._wait_s < self.spin_s else 0.0
        t0 = time.perf_counter()
        while len(self._partial.get(step, ())) < len(self.controllers):
            event = self._next_event(None, "", spin)
            if event is None:
                continue
            identity, kind, msg, value = event
            if kind is m.Kind.STEP_DONE:
                index = self._by_identity[identity].index
                if not self.next_step <= msg.step < self._until or msg.controller != index:
                    self._drops.drop(
                        f"the driver socket (from controller {index})",
                        f"STEP_DONE for step {msg.step} of controller {msg.controller}, while "
                        f"steps {self.next_step}..{self._until - 1} of controller {index} run",
                    )
                    continue
                try:
                    outputs = decode_value(value, where="")
                except DecodeError as exc:
                    where = f"graph outputs of step {msg.step} from controller {index}"
                    raise ControllerError(f"{where}{exc}", index) from None
                self._partial.setdefault(msg.step, {})[index] = (msg, outputs)
            else:
                self._other_event(identity, kind, msg, " during a step")
        self._wait_s = time.perf_counter() - t0
        parts = self._partial.pop(step)
        seconds: dict[str, float] = {}
        starts: dict[str, float] = {}
        outputs: dict[str, Any] = {}
        for done, out in parts.values():
            seconds.update(done.node_seconds)
            starts.update(done.node_start)
            outputs.update(out)
        return StepResult(
            step,
            {k: outputs[k] for k in self.graph.graph_outputs if k in outputs},
            {n: seconds[n] for n in self.order if n in seconds},
            {n: starts[n] for n in self.order if n in starts},
            dict(self.plan.assignment),
        )

    def _other_event(self, identity: bytes, kind: m.Kind, msg: Any, during: str = "") -> None:
        """An event that is not the one being waited for: an error raises, a GOODBYE means the
        controller left, anything else is dropped (and logged)."""
        if kind is m.Kind.ERROR:
            self._raise_error(msg)
        elif kind is m.Kind.GOODBYE:
            self._left(identity)
        else:
            self._drops.drop("the driver socket", f"an unexpected {kind.name}{during}")

    def _left(self, identity: bytes) -> None:
        c = self._by_identity[identity]
        c.state = m.State.STOPPED
        raise ControllerError(f"controller {c.index} left the run {self._when()}", c.index, c.nodes)

    # --- the end ----------------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        """Process ids of the controllers this executor started."""
        return [c.pid for c in self.controllers if c.popen is not None]

    def _shutdown(self, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        with sigint_deferred():
            try:
                for c in self.controllers:
                    if c.identity is not None and c.state is not m.State.STOPPED:
                        self._send(c, m.Shutdown(reason))
                        c.state = m.State.STOPPING
                if not self._res.procs:
                    time.sleep(0.2)  # remote controllers: let the IO thread deliver SHUTDOWN
            finally:
                self._res.cleanup(grace_s=self.shutdown_grace_s)
                self._finalizer.detach()

    def close(self) -> None:
        """Stop every controller (SHUTDOWN, then terminate/kill after a grace period), remove files."""
        self._shutdown("close() called")

    def __enter__(self) -> ZmqExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"next step {self.next_step}"
        return f"<ZmqExecutor {self.graph.name!r}: {len(self.controllers)} controllers, {state}>"
