"""The in-process executor: the step engine over every node of a plan, plus a loop.

This is the reference semantics: the ZeroMQ runtime must give the same results. It runs every
node in the graph's topological order, one step at a time (the plan's controller assignment
only labels results and errors here), and keeps the values of delayed edges from one step for
the next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.engine.calls import StepResult, describe
from runtime.engine.engine import StepEngine
from runtime.sched.splitting import NodeSplitter, device_pool
from yatt_graph import Graph, Plan

__all__ = ["LocalExecutor", "StepResult", "describe"]


def check_staleness(max_staleness: Any, who: str) -> int:
    """``max_staleness`` as an int >= 0, or a ValueError saying what it means."""
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(
            f"{who}: max_staleness must be an int >= 0 (how many weight versions a rollout may "
            f"lag behind the update; 0 is on-policy), got {max_staleness!r}"
        )
    return max_staleness


class LocalExecutor:
    """Run a graph or plan in this process. ``step()`` runs the graph once.

    Args:
        plan: a Plan, or a Graph (planned for one controller).
        devices: None, a CPU slot count, ``"auto"`` or a DevicePool: splits the calls of
            splittable nodes across that many devices (:mod:`runtime.sched.splitting`);
            ``close()`` (or ``with``) stops their worker threads.
        max_staleness: an input on a delayed edge at step k is the producer's value from
            step k-1-max_staleness (None before that): a fixed lag, as on the ZeroMQ runtime
            with the same setting, so both give the same results.
        check_finite: stop at the node whose float tensor output holds NaN or inf.
    """

    def __init__(
        self,
        plan: Plan | Graph,
        *,
        devices: Any = None,
        max_staleness: int = 0,
        check_finite: bool = False,
    ):
        self.plan = plan if isinstance(plan, Plan) else plan.plan(1)
        self.graph = self.plan.graph
        self.graph.validate()
        self.max_staleness = check_staleness(max_staleness, "LocalExecutor")
        pool = device_pool(devices)
        nodes = self.graph.nodes
        # Nodes that can share a model (nodes/shared_models.py) learn the staleness first: one
        # registry per executor, used only on-policy (max_staleness 0).
        shared: dict[str, Any] = {}
        for name in self.graph.topological_order():
            bind = getattr(nodes[name], "bind_executor", None)
            if callable(bind):
                bind(max_staleness=self.max_staleness, shared=shared)
        for name in self.graph.topological_order():  # build the models here, before a step
            nodes[name].setup()
        self.splitter = NodeSplitter(nodes, pool) if pool is not None else None
        self.engine = StepEngine(
            nodes,
            self.graph.edges,
            self.graph.graph_outputs,
            self.graph.topological_order(),
            self.plan.assignment,
            max_staleness=self.max_staleness,
            splitter=self.splitter,
            check_finite=check_finite,
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

    def run(
        self,
        steps: int = 1,
        on_step: Callable[[StepResult], None] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> list[StepResult]:
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
        """Stop the device workers of ``devices=`` (nothing else holds resources)."""
        if self.splitter is not None:
            self.splitter.close()
            self.splitter = None
            self.engine.splitter = None

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def delayed_entries(state: dict[str, Any], step: int) -> list[list[Any]]:
    """A state's delayed values as ``[src, port, produced_step, value]``; an entry of three
    (``[src, port, value]``, as older checkpoints hold) was produced at ``step - 1``."""
    return [e if len(e) == 4 else [e[0], e[1], step - 1, e[2]] for e in state.get("delayed", [])]
