"""Each rank's share of an update's batch, as micro-batches that every rank can count.

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

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from yatt_graph.partition import lpt

__all__ = ["Micro", "View", "plan_micro_batches"]


class View(NamedTuple):
    """Rows of a batch: token tensors, their real-token mask and their image inputs."""

    t: dict[str, Tensor]
    real: Tensor
    """bool[b, R]."""
    image_embeds: Tensor | None
    images: Any
    group: int
    """Rows per image row (1, or the responses per prompt when images come one per prompt)."""

    def take(self, units: Sequence[int]) -> View:
        """The rows of ``units`` (each ``group`` consecutive rows), in order."""
        g = self.group
        rows = torch.tensor([u * g + j for u in units for j in range(g)], dtype=torch.long)
        images = None if self.images is None else [self.images[u] for u in units]
        embeds = None if self.image_embeds is None else self.image_embeds[list(units)]
        t = {k: v[rows.to(v.device)] for k, v in self.t.items()}
        return View(t, self.real[rows.to(self.real.device)], embeds, images, g)


class Micro(NamedTuple):
    """One micro-batch: its rows of a view and the scales of its loss and its metrics."""

    view: View
    rows: slice
    grad_scale: float
    """The loss is multiplied by this before backward: 1 alone, K in a group of K ranks (the
    group averages gradients), 0 for a filler."""
    stat_scale: float
    """1, or 0 for a filler."""


def plan_micro_batches(
    full: View, slices: Callable[[int], list[slice]], rank: int, world: int
) -> tuple[list[Micro], Micro | None]:
    """This rank's micro-batches, padded with fillers to the largest count over the ranks,
    and the filler itself (None with one rank). ``slices(b)`` is the node's cut of b rows."""
    B = full.real.shape[0]
    if world == 1:
        return [Micro(full, rows, 1.0, 1.0) for rows in slices(B)], None
    g = full.group
    costs = full.real.reshape(B // g, -1).sum(1).tolist()  # real tokens per unit
    shares = lpt(costs, world)  # a pure function: every rank cuts alike
    counts = [len(slices(len(s) * g)) if s else 0 for s in shares]
    first = next(u for u, c in enumerate(costs) if c > 0)  # the batch has a real token
    filler = Micro(full, slice(first * g, (first + 1) * g), 0.0, 0.0)
    micros: list[Micro] = []
    if shares[rank]:
        view = full.take(shares[rank])
        micros = [Micro(view, rows, float(world), 1.0) for rows in slices(len(view.real))]
    return micros + [filler] * (max(counts) - len(micros)), filler
