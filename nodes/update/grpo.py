"""The GRPO update: group advantages and a KL term to the reference, no critic."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from nodes.rl.aggregate import AGGREGATIONS, _aggregate
from nodes.rl.losses import _grpo_loss
from nodes.update.base import _INPUTS, MicroLoss, _item, _Update
from nodes.update.micro import View
from yatt_graph import ANY, BatchPolicy, Port

__all__ = ["GRPOUpdate"]


class GRPOUpdate(_Update):
    """GRPO (``nodes.rl.losses.grpo_loss``): the clipped surrogate with group advantages plus
    ``kl_coef`` * k3 KL to the reference, minus ``entropy_coef`` * entropy; no critic.

    Inputs: the rollout's ``prompt_ids``, ``prompt_mask``, ``response_ids``, ``response_mask``,
    ``logprobs`` (old), ``advantages`` float32[B, R] (from GroupAdvantage), optionally
    ``ref_logprobs`` (required when ``kl_coef > 0``) and ``image_embeds`` / ``images``.
    Outputs: ``weights`` (a WeightUpdate of the policy) and ``metrics`` (loss, pg_loss, entropy,
    clip_fraction, approx_kl, kl_ref (with kl_coef > 0), grad_norm, lr, skipped_nonfinite; with
    ``ranks > 1`` also time/weight_gather, the seconds spent gathering the published weights).

    Args:
        aggregation: a registered aggregation (``nodes.rl.aggregate.AGGREGATIONS``):
            ``"seq-mean-token-mean"`` (the paper's ``1/G sum_i 1/|o_i| sum_t``, the default),
            ``"token-mean"``, ``"seq-mean-token-sum"`` or ``"seq-mean-token-sum-norm"``
            (Dr.GRPO's); it also aggregates the entropy term.
        horizon: the constant token count of ``"seq-mean-token-sum-norm"``: the generation
            budget (``max_new_tokens``); 0: the width of each mini-batch's responses.
        kl_coef: GRPO's beta (the paper uses 0.04; 0 disables the term and the input).
        share: a share key (e.g. ``"policy"``, as on the Rollout): one policy module with the
            nodes of that key on an on-policy executor (:mod:`nodes.shared_models`).
        ranks, train_backend, rank_timeout_s: train as an SPMD group of ``ranks`` processes
            (``runtime.ranks``), sharded by ``"fsdp"`` (FSDP2) or replicated by
            ``"ddp"``; ``rank_timeout_s`` bounds the ranks' start and each collective.
        The others are as in :class:`PPOUpdate`.
    """

    _metric_keys = ("loss", "pg_loss", "entropy", "clip_fraction", "approx_kl", "grad_norm")
    inputs = _INPUTS
    outputs = {  # noqa: RUF012
        "weights": Port(ANY, doc="WeightUpdate of the policy"),
        "metrics": Port(ANY, doc="dict[str, float]"),
    }

    def __init__(
        self,
        policy: str | Mapping[str, Any] = "tiny-prefix-vlm",
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        dual_clip: float | None = None,
        kl_estimator: str = "k3",
        kl_coef: float = 0.0,
        entropy_coef: float = 0.0,
        aggregation: str = "seq-mean-token-mean",
        horizon: int = 0,
        epochs: int = 1,
        micro_batch_size: int = 0,
        micro_batch_tokens: int = 0,
        mask_truncated: bool = False,
        tis_cap: float = 0.0,
        pack_sequences: bool = False,
        mini_batches: int = 1,
        mixed_precision: str = "no",
        lr_schedule: str = "constant",
        lr_warmup_steps: int = 0,
        lr_decay_steps: int = 0,
        max_grad_norm: float | None = 1.0,
        temperature: float = 1.0,
        seed: int = 0,
        on_nonfinite: str = "skip",
        device: str = "cpu",
        name: str | None = None,
        share: str | None = None,
        ranks: int = 1,
        train_backend: str = "fsdp",
        rank_timeout_s: float = 300.0,
        *,
        placement: str | int | None = None,
        batch_policy: BatchPolicy | None = None,
    ) -> None:
        super().__init__(name, placement=placement, batch_policy=batch_policy)
        self.aggregation = AGGREGATIONS.check(aggregation, f"node {self.name!r}: aggregation")
        if not (isinstance(horizon, int) and not isinstance(horizon, bool) and horizon >= 0):
            raise ValueError(
                f"node {self.name!r}: horizon={horizon!r}; it must be an int >= 0 (the "
                "generation budget, max_new_tokens; 0: the responses' padded width)"
            )
        self.horizon = horizon
        self._init_common()

    def _step(self, full: View) -> dict[str, Any]:
        metrics = self._train(full, self._loss_over)
        weights = self._publish(metrics)
        return {"weights": weights, "metrics": metrics}

    def _loss_over(self, full: View) -> MicroLoss:
        """The loss of a micro-batch as its share of the mini-batch ``full``'s."""
        n_tokens = int(full.real.sum())  # of the whole mini-batch, also in a rank group
        mean = AGGREGATIONS[self.aggregation]
        horizon = self.horizon or int(full.real.shape[1])  # of the whole mini-batch
        count = int(mean.count(full.real, horizon))  # what the loss averages over

        def micro_loss(view: View, rows: slice) -> tuple[Tensor, dict[str, float]] | None:
            t = view.t
            r, ids = view.real[rows], t["response_ids"][rows]
            mask = r  # bool[b, R], checked once for the call: no 0/1 scan in each loss term
            n = int(r.sum())
            if n == 0:
                return None
            w_tok = n / n_tokens  # share of the batch's tokens (token-mean stats)
            w = int(mean.count(r, horizon)) / count  # share of the loss
            batch = self._prompt_batch(self.policy, view, rows)
            reads = view.reads[rows]  # bool[b, R]: observations too, in a multi-turn trajectory
            new_logprobs, token_entropy = self._policy_terms(batch, ids, mask, r, reads)
            # the inputs were checked once for the call, the logprobs by _policy_terms
            ref = t["ref_logprobs"][rows] if self.kl_coef > 0 else new_logprobs.detach()
            loss, stats = _grpo_loss(
                new_logprobs,
                t["logprobs"][rows],
                ref,
                t["advantages"][rows],
                r,
                *self._clip,
                beta=self.kl_coef,
                aggregation=self.aggregation,
                kl_estimator=self.kl_estimator,
                is_weights=t["tis_weights"][rows] if "tis_weights" in t else None,
                horizon=horizon,
            )
            entropy = _aggregate("entropy", token_entropy, r, self.aggregation, horizon)  # ()
            loss = loss - self.entropy_coef * entropy  # ()
            out = {
                "loss": w * _item(loss),
                "pg_loss": w * _item(stats["pg_loss"]),
                "entropy": w * _item(entropy),
                "clip_fraction": w_tok * _item(stats["clip_fraction"]),
                "approx_kl": w_tok * _item(stats["approx_kl"]),
            }
            if self.kl_coef > 0:
                out["kl_ref"] = w * _item(stats["ref_kl"])
            return loss * w, out

        return micro_loss
