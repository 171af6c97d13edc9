"""The step engine: what is ready to run, and what a finished node call hands on.

One engine holds the nodes of one process (all of them in-process, a controller's share on the
ZeroMQ runtime) and has no sockets inside. It keeps, per step, the inputs that have arrived,
and a node may run step k once the engine was allowed step k (:meth:`StepEngine.allow`), the
node has finished step k-1, and all of its inputs for step k are in. An input on a delayed edge
reads a value the producer made at a step in ``[k-1-max_staleness, k-1]``: exactly the oldest
(``staleness="fixed"``, None for the first ``1 + max_staleness`` steps) or the newest there is
(``"bound"``), by the rule of :mod:`runtime.engine.engine`; each step reports how many
versions old each such read was (``StepResult.staleness``). Among ready nodes the lowest
(step, topological index) goes first, so one process running one step at a time runs the
graph's topological order.

Values reach the engine from its own nodes (handed on directly when a call ends) or from
another process (:meth:`deliver`, :meth:`deliver_piece`, :meth:`end_stream`); what must leave
goes to the ``outbox`` (the controller's sockets). Streamed outputs feed their consumers here
piece by piece (:class:`~runtime.engine.streams.StreamFeeder`), the same in every process, so a
ZeroMQ run equals the in-process one. :meth:`finished` gives each step once every node here has run it;
:meth:`state` and :meth:`restore` move its state between steps, for checkpoints.

:class:`LocalExecutor <runtime.engine.engine.LocalExecutor>` is this engine plus a loop; a
:class:`Controller <runtime.zmq.controller.Controller>` is this engine plus sockets.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, Protocol

from runtime.engine.calls import (
    OnStep,
    Running,
    StepResult,
    Stop,
    TensorMoves,
    host_copy,
    node_devices,
    node_op,
    run_node,
    start_nodes,
    stream_node,
)
from runtime.engine.config import RunConfig, check_staleness_mode, merged_config
from runtime.engine.rng import rng_state, set_rng_state
from runtime.engine.streams import StreamFeeder
from runtime.engine.switch import Switch, switch_metrics
from yatt_graph import Graph, NodeExecutionError, Plan
from yatt_graph.stream import Piece

__all__ = ["DelayedValues", "LocalExecutor", "Outbox", "StateNotReady", "StepEngine", "StepResult"]


class Outbox(Protocol):
    """Where the values that other processes read go (a controller's peer sockets)."""

    def value(self, step: int, src: str, port: str, value: Any, dests: list[int]) -> None: ...

    def piece(
        self, step: int, src: str, port: str, index: int, piece: Piece, dests: list[int]
    ) -> None: ...

    def end(self, step: int, src: str, port: str, count: int, dests: list[int]) -> None: ...


class StateNotReady(Exception):
    """:meth:`StepEngine.state` was asked before the step before it finished here."""


class StepEngine:
    """The nodes of one process and the state of the steps they run (see the module docstring).

    Args:
        nodes: the nodes this engine runs, by name (already set up, or set up lazily).
        edges: every edge of the graph; outputs: the graph's marked outputs (name -> handle).
        order: every node of the graph in topological order.
        assignment: node -> controller, for the nodes of other processes (their values come
            through :meth:`deliver` and go out through ``outbox``).
        here: this process's controller index (in error messages and results).
        max_staleness: a delayed edge at step k reads a value from steps ``[k-1-max_staleness,
            k-1]``; staleness: which one: ``"fixed"`` (the oldest: reproducible) or ``"bound"``
            (the newest that has arrived), see :mod:`runtime.engine.engine`.
        window: the most steps allowed at once; values for steps further ahead are refused.
        limits: node -> the longest one call may run (for :class:`Running`), 0: none.
        switch: ``"phase"`` or ``"roles"``: offload and reload the nodes' device state when
            roles take turns on a device (:mod:`runtime.engine.switch`); None: never.
        devices: every node's device by name (:func:`~runtime.engine.calls.node_devices`),
            for what each reader takes of a value (:mod:`runtime.engine.calls`); None: the
            devices of ``nodes`` (the nodes of other processes count as on the CPU).
    """

    def __init__(
        self,
        nodes: Mapping[str, Any],
        edges: Sequence[Any],
        outputs: Mapping[str, Any],
        order: Sequence[str],
        assignment: Mapping[str, int],
        *,
        here: int = 0,
        max_staleness: int = 0,
        staleness: str = "fixed",
        window: int = 1,
        outbox: Outbox | None = None,
        fanouts: Any = None,
        check_finite: bool = False,
        limits: Mapping[str, float] | None = None,
        switch: str | None = None,
        devices: Mapping[str, str] | None = None,
    ):
        self.nodes = dict(nodes)
        self.moves = TensorMoves(
            node_devices(self.nodes) if devices is None else devices, edges, assignment
        )
        self.order = [n for n in order if n in self.nodes]
        self.here, self.lag, self.window = here, 1 + max_staleness, max(1, window)
        self.max_staleness, self.staleness_mode = max_staleness, staleness
        DelayedValues(max_staleness, staleness)  # checks the mode before anything is kept
        self.outbox, self.fanouts, self.check_finite = outbox, fanouts, check_finite
        self.limits = dict.fromkeys(self.nodes, 0.0) | dict(limits or {})
        self.in_edges: dict[str, list[Any]] = {n: [] for n in self.nodes}
        self.local_out: dict[tuple[str, str], list[Any]] = defaultdict(list)
        self.remote_out: dict[tuple[str, str], list[int]] = defaultdict(list)
        self.remote_in: dict[tuple[str, str], list[Any]] = defaultdict(list)
        for e in edges:
            dst_here, src_here = e.dst in self.nodes, e.src in self.nodes
            if dst_here:
                self.in_edges[e.dst].append(e)
            if src_here and dst_here:
                self.local_out[(e.src, e.src_port)].append(e)
            elif dst_here:
                self.remote_in[(e.src, e.src_port)].append(e)
            elif src_here:
                dest = assignment[e.dst]
                if dest not in self.remote_out[(e.src, e.src_port)]:
                    self.remote_out[(e.src, e.src_port)].append(dest)
        self.graph_outputs = {
            k: (h.node, h.port) for k, h in outputs.items() if h.node in self.nodes
        }
        self.delayed_in = [e for e in edges if e.delay and e.dst in self.nodes]
        self.delayed_of: dict[str, list[Any]] = {n: [] for n in self.nodes}
        self.delayed_keys: dict[tuple[str, str], list[Any]] = {}
        """(src, port) read through a delayed edge here -> those edges."""
        for e in self.delayed_in:
            self.delayed_of[e.dst].append(e)
            self.delayed_keys.setdefault((e.src, e.src_port), []).append(e)
        self.running: Running | None = None
        self.switch = Switch(self.nodes, switch, here) if switch else None
        self._held: list[tuple[Any, ...]] | None = None
        """While a node runs under a switch: its outputs for other processes, sent after."""
        self.reset(0)

    def reset(self, step: int) -> None:
        """Forget every value and piece: the next step to run is ``step`` for every node."""
        self.next_step = dict.fromkeys(self.order, step)
        self.reported = self.until = step
        self.pending: dict[tuple[int, str], dict[str, Any]] = {}
        """Inputs that arrived, by (step, node): every input except those of delayed edges."""
        self.delayed = DelayedValues(self.max_staleness, self.staleness_mode)
        self.staleness: dict[int, dict[str, int | None]] = defaultdict(dict)
        self.streams = StreamFeeder(
            self.nodes, self.in_edges, self.pending, self.next_step, self._keep_delayed,
            self._read_delayed, self.here,
        )  # fmt: skip
        self.seconds: dict[int, dict[str, float]] = defaultdict(dict)
        self.replicas: dict[int, dict[str, list[int]]] = defaultdict(dict)
        self.starts: dict[int, dict[str, float]] = defaultdict(dict)
        self.step_outputs: dict[int, dict[str, Any]] = defaultdict(dict)

    # --- what arrives -------------------------------------------------------------------------
    def reads(self, src: str, port: str) -> bool:
        """Whether a node here reads ``src.port`` of another process."""
        return (src, port) in self.remote_in

    def allow(self, until: int) -> None:
        """Steps ``< until`` may run."""
        self.until = max(self.until, until)

    def deliver(self, step: int, src: str, port: str, value: Any) -> list[str]:
        """Another process's output ``src.port`` of ``step``; returns why parts were dropped
        (a second copy, a step outside those being run, an edge no node here reads)."""
        edges = self.remote_in.get((src, port))
        if not edges:
            return [f"data for {src}.{port}, which no node here reads"]
        dropped, end = [], self.until + self.lag + 2 * self.window
        for e in edges:
            if e.delay:
                continue
            slot = self.pending.get((step, e.dst), {})
            if not self.next_step[e.dst] <= step < end or e.dst_port in slot:
                why = "a second copy" if e.dst_port in slot else "outside the steps being run"
                dropped.append(f"data {src}.{port} of step {step} for {e.dst}.{e.dst_port}: {why}")
                continue
            self.pending.setdefault((step, e.dst), {})[e.dst_port] = value
        if (src, port) in self.delayed_keys:
            dropped += self._keep_delayed(src, port, step, value)
        return dropped

    def deliver_piece(self, step: int, src: str, port: str, index: int, piece: Piece) -> list[str]:
        """Piece ``index`` of another process's streamed output; returns why it was dropped."""
        if not self.reads(src, port):
            return [f"data for {src}.{port}, which no node here reads"]
        return self.streams.add(step, src, port, index, piece)

    def end_stream(self, step: int, src: str, port: str, count: int) -> list[str]:
        """The end of another process's streamed output: ``count`` pieces in all."""
        if not self.reads(src, port):
            return [f"data for {src}.{port}, which no node here reads"]
        return self.streams.end(step, src, port, count)

    def wake_in(self) -> float | None:
        """Seconds until a consumer waiting for more pieces must run anyway (None: none waits)."""
        return self.streams.wake_in()

    def _keep_delayed(self, src: str, port: str, step: int, value: Any) -> list[str]:
        """Keep another process's value for the delayed edges here (once, while a reader's
        window may still reach it); returns why it was dropped."""
        if self.delayed.has(src, port, step):
            why = "a second copy"
        elif not self._delayed_floor(src, port) <= step < self.until + 2 * self.window:
            why = "outside the steps being run"
        else:
            self.delayed.put(src, port, step, value)
            return []
        return [f"data {src}.{port} of step {step} for its delayed edges: {why}"]

    def _delayed_floor(self, src: str, port: str) -> int:
        """The oldest producing step of ``src.port`` that a reader here may still read."""
        return min(self.next_step[e.dst] for e in self.delayed_keys[(src, port)]) - self.lag

    # --- running ------------------------------------------------------------------------------
    def _ready(self, name: str) -> bool:
        step = self.next_step[name]
        if step >= self.until:
            return False
        if (step, name) in self.streams.consumers:  # fed per piece: its delayed inputs are read
            return self.streams.ready(name, step)
        for e in self.delayed_of[name]:
            if not self.delayed.pick(e.src, e.src_port, step)[0]:
                return False
        have = self.pending.get((step, name), {})
        for e in self.in_edges[name]:
            if e.delay or e.dst_port in have:
                continue
            return bool(self.streams.book) and self.streams.ready(name, step)
        return True

    def _read_delayed(self, name: str, step: int) -> dict[str, Any]:
        """The inputs of ``name`` on delayed edges for ``step`` (it is ready), read now, and
        how many versions old each is (``staleness[step]["dst.port"]``; None for a None read)."""
        inputs = {}
        for e in self.delayed_of[name]:
            _, produced = self.delayed.pick(e.src, e.src_port, step)
            value = None if produced is None else self.delayed.get(e.src, e.src_port, produced)
            inputs[e.dst_port] = value
            age = None if produced is None or value is None else step - 1 - produced
            self.staleness[step][f"{name}.{e.dst_port}"] = age
        return inputs

    def _pick(self) -> str | None:
        """The ready node with the lowest (step, topological index), or None."""
        best = None
        for name in self.order:
            if self._ready(name) and (best is None or self.next_step[name] < self.next_step[best]):
                best = name
        return best

    def run_one(self) -> bool:
        """Run the ready node with the lowest (step, topological index); False if none is ready."""
        best = self._pick()
        if best is None:
            return False
        step = self.next_step[best]
        if self.switch is None:
            self._call(best, step)
            return True
        self.switch.before(best, step)
        self._held = []  # the outputs for other processes wait until the turn is settled
        try:
            self._call(best, step)
            if not self.streams.consumers and self._pick() is None:  # this process's turn ends:
                self.switch.phase_done(step)  # the device is free before the outputs leave,
            held = self._held  # so a process sharing it that acts on them finds it released
        finally:
            self._held = None
        for args in held:
            self.outbox.value(*args)
        return True

    def _call(self, best: str, step: int) -> None:
        """Run ``best`` at ``step`` (it is ready): a piece, or a whole call."""
        node = self.nodes[best]
        if (step, best) in self.streams.consumers:
            call = partial(self._run_node, best, step, move=True)
            if (done := self.streams.run_piece(best, step, call)) is not None:  # all pieces taken
                out, self.seconds[step][best], self.starts[step][best] = done
                self._finish(best, step, out)
            return
        inputs = self.pending.pop((step, best), {})
        inputs.update(self._read_delayed(best, step))
        for e in self.in_edges[best]:
            inputs.setdefault(e.dst_port, None)
        inputs = self.moves.inputs(node, inputs)
        self.starts[step][best] = time.time()
        t0 = time.perf_counter()
        out = self._run_node(best, step, inputs, stream=node.streaming)
        self.seconds[step][best] = time.perf_counter() - t0
        if self.fanouts is not None and (workers := self.fanouts.last_workers(best)):
            self.replicas[step][best] = workers
        self._finish(best, step, out, streamed=node.streaming)

    def _run_node(
        self, name: str, step: int, inputs: dict[str, Any], stream: bool = False, move: bool = False
    ) -> dict[str, Any]:
        """One call of ``name`` at ``step``, as :attr:`running` (``move``: its inputs moved
        where it reads them first); a ``stream`` hands its pieces on as they come."""
        node = self.nodes[name]
        inputs = self.moves.inputs(node, inputs) if move else inputs
        self.running = Running(name, step, time.monotonic(), self.limits[name])
        try:
            if stream:
                pieces = stream_node(node, inputs, step, self.here, self.check_finite)
                return self.streams.run_stream(name, step, self._send_pieces(name, step, pieces))
            return run_node(node, inputs, step, self.here, self.fanouts, self.check_finite)
        finally:
            self.running = None

    def _send_pieces(self, name: str, step: int, pieces: Iterable[Piece]) -> Iterator[Piece]:
        """``pieces`` of a streaming call of ``name``, each sent on to the processes that read
        it as it passes, and then the end of each port."""
        count = 0
        for count, piece in enumerate(pieces, 1):
            for port, value in piece.outputs.items():
                dests = self.remote_out.get((name, port))
                if dests and self.outbox is not None:
                    for group, as_is in self.moves.split(name, port, dests):
                        sent = piece if as_is else piece._replace(outputs={port: host_copy(value)})
                        self.outbox.piece(step, name, port, count - 1, sent, group)
            yield piece
        for port in self.nodes[name].outputs:
            dests = self.remote_out.get((name, port))
            if dests and self.outbox is not None:
                self.outbox.end(step, name, port, count, dests)

    def _finish(self, name: str, step: int, out: dict[str, Any], streamed: bool = False) -> None:
        """A node's call for ``step`` is done: hand its outputs on (those of a streaming node
        went as pieces, except along delayed edges, which get the joined value)."""
        self.next_step[name] = step + 1
        for port, value in out.items():
            if (name, port) in self.delayed_keys:
                self.delayed.put(name, port, step, value)
            for e in self.local_out.get((name, port), ()):
                if not (streamed or e.delay):
                    self.pending.setdefault((step, e.dst), {})[e.dst_port] = value
            dests = self.remote_out.get((name, port))
            if dests and not streamed and self.outbox is not None:
                for group, as_is in self.moves.split(name, port, dests):
                    args = (step, name, port, value if as_is else host_copy(value), group)
                    if self._held is not None:
                        self._held.append(args)
                    else:
                        self.outbox.value(*args)
        for key, (node, port) in self.graph_outputs.items():
            if node == name:
                self.step_outputs[step][key] = self.moves.for_host(out[port])
        for e in self.delayed_of[name]:  # a value no window of a reader here reaches goes
            self.delayed.prune(e.src, e.src_port, self._delayed_floor(e.src, e.src_port))
        self.streams.prune()

    def finished(self) -> Iterator[StepResult]:
        """Each step, in order, that every node here has finished (once)."""
        while self.reported < self.until and min(self.next_step.values()) > self.reported:
            step = self.reported
            self.reported += 1
            seconds, starts = self.seconds.pop(step, {}), self.starts.pop(step, {})
            yield StepResult(
                step,
                self.step_outputs.pop(step, {}),
                {n: seconds[n] for n in self.order if n in seconds},
                {n: starts[n] for n in self.order if n in starts},
                dict.fromkeys(seconds, self.here),
                self.staleness.pop(step, {}),
                switches=self.switch.pop(step) if self.switch is not None else [],
                replicas=self.replicas.pop(step, {}),
            )

    # --- state, between steps -----------------------------------------------------------------
    def _delayed_slots(self, step: int) -> list[tuple[str, str, int]]:
        """(src, port, producing step) of the delayed values the steps from ``step`` on may read."""
        return [(*key, p) for key in self.delayed_keys for p in self.delayed.window(step)]

    def state(self, step: int) -> dict[str, Any] | None:
        """Everything a process needs to go on from ``step``: ``{"nodes": each node's
        ``state_dict()``, "delayed": [[src, port, produced_step, value], ...] (the delayed
        values the next steps may read: those of steps ``[step-1-max_staleness, step-1]``, in
        either staleness mode), "rng": this process's RNG states}``.

        None while a value from another process is still on its way; :class:`StateNotReady`
        while the step before is still running; RuntimeError if nodes are past ``step``.
        """
        if any(s != step for s in self.next_step.values()) or self.reported != step:
            if all(s <= step for s in self.next_step.values()):
                raise StateNotReady(step)
            raise RuntimeError(
                f"state of step {step} requested, but nodes are at steps {self.next_step}"
            )
        values: dict[tuple[str, str, int], Any] = {}
        for src, port, p in self._delayed_slots(step):
            if not self.delayed.has(src, port, p):
                return None
            values[(src, port, p)] = self.delayed.get(src, port, p)
        nodes = {}
        for name in self.order:
            try:
                nodes[name] = node_op(self.nodes[name], "state_dict")
            except Exception as exc:
                raise _state_error(name, step, "state_dict", exc) from exc
        return {
            "nodes": nodes,
            "delayed": [[s, p, k, v] for (s, p, k), v in values.items()],
            "rng": rng_state(),
        }

    def restore(self, step: int, state: Mapping[str, Any]) -> None:
        """Load what :meth:`state` gave (for these nodes); the next step to run is ``step``.
        A delayed value the state lacks reads None."""
        for name in self.order:
            node_state = state["nodes"].get(name)
            if node_state:
                try:
                    node_op(self.nodes[name], "load_state_dict", node_state)
                except Exception as exc:
                    raise _state_error(name, step, "load_state_dict", exc) from exc
        self.reset(step)
        given = {(s, p, int(k)): v for s, p, k, v in state.get("delayed", [])}
        for src, port, p in self._delayed_slots(step):
            self.delayed.put(src, port, p, given.get((src, port, p)))
        set_rng_state(state.get("rng") or {})


def _state_error(name: str, step: int, call: str, exc: Exception) -> NodeExecutionError:
    return NodeExecutionError(
        name, f"node {name!r}: {call}() failed: {type(exc).__name__}: {exc}", step=step,
        during="state",
    )  # fmt: skip


class DelayedValues:
    """Delayed-edge values by ``(src, port)`` and producing step, and the rule that reads them.

    Args:
        max_staleness: K, the most versions a read value may lag the step before.
        mode: ``"fixed"`` or ``"bound"`` (see the module docstring).
    """

    def __init__(self, max_staleness: int = 0, mode: str = "fixed"):
        self.max_staleness, self.mode = max_staleness, check_staleness_mode(mode, "DelayedValues")
        self.lag = 1 + max_staleness
        self._values: dict[tuple[str, str], dict[int, Any]] = {}

    def window(self, step: int) -> range:
        """The producing steps that step ``step`` may read (those of a checkpoint at ``step``)."""
        return range(max(0, step - self.lag), step)

    def has(self, src: str, port: str, produced: int) -> bool:
        return produced in self._values.get((src, port), {})

    def put(self, src: str, port: str, produced: int, value: Any) -> bool:
        """Keep ``src.port`` of step ``produced``; False (nothing kept) if it is already here."""
        got = self._values.setdefault((src, port), {})
        if produced in got:
            return False
        got[produced] = value
        return True

    def get(self, src: str, port: str, produced: int) -> Any:
        return self._values[(src, port)][produced]

    def pick(self, src: str, port: str, step: int) -> tuple[bool, int | None]:
        """``(ready, produced)``: whether step ``step`` can read ``src.port`` now, and from which
        producing step (None: it reads None, nothing in its window having been produced)."""
        low = step - self.lag
        if self.mode == "fixed":
            if low < 0:
                return True, None
            return self.has(src, port, low), low
        got = self._values.get((src, port), {})
        newest = max((p for p in got if low <= p < step), default=None)
        if newest is not None:
            return True, newest
        return low < 0, None  # before the first full window: None rather than waiting

    def prune(self, src: str, port: str, floor: int) -> None:
        """Forget the values of ``src.port`` produced before step ``floor``."""
        got = self._values.get((src, port))
        if got:
            for produced in [p for p in got if p < floor]:
                del got[produced]

    def count(self) -> int:
        """How many values are kept (all ports), for tests of the memory bound."""
        return sum(len(v) for v in self._values.values())


class LocalExecutor:
    """Run a graph or plan in this process. ``step()`` runs the graph once.

    Args:
        plan: a Plan, or a Graph (planned for one controller).
        config: the run's options (:class:`~runtime.engine.config.RunConfig`); this executor
            reads ``max_staleness``, ``staleness``, ``devices``, ``check_finite``,
            ``replicas`` and ``offload``. Keyword ``options`` are fields of it, over it.
            With ``staleness="bound"`` a delayed edge, one step at a time, always reads step
            k-1 (on-policy results). ``offload="on"`` makes the model roles take turns on
            their device (:mod:`runtime.engine.switch`); ``"auto"`` never moves state here: in
            one process no other process waits for the memory. ``close()`` (or ``with``)
            stops the fan-outs' workers and replica processes.
        replica_factory: starts replica i of a node (``runtime.zmq.replicas.spawn_replica``,
            which the CLI passes; this layer does not start processes itself).
    """

    def __init__(
        self,
        plan: Plan | Graph,
        config: RunConfig | None = None,
        *,
        replica_factory: Callable[[Any, int, int], Any] | None = None,
        **options: Any,
    ):
        self.config = config = merged_config(config, options, "LocalExecutor")
        self.plan = plan if isinstance(plan, Plan) else plan.plan(1)
        self.graph = self.plan.graph
        self.graph.validate()
        self.max_staleness, self.staleness = config.max_staleness, config.staleness
        self.offload = config.offload == "on"
        nodes = self.graph.nodes
        # Nodes that can share a model (nodes/shared_models.py) learn the staleness first: one
        # registry per executor, used only on-policy (max_staleness 0).
        shared: dict[str, Any] = {}
        for name in self.graph.topological_order():
            nodes[name].bind_executor(max_staleness=self.max_staleness, shared=shared)
        order = self.graph.topological_order()
        self.workers = start_nodes(nodes, order, config, replica_factory)  # models, ranks, ...
        self.fanouts = self.workers.fanouts
        self.engine = StepEngine(
            nodes,
            self.graph.edges,
            self.graph.graph_outputs,
            order,
            self.plan.assignment,
            max_staleness=self.max_staleness,
            staleness=self.staleness,
            fanouts=self.fanouts,
            check_finite=config.check_finite,
            switch="roles" if self.offload else None,
        )
        self.next_step = 0

    def step(self) -> StepResult:
        step = self.next_step
        engine = self.engine
        engine.allow(step + 1)
        while engine.run_one():
            pass
        (result,) = engine.finished()
        result.node_controller = {n: self.plan.assignment[n] for n in result.node_seconds}
        if self.offload:
            result.sched = switch_metrics(result.switches)
        self.next_step = step + 1
        return result

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: the step, node states, the delayed values the next
        steps read (``[src, port, produced_step, value]``), and the RNG states."""
        state = self.engine.state(self.next_step)
        assert state is not None  # one process: nothing is ever on its way
        return {"step": self.next_step, **state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = sorted(set(self.graph.nodes) - set(state["nodes"]))
        if missing:
            raise ValueError(
                f"checkpoint has no state for node(s) {missing}; was it written by this graph?"
            )
        step = int(state["step"])
        self.engine.restore(step, {**state, "delayed": delayed_entries(state, step)})
        self.next_step = step

    def run(self, steps: int = 1, on_step: OnStep = None, stop: Stop = None) -> list[StepResult]:
        """Run ``steps`` steps, each result to ``on_step`` or, without one, into the list returned
        (so a training loop of many steps holds none of them); ``stop()``, asked after each,
        ends the run early (a SIGTERM)."""
        results: list[StepResult] = []
        for _ in range(steps):
            result = self.step()
            (on_step or results.append)(result)
            if stop is not None and stop():
                break
        return results

    def close(self) -> None:
        """Stop the fan-outs' worker threads, the replica processes and the ranks this
        executor started (their nodes cannot train afterwards)."""
        self.fanouts = self.engine.fanouts = None
        self.workers.close()

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def delayed_entries(state: dict[str, Any], step: int) -> list[list[Any]]:
    """A state's delayed values as ``[src, port, produced_step, value]``; an entry of three
    (``[src, port, value]``, as older checkpoints hold) was produced at ``step - 1``."""
    return [e if len(e) == 4 else [e[0], e[1], step - 1, e[2]] for e in state.get("delayed", [])]
