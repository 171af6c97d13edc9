"""The in-process executor: the step engine over every node of a plan, plus a loop.

This is the reference semantics: the ZeroMQ runtime must give the same results. It runs every
node in the graph's topological order, one step at a time (the plan's controller assignment
only labels results and errors here), and keeps the values of delayed edges from one step for
the next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.engine.calls import OnStep, StepResult, Stop, start_nodes
from runtime.engine.config import RunConfig, run_config
from runtime.engine.engine import StepEngine
from runtime.engine.switch import switch_metrics
from yatt_graph import Graph, Plan

__all__ = ["LocalExecutor", "StepResult"]


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
        self.config = config = run_config(config, options, "LocalExecutor")
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
        """Run ``steps`` steps; ``stop()``, asked after each, ends the run early (a SIGTERM)."""
        results = []
        for _ in range(steps):
            result = self.step()
            if on_step:
                on_step(result)
            results.append(result)
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
