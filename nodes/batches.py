"""Batches of token rows as model nodes cut them: a :class:`View` of prompt and response
tensors (with their image inputs, one row per response or per prompt) and its cut into parts
within a budget of padded tokens.

A budget bounds a forward pass's activations whatever the batch size: whole units (one row, or
one prompt's ``group`` rows when the image inputs come one per prompt) are sorted longest first
and gathered while the part's padded size (rows times its longest prompt plus its longest
response) stays within the budget, and each part drops the padding columns none of its rows
uses (:meth:`View.trimmed`). The update (``micro_batch_tokens``, gradients accumulated), the
reference and the critic (outputs put back in the batch's order) cut this way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["View", "length_parts", "read_mask", "token_budget_parts"]

_PROMPT_KEYS = ("prompt_ids", "prompt_mask")


def read_mask(who: str, response_mask: Tensor, context_mask: Tensor | None) -> Tensor:
    """The response tokens a forward reads: ``response_mask``, or with a multi-turn
    trajectory's ``context_mask`` its observations too, checked to cover the response (else a
    ValueError from ``who``)."""
    if context_mask is None:
        return response_mask
    if context_mask.shape != response_mask.shape:
        raise ValueError(
            f"{who}: input 'context_mask' is {tuple(context_mask.shape)} but 'response_mask' "
            f"is {tuple(response_mask.shape)}; they must match"
        )
    if bool(((response_mask > 0) & ~(context_mask > 0)).any()):
        raise ValueError(
            f"{who}: input 'context_mask' is 0 where 'response_mask' is 1; it marks every "
            "token read (the policy's and the observations'), a superset"
        )
    return context_mask


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

    @property
    def reads(self) -> Tensor:
        """bool[b, R]: the response tokens a forward reads: the real ones and, in a multi-turn
        trajectory, the observations between its turns (``context_mask``), which the losses
        leave out."""
        context = self.t.get("context_mask")
        return self.real if context is None else self.real | (context > 0)

    def trimmed(self) -> View:
        """The same rows without the padding columns none of them uses: prompt columns whose
        mask is 0 in every row, response columns after the last token read."""
        R = self.real.shape[1]
        used = self.reads.any(0).nonzero()
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
        responses = self.reads.sum(1).reshape(-1, g).amax(1)  # (U,)
        return prompts.tolist(), responses.tolist()


def token_budget_parts(
    view: View, budget: int, max_rows: int = 0, packed: bool = False
) -> list[list[int]]:
    """``view``'s units cut into parts, longest first, each within ``budget`` padded tokens
    (rows times the part's longest prompt plus its longest response; a unit larger than the
    budget alone) and ``max_rows`` rows (0: any). ``packed``: the budget counts each row's
    own tokens instead (its rows are packed into one sequence without padding)."""
    g = view.group
    prompts, responses = view.unit_lengths()
    order = sorted(range(len(prompts)), key=lambda u: (-(prompts[u] + responses[u]), u))
    parts: list[list[int]] = []
    width_p = width_r = 0  # the longest prompt and response of the last part
    tokens = 0  # packed: the last part's tokens (each unit at its longest row)
    for u in order:
        p, r = max(width_p, prompts[u]), max(width_r, responses[u])
        rows = (len(parts[-1]) + 1) * g if parts else 0
        size = tokens + g * (prompts[u] + responses[u]) if packed else rows * (p + r)
        if not parts or size > budget or (max_rows and rows > max_rows):
            parts.append([])
            p, r, tokens = prompts[u], responses[u], 0
        parts[-1].append(u)
        width_p, width_r = p, r
        tokens += g * (prompts[u] + responses[u])
    return parts


def length_parts(lengths: Sequence[int], budget: int, max_rows: int = 0) -> list[list[int]]:
    """The indices of ``lengths`` (one sequence each) cut into parts, longest first, each
    within ``budget`` padded tokens (rows times the part's longest; a longer one alone) and
    ``max_rows`` rows (0: any): the forward passes of a model that reads whole texts."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    parts: list[list[int]] = []
    for i in order:
        part = parts[-1] if parts else None
        # longest first: the part's first row is its longest
        if (
            part is None
            or (len(part) + 1) * lengths[part[0]] > budget
            or (max_rows and len(part) >= max_rows)
        ):
            parts.append([i])
        else:
            part.append(i)
    return parts
