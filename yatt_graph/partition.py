"""Balanced k-way partitions of per-sample costs: pure functions, so every process that cuts a
batch (a call split across devices, replicas, training ranks) cuts it alike.

* :func:`lpt`: longest processing time first, greedy.
* :func:`karmarkar_karp`: the largest differencing method.
* :func:`partition`: either, by name.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["karmarkar_karp", "lpt", "partition"]


def lpt(costs: Sequence[float], k: int) -> list[list[int]]:
    """Longest processing time first: the next-largest sample goes to the lightest part.

    Greedy and simple; the heaviest part is at most ``(4/3 - 1/(3k))`` times the optimum
    (Graham 1969), and heaviest minus lightest is at most the largest cost.
    """
    _check_k(k)
    heap = [(0.0, 0, j) for j in range(k)]  # (load, count, part)
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, count, j = heapq.heappop(heap)
        parts[j].append(i)
        heapq.heappush(heap, (load + costs[i], count + 1, j))
    return [sorted(p) for p in parts]


class _State:
    """A partial solution of Karmarkar-Karp: k sets, kept sorted by sum, largest first."""

    __slots__ = ("sets", "sums")

    def __init__(self, sets: list[list[int]], sums: list[float]):
        # Ties (zero costs) go by count, so that free samples still spread over the sets.
        order = sorted(range(len(sums)), key=lambda j: (-sums[j], -len(sets[j])))
        self.sets = [sets[j] for j in order]
        self.sums = [sums[j] for j in order]

    @property
    def spread(self) -> float:
        return self.sums[0] - self.sums[-1]

    def merge(self, other: _State) -> _State:
        # Largest set of one with the smallest of the other: this is what cancels the spread.
        k = len(self.sums)
        sets = [self.sets[j] + other.sets[k - 1 - j] for j in range(k)]
        sums = [self.sums[j] + other.sums[k - 1 - j] for j in range(k)]
        return _State(sets, sums)


def karmarkar_karp(costs: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """The largest differencing method (Karmarkar-Karp) for k-way balanced partitions.

    Every sample starts as a k-set state (itself in one set, k-1 empty); the two states
    with the largest spread are merged, the heaviest set of one with the lightest of the
    other, until one state remains. With ``equal_size`` the samples are first grouped k at
    a time by cost (one per set), so part sizes differ by at most one. Heaviest minus
    lightest is at most the largest cost, and the heaviest part is within
    ``4/3 - 1/(3k)`` of the optimum (Michiels et al. 2007).
    """
    _check_k(k)
    n = len(costs)
    order = sorted(range(n), key=lambda i: (costs[i], i))
    heap: list[tuple[float, int, _State]] = []
    tick = 0
    if equal_size:
        # Pad with zero-cost dummies (-1) so that every group has k members.
        padded = [-1] * (-n % k) + order
        for g in range(0, len(padded), k):
            group = padded[g : g + k]
            st = _State(
                [[i] if i >= 0 else [] for i in group], [costs[i] if i >= 0 else 0.0 for i in group]
            )
            heapq.heappush(heap, (-st.spread, tick, st))
            tick += 1
    else:
        for i in order:
            st = _State([[i]] + [[] for _ in range(k - 1)], [costs[i]] + [0.0] * (k - 1))
            heapq.heappush(heap, (-st.spread, tick, st))
            tick += 1
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = a.merge(b)
        heapq.heappush(heap, (-merged.spread, tick, merged))
        tick += 1
    return [sorted(s) for s in heap[0][2].sets]


def partition(
    costs: Sequence[float], k: int, method: str = "kk", equal_size: bool = False
) -> list[list[int]]:
    """Exactly ``k`` index lists (some may be empty) balancing the summed costs."""
    if method == "kk":
        return karmarkar_karp(costs, k, equal_size)
    if method == "lpt":
        if equal_size:
            raise ValueError("partition: equal_size is only supported with method='kk'")
        return lpt(costs, k)
    raise ValueError(f"partition: method must be 'kk' or 'lpt', got {method!r}")


def _check_k(k: int) -> None:
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"the number of parts k must be an int >= 1, got {k!r}")
