"""The driver's side of adaptive partitioning: each finished step's timings to the partitioner
(:mod:`runtime.sched.adaptive`), its decisions to the controllers, and the ``sched/*`` metrics.

A decision goes out as RESOURCES to each controller whose share changed; the controller applies
it on its compute thread between two node calls, and its next STEP_DONE reports what it
applied, which is what the metrics show (``sched/threads/cN``, ``sched/cores/cN``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from runtime.engine.calls import StepResult
from runtime.sched.adaptive import Partitioner, StepTiming
from runtime.sched.devices import Resources

__all__ = ["Rebalancer", "sched_metrics", "step_timing"]


def step_timing(result: StepResult, wall_s: float) -> StepTiming:
    """What the partitioner reads of a step: busy seconds and call spans per controller."""
    busy: dict[int, float] = {}
    spans = []
    for node, seconds in result.node_seconds.items():
        c = result.node_controller.get(node, 0)
        busy[c] = busy.get(c, 0.0) + seconds
        start = result.node_start.get(node)
        if start is not None:
            spans.append((c, start, start + seconds))
    return StepTiming(wall_s, busy, spans)


def sched_metrics(applied: Sequence[Resources | None]) -> dict[str, float]:
    """``sched/threads/cN`` and ``sched/cores/cN``: what each controller reported it applied."""
    out: dict[str, float] = {}
    for c, r in enumerate(applied):
        if r is not None:
            out[f"sched/threads/c{c}"] = float(r.threads)
            out[f"sched/cores/c{c}"] = float(len(r.cores))
    return out


class Rebalancer:
    """Feeds a :class:`Partitioner` from the driver's collected steps (see the module)."""

    def __init__(self, partitioner: Partitioner):
        self.partitioner = partitioner
        self._last: float | None = None

    def start(self) -> None:
        """A new stretch of steps begins (``run()``): the first step's wall time includes
        whatever happened between runs (a checkpoint), so it is not measured."""
        self._last = None

    def after_step(self, result: StepResult) -> list[Resources] | None:
        """The new Resources of every controller, when the partitioner decides a change."""
        now = time.perf_counter()
        last, self._last = self._last, now
        if last is None:
            return None
        return self.partitioner.observe(step_timing(result, now - last))

    def metrics(self) -> dict[str, Any]:
        return {
            "sched/rebalances": float(self.partitioner.rebalances),
            "sched/reverts": float(self.partitioner.reverts),
        }
