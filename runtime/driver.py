"""The ZeroMQ executor: a driver in this process, N controller processes, data between them.

::

    from runtime.driver import ZmqExecutor
    plan = load_graph("graphs.toy").plan(3)
    with ZmqExecutor(plan) as ex:
        results = ex.run(10)          # list[StepResult], the same as LocalExecutor's

The driver binds a ROUTER socket (``ipc://`` in a fresh temporary directory, removed at
close), starts the controllers (``python -m runtime.controller``, plain subprocesses: no
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
shipped (load checkpoints through ``state_dict`` instead).

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
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from runtime import messages as m
from runtime.controller import graph_digest
from runtime.local import StepResult
from runtime.serial import DecodeError, decode_value
from runtime.transport import make_socket, remove_run_segments, send
from yatt_graph import Graph, NodeExecutionError, Plan

__all__ = ["ControllerError", "HandshakeError", "ZmqExecutor"]


class ControllerError(RuntimeError):
    """A controller died, went silent, or failed outside a node; names it and its nodes."""

    def __init__(self, message: str, controller: int = -1, nodes: list[str] | None = None):
        super().__init__(message)
        self.controller, self.nodes = controller, list(nodes or [])


class HandshakeError(ControllerError):
    """A controller that could not join: protocol mismatch, timeout, or exit during start-up."""


class _Controller:
    def __init__(self, index: int, nodes: list[str]):
        self.index, self.nodes = index, nodes
        self.popen: subprocess.Popen[bytes] | None = None
        self.log_path = ""
        self.identity: bytes | None = None
        self.data_address = ""
        self.pid = 0
        self.state = m.State.STARTING

    def log_tail(self, chars: int = 3000) -> str:
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - chars))
                text = f.read().decode(errors="replace").strip()
        except OSError:
            return ""
        return f"\n--- last lines of controller {self.index}'s output ---\n{text}" if text else ""


class _Resources:
    """Everything that must go at close, even when the executor object is lost (weakref.finalize)."""

    def __init__(self, run_dir: str, run_id: str):
        self.run_dir, self.run_id = run_dir, run_id
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ctx: zmq.Context | None = None
        self.io_stop = threading.Event()
        self.io_thread: threading.Thread | None = None
        self.done = False

    def cleanup(self, grace_s: float = 0.0) -> None:
        if self.done:
            return
        self.done = True
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5.0)
        self.io_stop.set()
        if self.io_thread is not None and self.io_thread is not threading.current_thread():
            self.io_thread.join(timeout=2.0)
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.run_id:
            remove_run_segments(self.run_id)


@contextlib.contextmanager
def _sigint_deferred():
    """Hold Ctrl-C while shutting down (bounded by timeouts), so clean-up is not cut short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    old = signal.signal(signal.SIGINT, lambda s, f: caught.append(s))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if caught and callable(old):
        old(signal.SIGINT, None)


class ZmqExecutor:
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
            ``tcp://`` needs ``allow_tcp=True`` (no authentication yet: trusted networks only).
        num_threads: ``torch.set_num_threads`` in each controller (0: torch's default).
        shm_threshold: tensors of at least this many bytes go controller to controller
            through shared memory (one host); 0 sends everything as zmq frames.
        controller_output: ``"capture"`` (to a log file per controller, whose tail errors
            include) or ``"inherit"`` (this process's stdout/stderr).
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
        heartbeat_interval_s: float = 0.5,
        heartbeat_timeout_s: float = 5.0,
        startup_timeout_s: float = 120.0,
        shutdown_grace_s: float = 5.0,
        num_threads: int = 1,
        shm_threshold: int = 1 << 20,
        controller_output: str = "capture",
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
        if address and address.startswith("tcp://") and not allow_tcp:
            raise ValueError(
                f"ZmqExecutor: {address} is a tcp address; pass allow_tcp=True to accept controllers over "
                "the network (unauthenticated: use on trusted networks only)"
            )
        self.plan, self.graph = plan, plan.graph
        self.graph.validate()
        self.order = self.graph.topological_order()
        self.max_staleness = max_staleness
        self.pipeline_depth = max(pipeline_depth, max_staleness + 1)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_grace_s = shutdown_grace_s
        self.next_step = 0
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
        )

        run_dir = tempfile.mkdtemp(prefix="yatt-")
        self.run_dir = run_dir
        self._res = _Resources(run_dir, os.path.basename(run_dir) if spawn else "")
        self._finalizer = weakref.finalize(self, self._res.cleanup)
        self.address = address or f"ipc://{run_dir}/driver"
        owned = {
            c: [n for n in self.order if plan.assignment[n] == c] for c in range(plan.controllers)
        }
        self.controllers = [_Controller(c, owned[c]) for c in range(plan.controllers)]
        self._by_identity: dict[bytes, _Controller] = {}
        self._last_seen: dict[bytes, float] = {}
        self._events: collections.deque[tuple[Any, ...]] = collections.deque()
        try:
            self._start_io()
            if spawn:
                self._spawn(controller_output, num_threads)
            self._handshake()
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
            digest=graph_digest(self.graph.edges, self.graph.graph_outputs),
        )

    def _start_io(self) -> None:
        ctx = self._res.ctx = zmq.Context()
        self._router = make_socket(ctx, zmq.ROUTER, self.address, bind=True)
        # The calling thread uses the socket itself (no hop through an IO thread: dispatch
        # latency); a lock lets the heartbeat thread share it while the caller is elsewhere.
        self._lock = threading.Lock()
        interval = self._setup_kw["heartbeat_interval_s"]
        thread = threading.Thread(
            target=self._heartbeat_loop, args=(interval,), name="yatt-heartbeat", daemon=True
        )
        self._res.io_thread = thread
        thread.start()

    def _spawn(self, output: str, num_threads: int) -> None:
        paths = [p or os.getcwd() for p in sys.path]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
        if num_threads > 0:
            env.setdefault("OMP_NUM_THREADS", str(num_threads))
        main = threading.current_thread() is threading.main_thread()
        old = (
            signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        )  # children inherit 'ignore'
        try:
            for c in self.controllers:
                cmd = [
                    sys.executable, "-m", "runtime.controller", "--connect", self.address,
                    "--index", str(c.index), "--bind", f"ipc://{self.run_dir}/c{c.index}",
                    "--parent-pid", str(os.getpid()), "--spawned",
                    "--startup-timeout", str(self.startup_timeout_s),
                ]  # fmt: skip
                out: Any = None
                if output == "capture":
                    c.log_path = os.path.join(self.run_dir, f"controller-{c.index}.log")
                    out = open(c.log_path, "wb")  # noqa: SIM115 - the child holds it
                try:
                    c.popen = subprocess.Popen(
                        cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT if out else None,
                        env=env, cwd=os.getcwd(),
                    )  # fmt: skip
                finally:
                    if out is not None:
                        out.close()
                c.pid = c.popen.pid
                self._res.procs.append(c.popen)
        finally:
            if main:
                signal.signal(signal.SIGINT, old)

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
        c.identity, c.pid, c.state = identity, hello.pid, m.State.CONNECTED
        c.data_address = hello.data_address
        self._by_identity[identity] = c

    # --- the socket: heartbeats and receiving -----------------------------------------------
    def _heartbeat_loop(self, interval: float) -> None:
        beat = m.encode_header(m.Heartbeat())
        stop = self._res.io_stop
        while not stop.wait(interval):
            with self._lock:
                if stop.is_set():
                    return
                for identity in list(self._by_identity):
                    with contextlib.suppress(zmq.ZMQError):  # gone: the liveness check says so
                        self._router.send_multipart([identity, *beat])
                self._pump(0)  # keep last-seen times fresh while the caller is away

    def _pump(self, timeout_ms: int) -> None:
        """Receive everything waiting (the caller holds the lock) into the event deque."""
        if not self._router.poll(timeout_ms):
            return
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            self._last_seen[identity] = time.monotonic()
            self._dispatch(identity, frames[1:])

    def _dispatch(self, identity: bytes, frames: list[Any]) -> None:
        if len(frames) >= 2 and frames[0].bytes == m.Kind.HELLO.frame:
            try:
                version = m.hello_protocol(frames[1])
            except m.ProtocolError as exc:
                self._events.append(("refused", identity, str(exc)))
                return
            if version != m.PROTOCOL_VERSION:
                reason = (
                    f"this controller speaks protocol {version}, the driver speaks {m.PROTOCOL_VERSION}; "
                    "run the same yatt-graph version on the driver and every controller"
                )
                self._router.send_multipart([identity, *m.encode_header(m.Refused(reason))])
                self._events.append(("refused", identity, reason))
                return
        try:
            kind, msg = m.decode_header(frames[0], frames[1]) if len(frames) >= 2 else (None, None)
        except m.ProtocolError as exc:
            self._events.append(("bad", identity, str(exc)))
            return
        if kind is None:
            self._events.append(("bad", identity, f"a message of {len(frames)} frames"))
        elif kind is not m.Kind.HEARTBEAT:
            self._events.append((identity, kind, msg, frames[2:]))

    def _send_raw(self, identity: bytes, msg: Any) -> None:
        with self._lock, contextlib.suppress(zmq.ZMQError):  # a gone peer: liveness reports it
            send(self._router, msg, prefix=[identity])

    def _send(self, c: _Controller, msg: Any) -> None:
        if c.identity is not None:
            self._send_raw(c.identity, msg)

    # --- waiting, liveness ------------------------------------------------------------------
    def _next_event(self, deadline: float | None, waiting_for: str) -> tuple[Any, ...] | None:
        if not self._events:
            with self._lock:
                self._pump(20)
        event = self._events.popleft() if self._events else None
        if event is not None and event[0] in ("refused", "bad"):
            c = self._by_identity.get(event[1])
            raise HandshakeError(
                f"a controller{f' ({c.index})' if c else ''} could not join the driver at {self.address}: {event[2]}",
                c.index if c else -1,
                c.nodes if c else [],
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
                raise cls(
                    f"controller {c.index} (pid {c.pid}) exited with code {rc} {self._when()}; it owned "
                    f"nodes {c.nodes}" + c.log_tail(),
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
                    f"{c.nodes}; it is dead, hung outside Python, or its host is unreachable",
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
        if err.node and err.during in ("step", "setup", "send"):
            message = err.message
            if err.during == "send" or err.during == "setup":
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
                        self._send(c, m.Run(want))
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
        while len(self._partial.get(step, ())) < len(self.controllers):
            event = self._next_event(None, "")
            if event is None:
                continue
            identity, kind, msg, value = event
            if kind is m.Kind.STEP_DONE:
                where = f"graph outputs of step {msg.step} from controller {msg.controller}"
                try:
                    outputs = decode_value(value, where=where)
                except DecodeError as exc:
                    raise ControllerError(str(exc), msg.controller) from None
                self._partial.setdefault(msg.step, {})[msg.controller] = (msg, outputs)
            elif kind is m.Kind.ERROR:
                self._raise_error(msg)
            elif kind is m.Kind.GOODBYE:
                c = self._by_identity[identity]
                c.state = m.State.STOPPED
                raise ControllerError(
                    f"controller {c.index} left the run {self._when()}", c.index, c.nodes
                )
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

    # --- the end ----------------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        """Process ids of the controllers this executor started."""
        return [c.pid for c in self.controllers if c.popen is not None]

    def _shutdown(self, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        with _sigint_deferred():
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
