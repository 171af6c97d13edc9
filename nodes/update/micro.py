"""An update's batch as micro-batches: by rows or by a token budget, and across its ranks.

With ``micro_batch_tokens`` (:func:`token_micro_batches`), whole units are sorted longest
first and gathered while the micro-batch's padded size (rows times its longest prompt plus
its longest response) stays within the budget; each micro-batch drops the padding columns
none of its rows uses, so a budget bounds the forward's activations whatever the batch size.

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

__all__ = ["Micro", "View", "plan_micro_batches", "token_micro_batches"]

_PROMPT_KEYS = ("prompt_ids", "prompt_mask")


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

    def trimmed(self) -> View:
        """The same rows without the padding columns none of them uses: prompt columns whose
        mask is 0 in every row, response columns after the last real token."""
        R = self.real.shape[1]
        used = self.real.any(0).nonzero()
        keep_r = int(used.max()) + 1 if len(used) else 1
        keep_p = self.t["prompt_mask"].bool().any(0) if "prompt_mask" in self.t else None
        t = {}
        for k, v in self.t.items():
            if k in _PROMPT_KEYS and keep_p is not None:
                t[k] = v[:, keep_p.to(v.device)]
            elif v.dim() >= 2 and v.shape[1] == R:
                t[k] = v[:, :keep_r]
            else:
                t[k] = v
        return View(t, self.real[:, :keep_r], self.image_embeds, self.images, self.group)

    def unit_lengths(self) -> tuple[list[int], list[int]]:
        """Per unit (``group`` rows), its longest prompt and longest response, in tokens."""
        g = self.group
        prompts = self.t["prompt_mask"].bool().sum(1).reshape(-1, g).amax(1)  # (U,)
        responses = self.real.sum(1).reshape(-1, g).amax(1)  # (U,)
        return prompts.tolist(), responses.tolist()


class Micro(NamedTuple):
    """One micro-batch: its rows of a view and the scales of its loss and its metrics."""

    view: View
    rows: slice
    grad_scale: float
    """The loss is multiplied by this before backward: 1 alone, K in a group of K ranks (the
    group averages gradients), 0 for a filler."""
    stat_scale: float
    """1, or 0 for a filler."""


def token_micro_batches(view: View, budget: int, max_rows: int = 0) -> list[View]:
    """``view`` cut into micro-batches of whole units, longest first, each within ``budget``
    padded tokens (a unit larger than the budget alone) and ``max_rows`` rows (0: any), each
    trimmed of the padding it does not use."""
    g = view.group
    prompts, responses = view.unit_lengths()
    order = sorted(range(len(prompts)), key=lambda u: (-(prompts[u] + responses[u]), u))
    parts: list[list[int]] = []
    width_p = width_r = 0  # the longest prompt and response of the last part
    for u in order:
        p, r = max(width_p, prompts[u]), max(width_r, responses[u])
        rows = (len(parts[-1]) + 1) * g if parts else 0
        if not parts or rows * (p + r) > budget or (max_rows and rows > max_rows):
            parts.append([])
            p, r = prompts[u], responses[u]
        parts[-1].append(u)
        width_p, width_r = p, r
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
