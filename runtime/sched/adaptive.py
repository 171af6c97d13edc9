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
  time times its speed-up on the cores it had (``threads ** alpha``, one thread per core).
  Alone it runs on all its cores; beside a controller that shares one of its cores, each of
  its parallel regions waits for the thread that shares a core, so it runs ``share_cost``
  times slower (torch's OpenMP threads do that: on 2 loaded cores, two 2-thread controllers
  running at once made steps several times slower). ``share_cost`` starts at 2 and is
  raised by what an undone trial of shared cores measured. The candidates: every controller
  on every core (time-sharing), the busiest one lent every core (the others keep theirs),
  and disjoint shares sized to the work.
* **Hysteresis**: it changes only when the best candidate is predicted ``min_gain`` faster
  (or was measured that much faster before); it then measures a window under the new
  allocation (after ``settle`` steps whose calls straddled the change) and keeps it unless
  the step got ``worse`` slower, in which case it goes back and does not try that allocation
  again for ``patience`` windows (twice as long each time it is undone again). A trial whose
  steps come in ``abort`` times slower than before is undone at once, without waiting for the
  window. An allocation measured before is judged by its measurement, not the model, so it
  does not flap between two.
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
        patience: int = 20,
        alpha: float = 0.7,
        abort: float = 1.5,
        explore: float = 0.25,
        warmup: int = 5,
    ):
        if window < 1 or min(settle, patience, warmup) < 0:
            raise ValueError("Partitioner: window >= 1; settle, patience and warmup >= 0")
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
        self.min_gain, self.worse, self.alpha, self.abort = min_gain, worse, alpha, abort
        self.explore = explore
        self.rebalances = 0
        self.reverts = 0
        self._skip = warmup + settle  # the first steps of a run are slower (caches, allocator)
        self._steps: list[StepTiming] = []
        self._windows = 0
        self._measured: dict[Allocation, tuple[float, int]] = {}
        """Allocation -> (median wall, window index) of its last measured window."""
        self._tabu: dict[Allocation, int] = {}
        """Allocation -> the window index until which it is not tried again."""
        self._undone: dict[Allocation, int] = {}
        """Allocation -> how many times a trial of it was undone."""
        self._trial: tuple[Allocation, float, float, bool] | None = None
        """While a change is on trial: the allocation before it, that one's median wall, the
        wall the model predicted for the trial, and whether it is only a look (explore)."""
        self.share_cost = 2.0
        """How many times slower a controller runs beside one it shares a core with (learnt:
        raised by what an undone trial of shared cores measured)."""

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
        if self._trial is not None and len(self._steps) >= 2:
            recent = [s.wall_s for s in self._steps[-2:]]
            if min(recent) > self._trial[1] * self.abort:  # far slower: do not wait the window
                self._windows += 1
                self._measured[self.alloc] = (statistics.median(recent), self._windows)
                return self._undo()
        if len(self._steps) < self.window:
            return None
        steps, self._steps = self._steps, []
        self._windows += 1
        wall = statistics.median(s.wall_s for s in steps)
        self._measured[self.alloc] = (wall, self._windows)
        if self._trial is not None:
            _, before, _, look = self._trial
            # A predicted gain stays unless measured slower; a look stays only if faster.
            if wall > before * (1 + self.worse) or look and wall > before * (1 - self.worse):
                return self._undo()
            self._trial = None
        proposal = self._propose(steps, wall)
        if proposal is None:
            return None
        nxt, predicted, look = proposal
        self._trial = (self.alloc, wall, predicted, look)
        return self._switch(nxt)

    def _undo(self) -> list[Resources]:
        """Back to the allocation before the trial; this one waits longer each time."""
        assert self._trial is not None
        (before, _, predicted, look), self._trial = self._trial, None
        measured = self._measured[self.alloc][0]
        if _shares_cores(self.alloc) and measured > predicted:  # sharing cost more than modelled
            self.share_cost *= max(1.0 if look else 2.0, measured / max(predicted, 1e-9))
        count = self._undone[self.alloc] = self._undone.get(self.alloc, 0) + 1
        self._tabu[self.alloc] = self._windows + self.patience * 2 ** (count - 1)
        self.reverts += 1
        return self._switch(before)

    def _switch(self, alloc: Allocation) -> list[Resources]:
        self.alloc = alloc
        self.rebalances += 1
        self._skip = self.settle
        self._steps = []
        return self.resources

    # --- deciding ---------------------------------------------------------------------------
    def _propose(
        self, steps: list[StepTiming], wall: float
    ) -> tuple[Allocation, float, bool] | None:
        n = len(self.alloc)
        busy = [statistics.fmean(s.busy_s.get(c, 0.0) for s in steps) for c in range(n)]
        spans = [sp for s in steps for sp in s.spans]
        overlap = overlap_shares(spans)
        o = [overlap.get(c, 0.0) for c in range(n)]
        if sum(busy) <= 0 or wall <= 0:
            return None
        covered = sum(e - s for s, e in _union([(s, e) for _, s, e in spans])) / len(steps)
        packing = _packing(busy, covered if spans else sum(busy))
        work = [b / self._slowdown(self.alloc, c, oc) for c, (b, oc) in enumerate(zip(busy, o))]

        def predict(alloc: Allocation) -> float:
            if alloc in self._fresh():
                return self._measured[alloc][0]
            new = [w * self._slowdown(alloc, c, oc) for c, (w, oc) in enumerate(zip(work, o))]
            return wall - (_span(busy, packing) - _span(new, packing))

        best, best_wall = None, wall * (1 - self.min_gain)
        look, look_wall = None, wall * (1 + self.explore)
        for cand in self._candidates(busy, work):
            if cand == self.alloc or self._tabu.get(cand, 0) > self._windows:
                continue
            predicted = predict(cand)
            if predicted < best_wall:
                best, best_wall = cand, predicted
            elif cand not in self._fresh() and predicted < look_wall:
                look, look_wall = cand, predicted
        if best is not None:
            return best, best_wall, False
        return None if look is None else (look, look_wall, True)

    def _fresh(self) -> set[Allocation]:
        """The allocations measured recently enough to be judged by their measurement."""
        return {a for a, (_, w) in self._measured.items() if self._windows - w <= self.patience}

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
        the share ``1 - overlap`` of its time; for the rest beside the others, ``share_cost``
        times slower when one of its cores is shared (its threads wait for the slowest)."""
        mine = alloc[c]
        speed = len(mine) ** self.alpha
        shared = any(core in k for d, k in enumerate(alloc) if d != c for core in mine)
        slower = self.share_cost if shared else 1.0
        return (1 - overlap) / speed + overlap * slower / speed


def _shares_cores(alloc: Allocation) -> bool:
    return sum(len(k) for k in alloc) > len({c for k in alloc for c in k})


def _packing(busy: Sequence[float], covered: float) -> float:
    """How much of the others' busy time hides under the busiest controller's, from the time
    the busy spans cover per step: 1 when it all does (sides that overlap), 0 when none does
    (controllers that take turns)."""
    rest = sum(busy) - max(busy)
    if rest <= 0:
        return 1.0
    return min(1.0, max(0.0, (sum(busy) - covered) / rest))


def _span(busy: Sequence[float], packing: float) -> float:
    """The time per step the busy spans cover: the busiest controller's, plus the others'
    that does not hide under it."""
    return max(busy) + (1 - packing) * (sum(busy) - max(busy))
