"""Advantage nodes: the formulas of :mod:`nodes.rl.advantages` as graph nodes.

* :class:`GAEAdvantage` (PPO): sequence scores (or per-token rewards), critic values and,
  optionally, the KL to the reference folded into the reward; token-level GAE.
* :class:`GroupAdvantage` (GRPO, Dr. GRPO, RLOO: any of
  :data:`nodes.rl.advantages.GROUP_ESTIMATORS`): per-sample scores against the other samples
  drawn for the same prompt, broadcast over the response tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nodes.filters import informative_groups
from nodes.rl.advantages import (
    GROUP_ESTIMATORS,
    KL_ESTIMATORS,
    apply_kl_to_rewards,
    broadcast_to_tokens,
    compute_gae,
    kl_penalty,
)
from nodes.rl.masked import masked_mean, masked_whiten
from yatt_graph import ANY, BatchPolicy, Node, Port, Tensor

__all__ = ["GAEAdvantage", "GroupAdvantage"]

_TOKENS = Tensor("float32", "B", "R")


class GAEAdvantage(Node):
    """Token-level GAE over the response, with an optional KL-in-reward penalty."""

    kind = "advantage"
    batch_policy = BatchPolicy(splittable=False)  # whitening uses the whole batch
    inputs = {
        "scores": Tensor("float32", "B"),
        "values": _TOKENS,
        "response_mask": _TOKENS,
        "token_rewards": Port(_TOKENS, required=False),
        "logprobs": Port(_TOKENS, required=False),
        "ref_logprobs": Port(_TOKENS, required=False),
    }
    outputs = {"advantages": _TOKENS, "returns": _TOKENS, "stats": ANY}

    def __init__(
        self,
        gamma: float = 1.0,
        lam: float = 0.95,
        kl_coef: float = 0.0,
        kl_estimator: str = "k1",
        whiten: bool = True,
        name: str | None = None,
    ):
        super().__init__(name=name)
        if kl_coef < 0:
            raise ValueError(f"node {self.name!r}: kl_coef must be >= 0, got {kl_coef}")
        KL_ESTIMATORS.check(kl_estimator, f"node {self.name!r}: kl_estimator")
        self.gamma, self.lam, self.kl_coef, self.kl_estimator, self.whiten = (
            gamma,
            lam,
            kl_coef,
            kl_estimator,
            whiten,
        )

    @torch.no_grad()
    def forward(
        self, scores, values, response_mask, token_rewards, logprobs, ref_logprobs
    ) -> dict[str, Any]:
        rewards = (
            scores
            if token_rewards is None
            else token_rewards + _on_last_token(scores, response_mask)
        )
        stats: dict[str, float] = {}
        if self.kl_coef > 0 and (logprobs is None or ref_logprobs is None):
            raise ValueError(
                f"node {self.name!r}: kl_coef={self.kl_coef} needs the logprobs and ref_logprobs "
                "inputs connected (or set kl_coef=0 to leave the KL out of the reward)"
            )
        if logprobs is not None and ref_logprobs is not None:
            # Reported whenever it can be, so a run shows its drift from the reference.
            kl = kl_penalty(logprobs, ref_logprobs, response_mask, kind=self.kl_estimator)  # (B, R)
            stats["kl"] = float(masked_mean(kl, response_mask))
        else:
            kl = torch.zeros_like(values)  # (B, R)
        shaped = apply_kl_to_rewards(rewards, kl, response_mask, self.kl_coef)  # (B, R)
        advantages, returns = compute_gae(
            shaped, values, response_mask, self.gamma, self.lam
        )  # (B, R)
        if self.whiten:
            advantages = masked_whiten(advantages, response_mask) * response_mask  # (B, R)
        stats["advantage_mean"] = float(masked_mean(advantages, response_mask))
        stats["return_mean"] = float(masked_mean(returns, response_mask))
        return {"advantages": advantages, "returns": returns, "stats": stats}


def _on_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    zeros = torch.zeros_like(mask)  # (B, R)
    return apply_kl_to_rewards(scores, zeros, mask, 0.0)  # (B, R): score on the last real token


class GroupAdvantage(Node):
    """Group advantages over the response tokens: ``estimator`` names one of
    :data:`nodes.rl.advantages.GROUP_ESTIMATORS` (grpo: group mean and std; dr_grpo: group
    mean; rloo: the mean of the others; reinforce_pp, reinforce_pp_baseline).

    With ``overlong_buffer`` L_b and ``max_new_tokens`` L_max, a response longer than
    ``L_max - L_b`` tokens loses ``overlong_penalty * (length - (L_max - L_b)) / L_b`` of its
    score before the estimator (DAPO's soft overlong punishment), up to the whole factor at
    ``L_max``."""

    kind = "advantage"
    batch_policy = BatchPolicy(splittable=False)  # a group's baseline needs the whole group
    inputs = {
        "scores": Tensor("float32", "B"),
        "group_ids": Tensor("int64", "B"),
        "response_mask": _TOKENS,
    }
    outputs = {"advantages": _TOKENS, "stats": ANY}

    def __init__(
        self,
        estimator: str = "grpo",
        name: str | None = None,
        overlong_buffer: int = 0,
        max_new_tokens: int = 0,
        overlong_penalty: float = 1.0,
    ):
        super().__init__(name=name)
        where = f"node {self.name!r}"
        self.estimator = GROUP_ESTIMATORS.check(estimator, f"{where}: estimator")
        if overlong_buffer and not 0 < overlong_buffer <= max_new_tokens:
            raise ValueError(
                f"{where}: overlong_buffer={overlong_buffer}; it must be in (0, max_new_tokens"
                f"={max_new_tokens}] (0: no overlong penalty)"
            )
        if not (overlong_penalty >= 0 and math.isfinite(overlong_penalty)):
            raise ValueError(f"{where}: overlong_penalty={overlong_penalty}; it must be >= 0")
        self.overlong = (int(overlong_buffer), int(max_new_tokens), float(overlong_penalty))

    @torch.no_grad()
    def forward(self, scores, group_ids, response_mask) -> dict[str, Any]:
        stats: dict[str, float] = {}
        buffer, longest, factor = self.overlong
        if buffer:
            lengths = response_mask.sum(1)  # (B,)
            over = ((lengths - (longest - buffer)) / buffer).clamp(0.0, 1.0)  # (B,)
            scores = scores - factor * over  # (B,)
            stats["overlong_penalty_mean"] = float((factor * over).mean())
        per_sample = GROUP_ESTIMATORS[self.estimator](scores, group_ids=group_ids)  # (B,)
        advantages = broadcast_to_tokens(per_sample, response_mask)  # (B, R)
        differ = informative_groups(scores, group_ids)  # flat groups carry no learning signal
        stats["flat_group_share"] = differ.count(False) / max(len(differ), 1)
        return {"advantages": advantages, "stats": stats}
