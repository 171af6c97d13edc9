"""The PPO update: a clipped policy loss and a clipped value loss on a separate critic."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from nodes.models.policy import check_policy_spec
from nodes.models.precision import autocast
from nodes.reference import _value_model
from nodes.rl.aggregate import _aggregate
from nodes.rl.losses import _kl_loss, _ppo_policy_loss, _value_loss
from nodes.shared_models import check_share_key
from nodes.update.base import _INPUTS, _TOKENS, MicroLoss, _item, _require_finite, _Update
from nodes.update.options import PPOHyper
from nodes.update.trainer import Trained, View
from yatt_graph import ANY, Port, WeightUpdate
from yatt_graph.node import Built

__all__ = ["PPOUpdate"]


class PPOUpdate(_Update):
    """PPO on the policy and a separate critic: ``loss = pg + vf_coef * vf - entropy_coef * H
    + kl_coef * KL_k3(pi || pi_ref)`` (+ ``distill_coef * KL(pi || pi_teacher)`` with a teacher
    in ``distill_mode="loss"``); one AdamW per model.

    Inputs (B responses of up to R tokens, P prompt tokens): the rollout's ``prompt_ids``,
    ``prompt_mask``, ``response_ids``, ``response_mask``, ``logprobs`` (old), the advantage
    node's ``advantages`` and ``returns``, the critic node's ``values`` (old), optionally
    ``ref_logprobs`` (required when ``kl_coef > 0``) and ``image_embeds`` / ``images`` (one
    row per response, or one per prompt: repeated to B).

    Outputs: ``weights`` and ``critic_weights`` (:class:`nodes.sync.WeightUpdate` snapshots of
    the policy's and the value model's state dicts, versions 1, 2, ...; feed them to the
    Rollout's and the Critic's ``weights`` inputs) and ``metrics`` (floats, the mean over the
    call's epochs: loss, pg_loss, vf_loss, entropy, clip_fraction, approx_kl, kl_ref (with
    kl_coef > 0), distill/kl and distill_loss (with distill_coef > 0; the loss in its loss
    mode), value_clip_fraction, grad_norm, critic_grad_norm (before clipping), lr,
    critic_lr, skipped_nonfinite).

    Args:
        policy: a :func:`nodes.models.policy.build_policy` spec, the same as the rollout's.
        critic: a spec for the critic trunk, the same as the Critic node's ``critic``.
        detach_trunk, head_seed: as in :class:`nodes.reference.Critic` (with ``detach_trunk``
            only the value head is trained).
        lr, critic_lr, clip_eps, policy_loss, vf_coef, epochs, micro_batch_tokens, ...: the
            hyper-parameters, as :class:`~nodes.update.options.PPOHyper` declares them.
        device: where the models train; outputs come back on the CPU.
        share, critic_share: share keys for the policy (e.g. ``"policy"``, as on the Rollout)
            and the value model (e.g. ``"critic"``, as on the Critic): on an on-policy executor
            the nodes of a key use one module (:mod:`nodes.shared_models`), and the published
            weights are then its live tensors.
        ranks, train_backend, rank_timeout_s: train both models as an SPMD group of ``ranks``
            processes (``runtime.ranks``), sharded by ``"fsdp"`` (FSDP2) or replicated
            by ``"ddp"``; ``rank_timeout_s`` bounds the ranks' start and each collective. The
            metrics then also hold time/weight_gather (seconds gathering both weights).
        weights_include, weights_dtype: what ``weights`` sends of the policy: only the keys
            matching one of these regexes (``re.search``; e.g. ``[r"lora_"]``, the LoRA
            adapters), a partial update (``complete=False``); floating tensors cast to this
            dtype (e.g. ``"bfloat16"``, half the bytes). None: every key, in its own dtype.
    """

    Hyper = PPOHyper
    hp: PPOHyper
    _version_keys = ("version", "critic_version")
    _metric_keys = (
        "loss",
        "pg_loss",
        "vf_loss",
        "entropy",
        "clip_fraction",
        "approx_kl",
        "value_clip_fraction",
        "grad_norm",
        "critic_grad_norm",
    )
    inputs = {  # noqa: RUF012
        **_INPUTS,
        "returns": _TOKENS,
        "values": Port(_TOKENS, doc="old values, from the Critic node"),
    }
    value_model = Built("the value model this node trains, built as the Critic builds it")
    critic_optimizer = Built("the value model's AdamW")
    outputs = {  # noqa: RUF012
        "weights": Port(ANY, doc="WeightUpdate of the policy"),
        "critic_weights": Port(ANY, doc="WeightUpdate of the value model"),
        "metrics": Port(ANY, doc="dict[str, float]"),
    }

    def __init__(
        self,
        policy: str | Mapping[str, Any] = "tiny-prefix-vlm",
        critic: str | Mapping[str, Any] = "tiny-prefix-vlm",
        detach_trunk: bool = False,
        head_seed: int = 0,
        *,
        critic_lr: float | None = None,
        value_clip_eps: float | None = 0.2,
        vf_coef: float = 0.5,
        critic_share: str | None = None,
        **options: Any,
    ) -> None:
        own = {"critic_lr": critic_lr, "value_clip_eps": value_clip_eps, "vf_coef": vf_coef}
        super().__init__(policy, own, **options)
        check_policy_spec(critic)
        self.critic_spec = critic
        self.critic_share = check_share_key(critic_share, f"node {self.name!r}")
        self.detach_trunk, self.head_seed = bool(detach_trunk), int(head_seed)

    def build(self) -> None:
        super().build()
        key = self.critic_share if self.ranks == 1 else None  # a group trains its own copy
        self.value_model = _value_model(
            self, key, self.critic_spec, self.detach_trunk, self.head_seed
        ).eval()
        self.sharded_values = self.value_model
        group = self.trainer.group  # formed by super().build()
        if group is not None:
            self.sharded_values = group.shard(
                self.value_model, self.train_backend, "forward", lambda out: out
            )
        model = self.value_model
        critic_params = list((model.head if self.detach_trunk else model).parameters())
        self.critic_optimizer = torch.optim.AdamW(
            critic_params, lr=self.hp.critic_lr, weight_decay=self.hp.weight_decay
        )
        self.trainer.trained.append(Trained("value_model", "critic_optimizer", "critic_grad_norm",
                                            "value model", model, critic_params,
                                            self.critic_optimizer))  # fmt: skip

    def memory(self, load: Any) -> dict[str, int]:
        """The policy's part (as GRPO's) plus the value model's, trained beside it."""
        from nodes.memory import training_memory

        held = super().memory(load)
        critic = training_memory(
            self.critic_spec, load, logits=False, **self._memory_options(self.critic_share, load)
        )
        key = self.critic_share if self.critic_share and self.ranks == 1 else ""
        held[f"weights@{key}"] = critic.pop("weights")
        return {k: held.get(k, 0) + critic.get(k, 0) for k in {*held, *critic}}

    def _step(self, full: View) -> dict[str, Any]:
        metrics = self.trainer.train(full, self._loss_over)
        metrics["critic_lr"] = self.trainer.lr(1)
        weights = self._publish(self.policy, self.share, metrics, filtered=True)
        if self._critic_beside():  # it reads this very model on every rank: only the version
            critic = WeightUpdate({}, self.trainer.updates, complete=False)
        else:
            critic = self._publish(self.value_model, self.critic_share, metrics, filtered=False)
        return {"weights": weights, "critic_weights": critic, "metrics": metrics}

    def _critic_beside(self) -> bool:
        """Whether a critic of this node's rank group scores with its value model (a
        ``Critic(rank_with=...)`` naming this node)."""
        group = self.trainer.group
        members = group.members.values() if group is not None else ()
        return any(m.rank_with == self.name and m.kind == "critic" for m in members)

    def _loss_over(self, full: View) -> MicroLoss:
        """The loss of a micro-batch as its share of the mini-batch ``full``'s."""
        hp = self.hp
        n_tokens = int(full.real.sum())  # of the whole mini-batch, also in a rank group

        def micro_loss(view: View, rows: slice) -> tuple[Tensor, dict[str, float]] | None:
            policy = self._policy_terms(view, rows)
            if policy is None:
                return None
            t, r = view.t, policy.real
            w = policy.tokens / n_tokens  # this micro-batch's share of the token-mean
            # the inputs were checked once for the call, the model outputs just above and below
            is_weights = t["tis_weights"][rows] if "tis_weights" in t else None
            pg_loss, pg_stats = _ppo_policy_loss(
                policy.logprobs, t["logprobs"][rows], t["advantages"][rows], r, *hp.clip,
                is_weights=is_weights, policy_loss=hp.policy_loss,
            )  # fmt: skip
            entropy = _aggregate("entropy", policy.entropy, r, "token-mean")  # ()
            critic_batch = self._prompt_batch(self.value_model.trunk, view, rows)
            with autocast(self.device, hp.mixed_precision):
                new_values = self.sharded_values(critic_batch, policy.ids, policy.reads)  # (b, R)
            new_values = new_values.float()
            _require_finite("values of the value model", new_values, r)
            vf_loss, vf_stats = _value_loss(
                new_values, t["values"][rows], t["returns"][rows], r, hp.value_clip_eps
            )
            loss = pg_loss + hp.vf_coef * vf_loss - hp.entropy_coef * entropy  # ()
            stats = {
                "pg_loss": _item(pg_loss),
                "vf_loss": _item(vf_loss),
                "entropy": _item(entropy),
                "clip_fraction": _item(pg_stats["clip_fraction"]),
                "approx_kl": _item(pg_stats["approx_kl"]),
                "value_clip_fraction": _item(vf_stats["value_clip_fraction"]),
            }
            if hp.kl_coef > 0:
                kl_ref = _kl_loss(
                    policy.logprobs, t["ref_logprobs"][rows], r, hp.kl_estimator, "token-mean"
                )
                loss = loss + hp.kl_coef * kl_ref  # ()
                stats["kl_ref"] = _item(kl_ref)
            if hp.distill_loss:  # the reverse KL to the teacher, a token-mean as the rest
                distill = _kl_loss(
                    policy.logprobs, t["teacher_logprobs"][rows], r, hp.distill_estimator,
                    "token-mean",
                )  # fmt: skip
                loss = loss + hp.distill_coef * distill  # ()
                stats["distill_loss"] = _item(distill)
            stats["loss"] = _item(loss)
            return loss * w, {k: w * v for k, v in stats.items()}

        return micro_loss
