"""Per-sample numbers of a step, for the run's samples file: each response's advantage, its KL
to the reference and the gap between the sampler's and the trainer's logprobs, reduced from
the per-token tensors the update reads to one number a response.

The node reads the rows the update trains on (after dynamic sampling's filter, where one
runs) and says which of the step's sampled responses each row is (``sample``: its position
among them, found from the rollout's group labels), so that the run lines each number up
with its response (:mod:`runtime.train.samples`)::

    in:  response_mask     float32[B, R]  1 on response tokens
         group_ids         int64[B]       the rollout's prompt label of each row
         advantages        float32[B, R]
         logprobs          float32[B, R]  optional: the trainer's (recomputed) logprobs
         ref_logprobs      float32[B, R]  optional: the reference's
         rollout_logprobs  float32[B, R]  optional: the sampler's own
         sampled_group_ids int64[S]       optional: the labels of all S responses sampled
                                          this step (default: ``group_ids``, nothing dropped)
    out: stats  {"sample": int64[B], "advantage": float32[B], "ref_kl"?, "logprob_gap"?}
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nodes.rl.masked import masked_mean
from yatt_graph import ANY, BatchPolicy, Node, Port
from yatt_graph import Tensor as TensorPort

__all__ = ["SampleStats", "sample_positions", "sample_stats"]

_TOKENS = TensorPort("float32", "B", "R")


def sample_stats(
    response_mask: Tensor,
    advantages: Tensor,
    logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
) -> dict[str, Tensor]:
    """One number per response (each a mean over its response tokens; 0 for an empty one):

    * ``advantage``: the advantage (GRPO's group advantage, PPO's GAE averaged);
    * ``ref_kl``: ``logprobs - ref_logprobs`` (the k1 estimate of KL(policy || reference)),
      where both are given;
    * ``logprob_gap``: ``|rollout_logprobs - logprobs|``, where both are given.
    """
    mask = response_mask.float()  # [B, R]
    out = {"advantage": masked_mean(advantages.float(), mask, dim=-1)}  # [B]
    if logprobs is not None and ref_logprobs is not None:
        out["ref_kl"] = masked_mean(logprobs.float() - ref_logprobs.float(), mask, dim=-1)  # [B]
    if logprobs is not None and rollout_logprobs is not None:
        gap = (rollout_logprobs.float() - logprobs.float()).abs()  # [B, R]
        out["logprob_gap"] = masked_mean(gap, mask, dim=-1)  # [B]
    return out


def sample_positions(group_ids: Tensor, sampled_group_ids: Tensor) -> Tensor:
    """int64[B]: for each row of ``group_ids``, its position in ``sampled_group_ids`` (the
    k-th row of a group is that group's k-th sampled response: filters keep or drop whole
    groups, in order). A row whose group was not sampled, or more rows of a group than were
    sampled, is a ValueError."""
    where: dict[int, list[int]] = {}
    for i, g in enumerate(sampled_group_ids.tolist()):
        where.setdefault(g, []).append(i)
    taken: dict[int, int] = {}
    out = []
    for g in group_ids.tolist():
        k = taken.get(g, 0)
        if k >= len(where.get(g, ())):
            raise ValueError(
                f"sample_stats: a row of group {g} is not among the step's sampled responses "
                f"({len(where.get(g, ()))} of that group were sampled); the rows given are not "
                "this step's"
            )
        out.append(where[g][k])
        taken[g] = k + 1
    return torch.tensor(out, dtype=torch.int64)


class SampleStats(Node):
    """:func:`sample_stats` as a node (see the module)."""

    batch_policy = BatchPolicy(splittable=False)  # a few masked means: not worth cutting
    inputs = {  # noqa: RUF012
        "response_mask": _TOKENS,
        "group_ids": TensorPort("int64", "B"),
        "advantages": _TOKENS,
        "logprobs": Port(_TOKENS, required=False),
        "ref_logprobs": Port(_TOKENS, required=False),
        "rollout_logprobs": Port(_TOKENS, required=False),
        "sampled_group_ids": Port(TensorPort("int64", "S"), required=False),
    }
    outputs = {"stats": Port(ANY, doc="{'sample': int64[B], 'advantage': float32[B], ...}")}  # noqa: RUF012

    @torch.no_grad()
    def forward(
        self,
        response_mask: Tensor,
        group_ids: Tensor,
        advantages: Tensor,
        logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        rollout_logprobs: Tensor | None = None,
        sampled_group_ids: Tensor | None = None,
    ) -> dict[str, Any]:
        stats = sample_stats(response_mask, advantages, logprobs, ref_logprobs, rollout_logprobs)
        if sampled_group_ids is None:  # nothing was dropped: row i is the i-th response
            sample = torch.arange(len(group_ids), dtype=torch.int64)
        else:
            sample = sample_positions(group_ids.cpu(), sampled_group_ids.cpu())
        return {"stats": {"sample": sample, **{k: v.cpu() for k, v in stats.items()}}}
