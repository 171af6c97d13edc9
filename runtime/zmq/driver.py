"""The ZeroMQ executor: a driver in this process, N controller processes, data between them.

::

    from runtime.zmq.driver import ZmqExecutor
    plan = load_graph("graphs.toy").plan(3)
    with ZmqExecutor(plan) as ex:
        results = ex.run(10)          # list[StepResult], the same as LocalExecutor's

The driver starts the controllers and talks to them (:mod:`runtime.zmq.group`, through one
ROUTER: :mod:`runtime.zmq.driver_link`), then only sends small control messages: SETUP,
RUN(until) and SHUTDOWN. Values flow controller to controller; the driver receives per-step
reports (node seconds and the graph's marked outputs, so keep those small) and errors.

Controllers rebuild their nodes (``rebuild``) from ``plan.to_json()`` (``"plan"``: each node's
class and constructor arguments; a controller builds only its own), or from
``load_graph(graph_ref, **graph_options)`` (``"graph"``, for constructor arguments that are not
JSON-able; the wiring is checked against the driver's); ``"auto"`` is ``"plan"`` when the plan
serializes. Node state lives in the controllers: :meth:`ZmqExecutor.state_dict` and
:meth:`~ZmqExecutor.load_state_dict` move it between steps, in the format of
``LocalExecutor.state_dict()``, so a checkpoint of either executor loads into the other.

Faults (docs/RELIABILITY.md): a lost controller is a :class:`ControllerError` naming it and its
nodes; a node call past its ``BatchPolicy.timeout_s`` (or ``node_timeout_s``) a
:class:`NodeTimeoutError` with the stack it was stuck in. What does not decode, is over
``max_message_bytes`` or comes from a stranger is dropped and logged (``dropped_messages``).

Pipelining: up to ``pipeline_depth`` steps are allowed at once in :meth:`~ZmqExecutor.run`.
``max_staleness=N`` makes a delayed edge at step k read the producer's value from a step in
``[k-1-N, k-1]`` (:mod:`runtime.engine.delayed`): with ``staleness="fixed"`` exactly k-1-N
(None before), as in the in-process executor, so runs stay reproducible; with ``"bound"`` the
newest that has reached the reader's controller, so a consumer waits only for a value at most
N versions old. Either way the graph upstream of the delayed edges may run N steps ahead. :meth:`~ZmqExecutor.step`
runs exactly one step with no run-ahead.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from runtime.engine.calls import StepResult
from runtime.engine.delayed import check_staleness_mode
from runtime.engine.switch import check_offload, offloading, switch_metrics
from runtime.errors import ControllerError, HandshakeError, NodeTimeoutError
from runtime.sched.affinity import start_cores
from runtime.sched.devices import Resources, visible_gpus
from runtime.sched.partition import Partitioner
from runtime.sched.replicas import replica_counts
from runtime.zmq import messages as m
from runtime.zmq.cuda_ipc import enabled_from_env, peer_gpus
from runtime.zmq.driver_link import Received
from runtime.zmq.driver_state import merge_replies, split_state
from runtime.zmq.group import ControllerGroup, error_from
from runtime.zmq.keys import load_keys
from runtime.zmq.options import check_options, plan_resources, setup_fields
from runtime.zmq.rebalance import Rebalancer, sched_metrics
from runtime.zmq.serial import DecodeError, decode_value
from runtime.zmq.transport import DEFAULT_MAX_MESSAGE_BYTES
from yatt_graph import Graph, Plan

__all__ = ["ControllerError", "HandshakeError", "NodeTimeoutError", "ZmqExecutor"]


class ZmqExecutor:
    """Run a plan on ``plan.controllers`` controller processes. ``step()`` runs the graph once.

    Args:
        plan: a Plan, or a Graph (planned for ``controllers``, default 1).
        graph_ref / graph_options: the graph module or file and its ``build_graph`` options,
            for ``rebuild="graph"`` (see the module docstring).
        max_staleness: 0 = on-policy (reference semantics); N = delayed edges carry the
            value from N+1 steps back, so the graph upstream of them runs N steps ahead.
        staleness: ``"fixed"`` (reproducible: always the value from N+1 steps back) or
            ``"bound"`` (the newest value at most N versions old); see the module docstring.
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
        num_threads: ``torch.set_num_threads`` in each controller, fixed for the run (0:
            torch's default); None: each controller's ``Resources.threads`` (one per core it
            owns), which adaptive partitioning may change.
        placement / device: what :func:`runtime.sched.devices.assign_resources` gives each
            controller: with ``"colocated"`` and ``max_staleness=0`` every controller gets
            every core (they take turns), else a disjoint share; ``device`` ``"cuda"`` (or
            ``"auto"`` where GPUs are visible) gives each its GPUs (``CUDA_VISIBLE_DEVICES``).
        resources: each controller's :class:`~runtime.sched.devices.Resources` instead.
        offload: ``"auto"``: a controller whose GPU another controller shares under colocated
            placement on-policy offloads its nodes' device state (weights, optimizer state) to
            host memory when its part of a step ends, and reloads it before its next model
            call (:mod:`runtime.engine.switch`); ``"on"``: every controller does (on a CPU
            nothing moves, the switches are still timed); ``"off"``: none. Timed in
            ``StepResult.switches`` and the ``sched/switch_s`` metrics.
        adaptive: re-balance cores between controllers between steps from their measured busy
            time (:mod:`runtime.sched.partition`; ``sched/*`` in :attr:`StepResult.sched`);
            only with ``num_threads=None`` and controllers started here. False keeps the
            starting Resources.
        shm_threshold: tensors of at least this many bytes go controller to controller
            through shared memory (one host); 0 sends everything as zmq frames.
        cuda_ipc: CUDA tensors between controllers this driver started (one host) travel by
            CUDA IPC when every receiver sees the GPU (:mod:`runtime.zmq.cuda_ipc`); False
            copies them through host memory. None: on, unless ``$YATT_CUDA_IPC=0``.
        controller_output: ``"capture"`` (to a log file per controller, whose tail errors
            include) or ``"inherit"`` (this process's stdout/stderr).
        replicas: ``{node: R}``: R copies of an inference node, on the controller that owns it
            and R-1 replica processes beside it (:mod:`runtime.sched.replicas`).
        devices: CPU slots per controller that splittable nodes' calls are cut across
            (:mod:`runtime.sched.splitting`); None/0: none; ``"auto"``: ``$YATT_CPU_SLOTS`` or the
            usable cores of each controller's host.
        spin_s: how long the driver polls its socket without sleeping when it waits for a
            step's result, before it blocks: a reply that comes within it is read with no
            wake-up of a sleeping thread, which on a VM costs tens of microseconds. It spins
            only while the last step's results came within this time (steps of tiny nodes),
            so real steps never spin; 0 turns it off.
        check_finite: stop at the node whose float tensor output holds NaN or inf.
        group: controllers started earlier (:class:`runtime.zmq.group.ControllerGroup`, e.g.
            while the graph was being built); the options they were started with (address,
            keys, output, threads, limits, timeouts) are theirs, not these.
        hang_warning_s: warn (with the stack) when a call without a time limit runs this
            long; 0: past ``max(60 s, 10 x`` the node's longest earlier call), 300 s for a
            first call (:func:`runtime.zmq.control_link.hang_threshold`).
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
        staleness: str = "fixed",
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
        num_threads: int | None = None,
        shm_threshold: int = 1 << 20,
        controller_output: str = "capture",
        devices: int | str | None = None,
        spin_s: float = 0.001,
        check_finite: bool = False,
        hang_warning_s: float = 0.0,
        group: ControllerGroup | None = None,
        replicas: Mapping[str, int] | None = None,
        placement: str = "colocated",
        device: str = "auto",
        resources: Sequence[Resources] | None = None,
        adaptive: bool = True,
        offload: str = "auto",
        cuda_ipc: bool | None = None,
    ):
        if isinstance(plan, Graph):
            plan = plan.plan(controllers or 1)
        elif controllers is not None and controllers != plan.controllers:
            raise ValueError(
                f"ZmqExecutor: the plan has {plan.controllers} controllers, {controllers} were asked for"
            )
        check_options(
            max_staleness, pipeline_depth, rebuild, controller_output, spawn, address,
            allow_tcp, allow_remote, devices, node_timeout_s, max_message_bytes, spin_s,
        )  # fmt: skip
        self.staleness = check_staleness_mode(staleness, "ZmqExecutor")
        if num_threads is not None and (isinstance(num_threads, bool) or num_threads < 0):
            raise ValueError(f"ZmqExecutor: num_threads must be None or >= 0, got {num_threads!r}")
        spawned = spawn if group is None else bool(group.res.procs)
        start = plan_resources(
            plan.controllers, spawn=spawned, placement=placement, max_staleness=max_staleness,
            device=device, resources=resources,
        )  # fmt: skip
        replica_counts(plan.graph.nodes, replicas)  # an unknown or uncopyable node: now, here
        self.offload = offloading(
            check_offload(offload, "ZmqExecutor"), placement=placement,
            max_staleness=max_staleness, resources=start,
        )  # fmt: skip
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
        self._until = 0
        self._partial: dict[int, dict[int, tuple[m.StepDone, dict[str, Any]]]] = {}
        self._closed = False
        self._setup_kw = setup_fields(self.plan, self.order, graph_ref, graph_options, rebuild)
        self._setup_kw.update(
            max_staleness=max_staleness,
            staleness=self.staleness,
            heartbeat_interval_s=heartbeat_interval_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            num_threads=-1 if num_threads is None else num_threads,
            shm_threshold=shm_threshold,
            node_timeout_s=node_timeout_s,
            max_message_bytes=max_message_bytes,
            pipeline_depth=self.pipeline_depth,
            devices=-1 if devices == "auto" else int(devices or 0),
            check_finite=check_finite,
            hang_warning_s=hang_warning_s,
            replicas=dict(replicas or {}),
            offload_controllers=self.offload,
        )
        owned = [
            [n for n in self.order if plan.assignment[n] == c] for c in range(plan.controllers)
        ]
        self.group = group or ControllerGroup(
            plan.controllers, address=address, keys=self.keys, keys_dir=self.keys_dir,
            spawn=spawn, controller_output=controller_output, num_threads=num_threads or 0,
            max_message_bytes=max_message_bytes, heartbeat_interval_s=heartbeat_interval_s,
            heartbeat_timeout_s=heartbeat_timeout_s, startup_timeout_s=startup_timeout_s,
            shutdown_grace_s=shutdown_grace_s, resources=start,
        )  # fmt: skip
        try:
            self.group.attach(owned, self._when, lambda: self._until > 0)
        except ValueError:
            self.group.shutdown("a group that does not fit the plan")
            raise
        self.controllers, self.link = self.group.controllers, self.group.link
        self.address, self.run_dir = self.group.address, self.group.run_dir
        ipc_gpus = self._ipc_gpus(start, enabled_from_env(cuda_ipc))
        try:
            self.group.start(
                lambda c: m.Setup(
                    controller=c.index, peers=[x.data_address for x in self.controllers],
                    run_id=self.group.res.run_id, resources=start[c.index],
                    cuda_ipc_gpus=ipc_gpus, **self._setup_kw,
                )
            )  # fmt: skip
        except BaseException:
            self._shutdown("start-up failed")
            raise
        self._rebalancer: Rebalancer | None = None
        if adaptive and spawned and num_threads is None and len(self.controllers) > 1:
            now = [c.resources or r for c, r in zip(self.controllers, start, strict=True)]
            self._rebalancer = Rebalancer(Partitioner(now, start_cores()))

    def _ipc_gpus(self, start: Sequence[Resources], enabled: bool) -> list[list[int]]:
        """SETUP's ``cuda_ipc_gpus``: the controllers started here (so on this host) and the
        GPUs each sees (runtime.zmq.cuda_ipc.peer_gpus)."""
        on_host = [c.popen is not None for c in self.controllers]
        if not enabled or not any(on_host):
            return []
        driver_gpus = visible_gpus() if any(not r.cuda for r in start) else 0
        gpus = peer_gpus([r.cuda for r in start], on_host, enabled=True, driver_gpus=driver_gpus)
        return gpus if any(gpus) else []

    @property
    def resources(self) -> list[Resources | None]:
        """What each controller reported it computes on (cores, threads, GPUs), by index."""
        return [c.resources for c in self.controllers]

    def set_resources(self, resources: Sequence[Resources]) -> None:
        """Give each controller new cores and threads, applied before its next node call and
        reported in :attr:`resources` once a step has run (a controller that has used CUDA
        already refuses other GPUs). The adaptive partitioner starts over from them."""
        self._check_open()
        new = plan_resources(
            len(self.controllers), spawn=True, placement="colocated", max_staleness=0,
            device="cpu", resources=resources,
        )  # fmt: skip
        for c, r in zip(self.controllers, new, strict=True):
            self.link.send_work(c, m.SetResources(r))
        if self._rebalancer is not None:
            self._rebalancer = Rebalancer(Partitioner(new, start_cores()))

    # --- start-up ---------------------------------------------------------------------------
    @property
    def dropped_messages(self) -> int:
        """How many messages the driver's socket dropped (garbage, oversized, strangers')."""
        return self.link.drops.count

    # --- waiting, liveness ------------------------------------------------------------------
    def _when(self) -> str:
        return (
            f"while running step {self.next_step}"
            if self._until > self.next_step
            else "during start-up"
            if self._until == 0
            else f"after step {self.next_step - 1}"
        )

    def _next_event(
        self, deadline: float | None, waiting_for: str, spin_s: float = 0.0
    ) -> Received | None:
        return self.group.next_event(deadline, waiting_for, spin_s)

    def _raise_error(self, err: m.Error) -> None:
        raise error_from(err, self.controllers)

    # --- running ----------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Run one step (no run-ahead) and return what it produced."""
        return self.run(1)[0]

    def run(
        self,
        steps: int = 1,
        on_step: Callable[[StepResult], None] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> list[StepResult]:
        """Run ``steps`` steps, up to ``pipeline_depth`` of them in flight; results in step order.

        ``stop()``, asked after each step, ends the run early: no step is started after it
        says so, the ones in flight are finished, and the executor stays usable (between
        steps, so ``state_dict()`` works): how a SIGTERM still gets its checkpoint.
        """
        self._check_open()
        last = self.next_step + steps
        results = []
        if self._rebalancer is not None:
            self._rebalancer.start()
        try:
            while self.next_step < last:
                if results and stop is not None and stop():
                    last = min(last, self._until)  # finish the steps in flight, start no more
                want = min(last, self.next_step + self.pipeline_depth)
                if want > self._until:
                    self._until = want
                    for c in self.controllers:
                        self.link.send_work(c, m.Run(want))
                result = self._collect(self.next_step)
                self.next_step += 1
                self._rebalance(result)
                results.append(result)
                if on_step is not None:
                    on_step(result)
        except BaseException as exc:
            self._shutdown(f"{type(exc).__name__} in the driver")
            raise
        return results

    def _rebalance(self, result: StepResult) -> None:
        """Send the partitioner's new Resources (if it decides a change); the step's sched/*."""
        result.sched = sched_metrics(self.resources)
        if self.offload:
            result.sched.update(switch_metrics(result.switches, self.offload))
        if self._rebalancer is None:
            return
        new = self._rebalancer.after_step(result)
        for c, r in zip(self.controllers, new or (), strict=False):
            if r != c.resources:
                self.link.send_work(c, m.SetResources(r))
        result.sched.update(self._rebalancer.metrics())

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
            if event.kind is not m.Kind.STEP_DONE:
                self._other_event(event, " during a step")
                continue
            msg, index = event.msg, self.link.by_identity[event.identity].index
            if not self.next_step <= msg.step < self._until or msg.controller != index:
                self.link.drops.drop(
                    f"the driver socket (from controller {index})",
                    f"STEP_DONE for step {msg.step} of controller {msg.controller}, while "
                    f"steps {self.next_step}..{self._until - 1} of controller {index} run",
                )
                continue
            try:
                outputs = decode_value(event.value, where="")
            except DecodeError as exc:
                where = f"graph outputs of step {msg.step} from controller {index}"
                raise ControllerError(f"{where}{exc}", index) from None
            self._partial.setdefault(msg.step, {})[index] = (msg, outputs)
            if msg.resources is not None:  # it applied a RESOURCES
                self.controllers[index].resources = msg.resources
        self._wait_s = time.perf_counter() - t0
        parts = self._partial.pop(step)
        seconds: dict[str, float] = {}
        starts: dict[str, float] = {}
        staleness: dict[str, int | None] = {}
        outputs: dict[str, Any] = {}
        switches: list[tuple[str, float, float, int, int]] = []
        for done, out in parts.values():
            switches += done.switches
            seconds.update(done.node_seconds)
            starts.update(done.node_start)
            staleness.update(done.staleness)
            outputs.update(out)
        return StepResult(
            step,
            {k: outputs[k] for k in self.graph.graph_outputs if k in outputs},
            {n: seconds[n] for n in self.order if n in seconds},
            {n: starts[n] for n in self.order if n in starts},
            dict(self.plan.assignment),
            dict(sorted(staleness.items())),
            switches=sorted(switches, key=lambda s: s[1]),
        )

    def _other_event(self, event: Received, during: str = "") -> None:
        """An event that is not the one being waited for: an error raises, a GOODBYE means the
        controller left, anything else is dropped (and logged)."""
        if event.kind is m.Kind.ERROR:
            self._raise_error(event.msg)
        elif event.kind is m.Kind.GOODBYE:
            c = self.link.by_identity[event.identity]
            c.state = m.State.STOPPED
            raise ControllerError(
                f"controller {c.index} left the run {self._when()}", c.index, c.nodes
            )
        else:
            self.link.drops.drop("the driver socket", f"an unexpected {event.kind.name}{during}")

    # --- state, between steps ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every node's state, the delayed-edge values, RNG states and the step, from the
        controllers, in the format of ``LocalExecutor.state_dict()`` (plus ``rng["controllers"]``,
        each controller's RNG states). Tensors arrive on the CPU. Call it between steps."""
        step = self.next_step
        request = {c.index: (m.StateRequest(step), None) for c in self.controllers}
        replies = self._exchange(request, m.Kind.STATE_REPLY, step, "send the state of their nodes")
        executor = {
            "kind": "zmq",
            "controllers": len(self.controllers),
            "max_staleness": self.max_staleness,
            "staleness": self.staleness,
        }
        try:
            return merge_replies(replies, step, self.order, executor)
        except ControllerError:
            self._shutdown("a bad state reply")
            raise

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` (of this executor or of a LocalExecutor) into the controllers.

        The next step run is ``state["step"]``. Data still in flight from before is dropped
        (each restore starts a new epoch). Call it between steps.
        """
        missing = sorted(set(self.graph.nodes) - set(state.get("nodes", {})))
        if missing:
            raise ValueError(
                f"checkpoint has no state for node(s) {missing}; was it written by this graph?"
            )
        step = int(state["step"])
        read_by = [
            {(e.src, e.src_port) for e in self.graph.edges if e.delay and e.dst in c.nodes}
            for c in self.controllers
        ]
        frames = split_state(
            state, [c.nodes for c in self.controllers], read_by, 1 + self.max_staleness
        )
        self._epoch += 1
        load = {i: (m.StateLoad(step, self._epoch), f) for i, f in enumerate(frames)}
        self._exchange(load, m.Kind.STATE_LOADED, step, "restore the state of their nodes")
        self.next_step = self._until = step

    def _exchange(
        self, messages: dict[int, tuple[Any, list[Any] | None]], reply: m.Kind, step: int, what: str
    ) -> dict[int, list[Any]]:
        """Send each controller its message; wait for every one's ``reply`` (value frames)."""
        self._check_open()
        if self._until != self.next_step:
            raise RuntimeError("ZmqExecutor: state can move only between steps, not during run()")
        got: dict[int, list[Any]] = {}
        deadline = time.monotonic() + self.state_timeout_s
        try:
            for c in self.controllers:
                msg, value = messages[c.index]
                self.link.send_work(c, msg, value)
            while len(got) < len(self.controllers):
                event = self._next_event(None, "")
                if event is None:
                    if time.monotonic() > deadline:
                        late = sorted(set(range(len(self.controllers))) - set(got))
                        raise ControllerError(
                            f"controllers {late} did not {what} within {self.state_timeout_s:.0f}s "
                            "(state_timeout_s)",
                            late[0],
                            self.controllers[late[0]].nodes,
                        )
                    continue
                if event.kind is reply and event.msg.step == step:
                    got[self.link.by_identity[event.identity].index] = event.value
                else:
                    self._other_event(event)
        except BaseException as exc:
            self._shutdown(f"{type(exc).__name__} in the driver")
            raise
        return got

    # --- the end ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "ZmqExecutor: this executor is closed (after close(), an error or Ctrl-C)"
            )

    @property
    def closed(self) -> bool:
        """Whether the controllers are gone (after close(), an error or Ctrl-C)."""
        return self._closed

    @property
    def pids(self) -> list[int]:
        """Process ids of the controllers this executor started."""
        return [c.pid for c in self.controllers if c.popen is not None]

    def _shutdown(self, reason: str) -> None:
        self._closed = True
        self.group.shutdown(reason)

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
