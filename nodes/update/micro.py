"""An update's batch as micro-batches: by rows or by a token budget
(:func:`token_micro_batches`, :mod:`nodes.batches`), and across its ranks.

A batch of B rows is cut into *units*: one row each, or one prompt's ``group`` consecutive
rows when the image inputs come one row per prompt (the rows of a unit share that image row).
The units are split across the K ranks by token cost (``response_mask`` counts,
:func:`yatt_graph.partition.lpt`). Each rank cuts its share into micro-batches as a
1-rank node cuts its batch.

Every rank must run the same number of backward passes, because each backward ends in the
group's gradient reduction. So a rank with fewer micro-batches pads with *filler*
micro-batches: a real unit of the batch whose loss is scaled by 0, so it adds nothing to the
gradients and nothing to the metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from nodes.batches import View, token_budget_parts
from yatt_graph.partition import lpt

__all__ = ["Micro", "View", "plan_micro_batches", "token_micro_batches"]


class Micro(NamedTuple):
    """One micro-batch: its rows of a view and the scales of its loss and its metrics."""

    view: View
    rows: slice
    grad_scale: float
    """The loss is multiplied by this before backward: 1 alone, K in a group of K ranks (the
    group averages gradients), 0 for a filler."""
    stat_scale: float
    """1, or 0 for a filler."""


def token_micro_batches(
    view: View, budget: int, max_rows: int = 0, packed: bool = False
) -> list[View]:
    """``view`` cut by :func:`~nodes.batches.token_budget_parts`, each part trimmed."""
    parts = token_budget_parts(view, budget, max_rows, packed)
    return [view.take(part).trimmed() for part in parts]


Cut = Callable[[View], list[tuple[View, slice]]]
"""A node's cut of a view into micro-batches: each its view and its rows of that view."""


def plan_micro_batches(
    full: View, cut: Cut, rank: int, world: int
) -> tuple[list[Micro], Micro | None]:
    """This rank's micro-batches, padded with fillers to the largest count over the ranks,
    and the filler itself (None with one rank). ``cut`` is the node's cut of a view."""
    B = full.real.shape[0]
    if world == 1:
        return [Micro(view, rows, 1.0, 1.0) for view, rows in cut(full)], None
    g = full.group
    costs = full.real.reshape(B // g, -1).sum(1).tolist()  # real tokens per unit
    shares = lpt(costs, world)  # a pure function: every rank cuts alike
    cuts = [cut(full.take(s)) if s else [] for s in shares]
    first = next(u for u, c in enumerate(costs) if c > 0)  # the batch has a real token
    filler = Micro(full, slice(first * g, (first + 1) * g), 0.0, 0.0)
    micros = [Micro(view, rows, float(world), 1.0) for view, rows in cuts[rank]]
    return micros + [filler] * (max(map(len, cuts)) - len(micros)), filler
