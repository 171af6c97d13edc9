"""The ZeroMQ executor: a driver in this process, N controller processes, data between them.

::

    from runtime.zmq.driver import ZmqExecutor
    plan = load_graph("graphs.toy").plan(3)
    with ZmqExecutor(plan) as ex:
        results = ex.run(10)          # list[StepResult], the same as LocalExecutor's

The driver starts the controllers and talks to them (:mod:`runtime.zmq.controllers`, through one
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

Pipelining: up to ``RunConfig.window`` steps run at once in :meth:`~ZmqExecutor.run`, so the
graph upstream of delayed edges runs up to ``max_staleness`` steps ahead (with ``staleness=
"bound"`` a delayed edge reads the newest value that has reached the reader's controller);
:meth:`~ZmqExecutor.step` runs exactly one step with no run-ahead.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Sequence
from typing import Any

from runtime.codec import DecodeError, decode_value
from runtime.codec.cuda_ipc import enabled_from_env
from runtime.engine.calls import OnStep, StepResult, Stop
from runtime.engine.config import RunConfig, merged_config
from runtime.engine.switch import offloading, switch_metrics
from runtime.errors import ControllerError, HandshakeError, NodeTimeoutError
from runtime.sched.adaptive import Partitioner
from runtime.sched.affinity import start_cores
from runtime.sched.devices import Resources
from runtime.sched.fanout import replica_counts
from runtime.zmq import STARTUP_TIMEOUT_S
from runtime.zmq import messages as m
from runtime.zmq.controllers import Controllers, error_from
from runtime.zmq.driver_link import Received
from runtime.zmq.driver_state import merge_replies, state_frames
from runtime.zmq.keys import load_keys
from runtime.zmq.options import check_executor_arguments, plan_resources, setup_fields, setup_gpus
from runtime.zmq.rebalance import Rebalancer, sched_metrics
from yatt_graph import Graph, Plan

__all__ = ["ControllerError", "HandshakeError", "NodeTimeoutError", "ZmqExecutor"]


class ZmqExecutor:
    """Run a plan on ``plan.controllers`` controller processes. ``step()`` runs the graph once.

    Args:
        plan: a Plan, or a Graph (planned for ``controllers``, default 1).
        config: the run's options (:class:`~runtime.engine.config.RunConfig`), sent to every
            controller in its SETUP. Keyword ``options`` are fields of it, over it.
        graph_ref / graph_options: the graph module or file and its ``build_graph`` options,
            for ``rebuild="graph"`` (see the module docstring).
        spawn: start the controllers here; False waits for ``yatt-graph controller
            --connect ADDRESS`` processes (``address`` must then be given).
        address: the driver's address; default ``ipc://`` in a fresh temporary directory.
            ``tcp://`` needs ``allow_tcp=True``; a non-loopback tcp address also needs
            ``allow_remote=True``. ``tcp://127.0.0.1:*`` picks a free port (see ``address``).
        keys: a ``yatt-graph keys`` folder: CURVE on every socket (:mod:`runtime.zmq.keys`).
        controller_output: ``"capture"`` (to a log file per controller, whose tail errors
            include) or ``"inherit"`` (this process's stdout/stderr).
        group: controllers started earlier (:class:`runtime.zmq.controllers.Controllers`, e.g.
            while the graph was being built); the options they were started with (address,
            keys, output, threads, limits, timeouts) are theirs, not these.
        resources: each controller's :class:`~runtime.sched.devices.Resources`, instead of
            what ``config.placement`` and ``config.device`` give
            (:func:`runtime.sched.devices.assign_resources`).
        state_timeout_s: how long :meth:`state_dict` / :meth:`load_state_dict` wait.
    """

    def __init__(
        self,
        plan: Plan | Graph,
        config: RunConfig | None = None,
        *,
        controllers: int | None = None,
        graph_ref: str | None = None,
        graph_options: dict[str, Any] | None = None,
        rebuild: str = "auto",
        spawn: bool = True,
        address: str | None = None,
        allow_tcp: bool = False,
        allow_remote: bool = False,
        keys: str | os.PathLike[str] | None = None,
        controller_output: str = "capture",
        group: Controllers | None = None,
        resources: Sequence[Resources] | None = None,
        state_timeout_s: float = 600.0,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        shutdown_grace_s: float = 5.0,
        **options: Any,
    ):
        self.config = config = merged_config(config, options, "ZmqExecutor")
        if isinstance(plan, Graph):
            plan = plan.plan(controllers or 1)
        elif controllers is not None and controllers != plan.controllers:
            raise ValueError(
                f"ZmqExecutor: the plan has {plan.controllers} controllers, {controllers} were asked for"
            )
        check_executor_arguments(
            rebuild, controller_output, spawn, address, allow_tcp, allow_remote
        )
        self.max_staleness, self.staleness = config.max_staleness, config.staleness
        spawned = spawn if group is None else bool(group.res.procs)
        start = plan_resources(
            plan.controllers, spawn=spawned, placement=config.placement,
            max_staleness=config.max_staleness, device=config.device, resources=resources,
        )  # fmt: skip
        replica_counts(plan.graph.nodes, config.replicas)  # an unknown or uncopyable node: now
        self.offload = offloading(
            config.offload, placement=config.placement, max_staleness=config.max_staleness,
            resources=start,
        )  # fmt: skip
        self.spin_s = float(config.spin_s)
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
        self.pipeline_depth = config.window
        self.state_timeout_s = state_timeout_s
        self.next_step = 0
        self._epoch = 0
        self._until = 0
        self._partial: dict[int, dict[int, tuple[m.StepDone, dict[str, Any]]]] = {}
        self._closed = False
        setup_kw = setup_fields(self.plan, self.order, graph_ref, graph_options, rebuild)
        setup_kw.update(config=config, offload_controllers=self.offload)
        owned = [
            [n for n in self.order if plan.assignment[n] == c] for c in range(plan.controllers)
        ]
        self.group = group or Controllers(
            plan.controllers, address=address, keys=self.keys, keys_dir=self.keys_dir,
            spawn=spawn, controller_output=controller_output,
            num_threads=config.num_threads or 0, max_message_bytes=config.max_message_bytes,
            heartbeat_interval_s=config.heartbeat_interval_s,
            heartbeat_timeout_s=config.heartbeat_timeout_s, startup_timeout_s=startup_timeout_s,
            shutdown_grace_s=shutdown_grace_s, resources=start,
        )  # fmt: skip
        try:
            self.group.attach(owned, self._when, lambda: self._until > 0)
        except ValueError:
            self.group.shutdown("a group that does not fit the plan")
            raise
        self.controllers, self.link = self.group.controllers, self.group.link
        self.address, self.run_dir = self.group.address, self.group.run_dir
        on_host = [c.child is not None for c in self.controllers]
        ipc_gpus = setup_gpus([r.cuda for r in start], on_host, enabled_from_env(config.cuda_ipc))
        self._stores: list[Any] = []
        spans: list[tuple[dict[str, Any], dict[str, Any]]] = []  # once all said where they are

        def setup(c: Any) -> m.Setup:
            if not spans:
                spans.append(self._rendezvous(config))
            rank_groups, replica_hosts = spans[0]
            return m.Setup(
                controller=c.index, peers=[x.data_address for x in self.controllers],
                run_id=self.group.res.run_id, resources=start[c.index], cuda_ipc_gpus=ipc_gpus,
                rank_groups=rank_groups, replica_hosts=replica_hosts, **setup_kw,
            )  # fmt: skip

        try:
            self.group.start(setup)
        except BaseException:
            self._shutdown("start-up failed")
            raise
        self._rebalancer: Rebalancer | None = None
        if config.adaptive and spawned and config.num_threads is None and len(self.controllers) > 1:
            now = [c.resources or r for c, r in zip(self.controllers, start, strict=True)]
            self._rebalancer = Rebalancer(Partitioner(now, start_cores()))

    def _rendezvous(self, config: RunConfig) -> tuple[dict[str, Any], dict[str, Any]]:
        """What spans hosts: the rank groups (``config.ranks_per_host``) and the replicas
        (``config.replicas_per_host``); their placements, and their stores hosted here (kept
        as long as the executor)."""
        from runtime.ranks.placement import host_of
        from runtime.sched.fanout import replica_counts

        here = host_of(self.address, "127.0.0.1")
        hosts = [host_of(c.data_address, here) for c in self.controllers]
        rank_groups: dict[str, Any] = {}
        if config.ranks_per_host:
            from runtime.ranks.group import rendezvous

            rank_groups, stores = rendezvous(
                self.graph.nodes, self.plan.assignment, config.ranks_per_host, hosts, here
            )
            self._stores += stores
        replica_hosts: dict[str, Any] = {}
        if config.replicas_per_host:
            from runtime.zmq.replicas import replica_rendezvous

            counts = replica_counts(self.graph.nodes, config.replicas)
            replica_hosts, stores = replica_rendezvous(
                counts, config.replicas_per_host, self.plan.assignment, hosts, here
            )
            self._stores += stores
        return rank_groups, replica_hosts

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

    # --- running ----------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Run one step (no run-ahead) and return what it produced."""
        return self.run(1)[0]

    def run(self, steps: int = 1, on_step: OnStep = None, stop: Stop = None) -> list[StepResult]:
        """Run ``steps`` steps, up to ``pipeline_depth`` of them in flight; results in step order,
        each to ``on_step`` or, without one, into the list returned (as ``LocalExecutor.run``).

        ``stop()``, asked after each step, ends the run early: no step is started after it
        says so, the ones in flight are finished, and the executor stays usable (between
        steps, so ``state_dict()`` works): how a SIGTERM still gets its checkpoint.
        """
        self._check_open()
        first = self.next_step
        last = first + steps
        results: list[StepResult] = []
        if self._rebalancer is not None:
            self._rebalancer.start()
        try:
            while self.next_step < last:
                if self.next_step > first and stop is not None and stop():
                    last = min(last, self._until)  # finish the steps in flight, start no more
                want = min(last, self.next_step + self.pipeline_depth)
                if want > self._until:
                    self._until = want
                    for c in self.controllers:
                        self.link.send_work(c, m.Run(want))
                result = self._collect(self.next_step)
                self.next_step += 1
                self._rebalance(result)
                (on_step or results.append)(result)
        except BaseException as exc:
            self._shutdown(f"{type(exc).__name__} in the driver")
            raise
        return results

    def _rebalance(self, result: StepResult) -> None:
        """Send the partitioner's new Resources (if it decides a change); the step's sched/*."""
        result.sched.update(sched_metrics(self.resources))
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
            event = self.group.next_event(None, "", spin)
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
        parts = self._partial.pop(step).values()  # each controller's (StepDone, outputs)
        merged = {
            f: {k: v for done, _ in parts for k, v in getattr(done, f).items()}
            for f in ("node_seconds", "node_start", "staleness", "replicas")
        }
        outputs = {k: v for _, out in parts for k, v in out.items()}
        seconds, starts = merged["node_seconds"], merged["node_start"]
        return StepResult(
            step,
            {k: outputs[k] for k in self.graph.graph_outputs if k in outputs},
            {n: seconds[n] for n in self.order if n in seconds},
            {n: starts[n] for n in self.order if n in starts},
            dict(self.plan.assignment),
            dict(sorted(merged["staleness"].items())),
            sched={"sched/ipc_bytes": float(sum(done.ipc_bytes for done, _ in parts))},
            switches=sorted((s for done, _ in parts for s in done.switches), key=lambda s: s[1]),
            replicas=merged["replicas"],
        )

    def _other_event(self, event: Received, during: str = "") -> None:
        """An event that is not the one being waited for: an error raises, a GOODBYE means the
        controller left, anything else is dropped (and logged)."""
        if event.kind is m.Kind.ERROR:
            raise error_from(event.msg, self.controllers)
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
        executor = {"kind": "zmq", "controllers": len(self.controllers),
                    "max_staleness": self.max_staleness, "staleness": self.staleness}  # fmt: skip
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
        step = int(state["step"])
        owned = [c.nodes for c in self.controllers]
        frames = state_frames(state, self.graph, owned, 1 + self.max_staleness)
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
                event = self.group.next_event(None, "")
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
        return [c.pid for c in self.controllers if c.child is not None]

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
