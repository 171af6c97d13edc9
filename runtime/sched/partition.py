"""Adaptive partitioning: between steps, move CPU cores to the controller that holds the step up.

Pure logic, fed one step at a time (:meth:`Partitioner.observe`) with each controller's busy
time (the seconds its nodes ran), the spans of those calls and the step's wall time; it answers
with new :class:`~runtime.sched.devices.Resources` for every controller when it decides to
change them, else None. The driver sends them (between node calls, never during one).

How it decides, once per ``window`` of steps measured under one allocation:

* From the spans it measures how much each controller's busy time overlaps the others'
  (``overlap``: 0 when the controllers take turns, as the roles of an on-policy step do; near
  1 for a side that always runs beside another) and how much of the step the busy time covers.
* A model predicts each candidate allocation's step time: a controller's work is its busy
  time times its speed-up on the cores it had (``threads ** alpha``); alone it runs on all its
  cores, beside others on its own cores plus a share of the ones it shares. The candidates:
  every controller on every core (time-sharing), the busiest one lent every core (the others
  keep theirs), and disjoint shares sized to the work.
* **Hysteresis**: it changes only when the best candidate is predicted ``min_gain`` faster
  (or was measured that much faster before); it then measures a window under the new
  allocation (after ``settle`` steps whose calls straddled the change) and keeps it unless
  the step got ``worse`` slower, in which case it goes back and does not try that allocation
  again for ``patience`` windows. An allocation measured before is judged by its measurement,
  not the model, so two allocations cannot flap.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from runtime.sched.devices import Resources

__all__ = ["Partitioner", "StepTiming", "overlap_shares"]

Allocation = tuple[tuple[int, ...], ...]
"""Each controller's cores."""


@dataclass(frozen=True)
class StepTiming:
    """One step as the partitioner sees it."""

    wall_s: float
    """The step's wall time (on a pipelined run, the time since the step before finished)."""
    busy_s: Mapping[int, float]
    """Controller -> seconds its node calls ran."""
    spans: Sequence[tuple[int, float, float]] = ()
    """``(controller, start, end)`` of each node call (any clock shared by the controllers)."""


def overlap_shares(spans: Sequence[tuple[int, float, float]]) -> dict[int, float]:
    """Per controller, the share of its busy time during which another controller was busy."""
    by: dict[int, list[tuple[float, float]]] = {}
    for c, start, end in spans:
        if end > start:
            by.setdefault(c, []).append((start, end))
    merged = {c: _union(iv) for c, iv in by.items()}
    out: dict[int, float] = {}
    for c, mine in merged.items():
        others = _union([iv for d, ivs in merged.items() if d != c for iv in ivs])
        total = sum(e - s for s, e in mine)
        out[c] = _intersection(mine, others) / total if total > 0 else 0.0
    return out


def _union(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


class Partitioner:
    """Re-balances ``cores`` between controllers from measured step timings (see the module).

    ``initial``: each controller's Resources now (threads = cores in every allocation it makes).
    """

    def __init__(
        self,
        initial: Sequence[Resources],
        cores: Sequence[int],
        *,
        window: int = 8,
        settle: int = 2,
        min_gain: float = 0.1,
        worse: float = 0.03,
        patience: int = 10,
        alpha: float = 0.7,
    ):
        if window < 1 or settle < 0 or patience < 0:
            raise ValueError("Partitioner: window >= 1, settle >= 0 and patience >= 0")
        if not 0 < alpha <= 1:
            raise ValueError(
                f"Partitioner: alpha (the speed-up exponent) must be in (0, 1], got {alpha}"
            )
        self.cores = tuple(sorted(set(cores)))
        if not self.cores:
            raise ValueError("Partitioner: no cores to share")
        self.cuda = tuple(r.cuda for r in initial)
        self.alloc: Allocation = tuple(r.cores or self.cores for r in initial)
        self.window, self.settle, self.patience = window, settle, patience
        self.min_gain, self.worse, self.alpha = min_gain, worse, alpha
        self.rebalances = 0
        self.reverts = 0
        self._skip = settle
        self._steps: list[StepTiming] = []
        self._windows = 0
        self._measured: dict[Allocation, tuple[float, int]] = {}
        """Allocation -> (median wall, window index) of its last measured window."""
        self._tabu: dict[Allocation, int] = {}
        """Allocation -> the window index until which it is not tried again."""
        self._trial: tuple[Allocation, float] | None = None
        """While a change is on trial: the allocation before it and that one's median wall."""
        self.last_overlap: dict[int, float] = {}

    @property
    def resources(self) -> list[Resources]:
        """Each controller's Resources now."""
        return [Resources(k, len(k), g) for k, g in zip(self.alloc, self.cuda, strict=True)]

    def metrics(self) -> dict[str, float]:
        """``sched/*``: each controller's threads and cores, how many changes and reverts so far."""
        out: dict[str, float] = {}
        for c, k in enumerate(self.alloc):
            out[f"sched/threads/c{c}"] = float(len(k))
        out["sched/rebalances"] = float(self.rebalances)
        out["sched/reverts"] = float(self.reverts)
        return out

    # --- feeding ----------------------------------------------------------------------------
    def observe(self, timing: StepTiming) -> list[Resources] | None:
        """One finished step; new Resources for every controller when it decides a change."""
        if self._skip > 0:  # calls of this step ran partly under the allocation before
            self._skip -= 1
            return None
        self._steps.append(timing)
        if len(self._steps) < self.window:
            return None
        steps, self._steps = self._steps, []
        self._windows += 1
        wall = statistics.median(s.wall_s for s in steps)
        self._measured[self.alloc] = (wall, self._windows)
        if self._trial is not None:
            before, before_wall = self._trial
            self._trial = None
            if wall > before_wall * (1 + self.worse):
                self._tabu[self.alloc] = self._windows + self.patience
                self.reverts += 1
                return self._switch(before)
        nxt = self._propose(steps, wall)
        if nxt is None:
            return None
        self._trial = (self.alloc, wall)
        return self._switch(nxt)

    def _switch(self, alloc: Allocation) -> list[Resources]:
        self.alloc = alloc
        self.rebalances += 1
        self._skip = self.settle
        self._steps = []
        return self.resources

    # --- deciding ---------------------------------------------------------------------------
    def _propose(self, steps: list[StepTiming], wall: float) -> Allocation | None:
        n = len(self.alloc)
        busy = [statistics.fmean(s.busy_s.get(c, 0.0) for s in steps) for c in range(n)]
        spans = [sp for s in steps for sp in s.spans]
        overlap = overlap_shares(spans)
        self.last_overlap = overlap
        o = [overlap.get(c, 0.0) for c in range(n)]
        if sum(busy) <= 0 or wall <= 0:
            return None
        work = [b / self._slowdown(self.alloc, c, oc) for c, (b, oc) in enumerate(zip(busy, o))]

        def predict(alloc: Allocation) -> float:
            measured = self._measured.get(alloc)
            if measured is not None and self._windows - measured[1] <= self.patience:
                return measured[0]
            new = [w * self._slowdown(alloc, c, oc) for c, (w, oc) in enumerate(zip(work, o))]
            return wall - (_span(busy, o) - _span(new, o))

        best, best_wall = None, wall * (1 - self.min_gain)
        for cand in self._candidates(busy, work):
            if cand == self.alloc or self._tabu.get(cand, 0) > self._windows:
                continue
            predicted = predict(cand)
            if predicted < best_wall:
                best, best_wall = cand, predicted
        return best

    def _candidates(self, busy: list[float], work: list[float]) -> list[Allocation]:
        n, every = len(self.alloc), self.cores
        out: list[Allocation] = [tuple(every for _ in range(n))]
        top = max(range(n), key=lambda c: busy[c])
        out.append(tuple(every if c == top else k for c, k in enumerate(self.alloc)))
        if n <= len(every):
            sizes = [1] * n
            for _ in range(len(every) - n):  # each spare core to the one predicted slowest
                c = max(range(n), key=lambda c: work[c] / sizes[c] ** self.alpha)
                sizes[c] += 1
            starts = [sum(sizes[:c]) for c in range(n)]
            out.append(tuple(every[starts[c] : starts[c] + sizes[c]] for c in range(n)))
        return out

    def _slowdown(self, alloc: Allocation, c: int, overlap: float) -> float:
        """Seconds per unit of work of controller c under ``alloc``: alone on all its cores for
        the share ``1 - overlap`` of its time, beside the others (a shared core counts for
        ``1 / sharers``) for the rest."""
        mine = alloc[c]
        alone = len(mine)
        beside = sum(1 / sum(1 for k in alloc if core in k) for core in mine)
        return (1 - overlap) / alone**self.alpha + overlap / max(beside, 0.25) ** self.alpha


def _span(busy: Sequence[float], overlap: Sequence[float]) -> float:
    """The part of a step the busy time covers: each controller's time alone, plus the longest
    stretch run beside others (what the others do meanwhile hides under it)."""
    return sum(b * (1 - o) for b, o in zip(busy, overlap, strict=True)) + max(
        b * o for b, o in zip(busy, overlap, strict=True)
    )
