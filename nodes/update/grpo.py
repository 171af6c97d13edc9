"""The GRPO update: group advantages and a KL term to the reference, no critic."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from nodes.rl.aggregate import AGGREGATIONS, _aggregate
from nodes.rl.losses import _grpo_loss, _kl_loss
from nodes.update.base import _INPUTS, MicroLoss, _item, _Update
from nodes.update.options import GRPOHyper
from nodes.update.trainer import View
from yatt_graph import ANY, Port

__all__ = ["GRPOUpdate"]


class GRPOUpdate(_Update):
    """GRPO (``nodes.rl.losses.grpo_loss``): the clipped surrogate (of ``policy_loss``: PPO's
    token ratio or GSPO's sequence ratio) with group advantages plus
    ``kl_coef`` * k3 KL to the reference, minus ``entropy_coef`` * entropy, plus (with a
    teacher, ``distill_mode="loss"``) ``distill_coef`` * its reverse KL; no critic.

    Inputs: the rollout's ``prompt_ids``, ``prompt_mask``, ``response_ids``, ``response_mask``,
    ``logprobs`` (old), ``advantages`` float32[B, R] (from GroupAdvantage), optionally
    ``ref_logprobs`` (required when ``kl_coef > 0``), ``teacher_logprobs`` (required when
    ``distill_coef > 0``) and ``image_embeds`` / ``images``.
    Outputs: ``weights`` (a WeightUpdate of the policy) and ``metrics`` (loss, pg_loss, entropy,
    clip_fraction, approx_kl, kl_ref (with kl_coef > 0), distill/kl (with distill_coef > 0),
    distill_loss (in its loss mode), grad_norm, lr, skipped_nonfinite; with
    ``ranks > 1`` also time/weight_gather, the seconds spent gathering the published weights).

    Args: ``aggregation``, ``horizon`` and the options of every update, as
        :class:`~nodes.update.options.GRPOHyper` declares them (``kl_coef`` is GRPO's beta: the
        paper uses 0.04), and the node's own as in :class:`PPOUpdate` (``policy``, ``device``,
        ``share``, ``ranks``, ``weights_include``, ...).
    """

    Hyper = GRPOHyper
    hp: GRPOHyper
    _metric_keys = ("loss", "pg_loss", "entropy", "clip_fraction", "approx_kl", "grad_norm")
    inputs = _INPUTS
    outputs = {  # noqa: RUF012
        "weights": Port(ANY, doc="WeightUpdate of the policy"),
        "metrics": Port(ANY, doc="dict[str, float]"),
    }

    def __init__(
        self,
        policy: str | Mapping[str, Any] = "tiny-prefix-vlm",
        *,
        aggregation: str = "seq-mean-token-mean",
        horizon: int = 0,
        **options: Any,
    ) -> None:
        super().__init__(policy, {"aggregation": aggregation, "horizon": horizon}, **options)

    def _step(self, full: View) -> dict[str, Any]:
        metrics = self.trainer.train(full, self._loss_over)
        weights = self._publish(self.policy, self.share, metrics, filtered=True)
        return {"weights": weights, "metrics": metrics}

    def _loss_over(self, full: View) -> MicroLoss:
        """The loss of a micro-batch as its share of the mini-batch ``full``'s."""
        hp = self.hp
        n_tokens = int(full.real.sum())  # of the whole mini-batch, also in a rank group
        mean = AGGREGATIONS[hp.aggregation]
        horizon = hp.horizon or int(full.real.shape[1])  # of the whole mini-batch
        count = int(mean.count(full.real, horizon))  # what the loss averages over

        def micro_loss(view: View, rows: slice) -> tuple[Tensor, dict[str, float]] | None:
            policy = self._policy_terms(view, rows)
            if policy is None:
                return None
            t, r = view.t, policy.real
            w_tok = policy.tokens / n_tokens  # share of the batch's tokens (token-mean stats)
            w = int(mean.count(r, horizon)) / count  # share of the loss
            # the inputs were checked once for the call, the logprobs by _policy_terms
            ref = t["ref_logprobs"][rows] if hp.kl_coef > 0 else policy.logprobs.detach()
            loss, stats = _grpo_loss(
                policy.logprobs,
                t["logprobs"][rows],
                ref,
                t["advantages"][rows],
                r,
                *hp.clip,
                beta=hp.kl_coef,
                aggregation=hp.aggregation,
                kl_estimator=hp.kl_estimator,
                is_weights=t["tis_weights"][rows] if "tis_weights" in t else None,
                horizon=horizon,
                policy_loss=hp.policy_loss,
            )
            entropy = _aggregate("entropy", policy.entropy, r, hp.aggregation, horizon)  # ()
            loss = loss - hp.entropy_coef * entropy  # ()
            out = {
                "loss": w * _item(loss),
                "pg_loss": w * _item(stats["pg_loss"]),
                "entropy": w * _item(entropy),
                "clip_fraction": w_tok * _item(stats["clip_fraction"]),
                "approx_kl": w_tok * _item(stats["approx_kl"]),
            }
            if hp.kl_coef > 0:
                out["kl_ref"] = w * _item(stats["ref_kl"])
            if hp.distill_loss:  # the reverse KL to the teacher, aggregated as the loss is
                distill = _kl_loss(
                    policy.logprobs, t["teacher_logprobs"][rows], r, hp.distill_estimator,
                    hp.aggregation, horizon,
                )  # fmt: skip
                loss = loss + hp.distill_coef * distill  # ()
                out["distill_loss"] = w * _item(distill)
                out["loss"] = w * _item(loss)
            return loss * w, out

        return micro_loss
