"""The updates' hyper-parameters: frozen, typed structs that a node's constructor fills from its
keywords (:meth:`UpdateHyper.checked`), PPO's and GRPO's shared part declared once."""

from __future__ import annotations

import math
from typing import Any, Self

import msgspec
import torch

from nodes.models.precision import PRECISIONS
from nodes.models.sampling import temperature_problem
from nodes.rl.advantages import KL_ESTIMATORS
from nodes.rl.aggregate import AGGREGATIONS
from nodes.rl.losses import DISTILL_MODES, POLICY_LOSSES, is_weights_problem
from nodes.update.schedule import schedule_problem

__all__ = ["TRAIN_BACKENDS", "GRPOHyper", "PPOHyper", "UpdateHyper"]

TRAIN_BACKENDS = ("fsdp", "hsdp", "ddp")
"""How a rank group trains the models: FSDP2 (sharded over every rank), HSDP (FSDP2 sharded
within each host and replicated across hosts) or DDP (replicated); runtime.ranks."""

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
"""The largest learning rate an optimizer step can apply (larger ones do not convert)."""


class UpdateHyper(msgspec.Struct, frozen=True, kw_only=True):
    """What PPO and GRPO updates share: how a call trains (the node's keywords of these names)."""

    lr: float = 1e-4
    """AdamW learning rate (the peak of the schedule)."""
    weight_decay: float = 0.0
    """AdamW weight decay of every optimizer."""
    clip_eps: float = 0.2
    """The policy ratio's clip range below 1 (and above it, unless ``clip_eps_high``)."""
    clip_eps_high: float | None = None
    """The clip range above 1 (DAPO's upper one); None: ``clip_eps``."""
    dual_clip: float | None = None
    """The dual clip of negative advantages (> 1); None: off."""
    policy_loss: str = "ppo"
    """A registered policy loss (``nodes.rl.losses.POLICY_LOSSES``): ``"ppo"`` (each token's
    ratio clipped) or ``"gspo"`` (each response's sequence ratio clipped; use GSPO's small clip
    range, e.g. ``clip_eps=3e-4, clip_eps_high=4e-4``)."""
    kl_estimator: str = "k3"
    """A registered KL estimator (``nodes.rl.advantages.KL_ESTIMATORS``) of the KL term."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference loss term; 0 disables it and the ``ref_logprobs`` input."""
    distill_coef: float = 0.0
    """Weight of the reverse KL to a teacher (``teacher_logprobs``), ``log pi - log pi_teacher``
    per sampled token; 0 disables it and the ``teacher_logprobs`` input."""
    distill_mode: str = "loss"
    """How ``distill_coef`` acts: ``"loss"`` (``distill_coef`` * the aggregated
    ``distill_estimator`` of the reverse KL joins the loss) or ``"advantage"``
    (``-distill_coef * (logprobs - teacher_logprobs)`` joins each token's advantage;
    :func:`nodes.rl.losses.distill_advantages`)."""
    distill_estimator: str = "k2"
    """A registered KL estimator of the loss mode's term (k2: its gradient on the policy's own
    samples is the reverse KL's)."""
    reward_coef: float = 1.0
    """Weight of the ``advantages`` input (the reward's); 0 with ``distill_coef`` > 0: the
    teacher alone teaches (pure on-policy distillation)."""
    epochs: int = 1
    """Passes over the batch per call."""
    micro_batch_size: int = 0
    """Samples per gradient-accumulation micro-batch; 0: the whole batch."""
    micro_batch_tokens: int = 0
    """A budget of padded prompt + response tokens per micro-batch (rows sorted longest first,
    each micro-batch trimmed of unused padding); 0: none. The step equals the unsplit one up to
    float rounding."""
    mask_truncated: bool = False
    """Leave the responses the rollout cut at max_new_tokens (``truncated``) out of the loss."""
    tis_cap: float = 0.0
    """Truncated importance sampling: weigh each token's policy loss by
    ``min(exp(logprobs - rollout_logprobs), tis_cap)`` (needs ``rollout_logprobs``); 0: off."""
    tis_level: str = "token"
    """With ``tis_cap``: ``"token"`` (each token's ratio) or ``"sequence"`` (each response's
    geometric-mean ratio on all its tokens); :func:`nodes.rl.losses.importance_weights`."""
    tis_mode: str = "truncate"
    """With ``tis_cap``: ``"truncate"`` (``min(ratio, tis_cap)``) or ``"mask"`` (the ratio inside
    ``[1/tis_cap, tis_cap]``, 0 outside; ``tis_cap`` > 1)."""
    pack_sequences: bool = False
    """A micro-batch's rows packed into one sequence for the policy's forward (a text causal
    LM; position ids restart at each row): the padded loss up to float rounding."""
    mini_batches: int = 1
    """Optimizer steps per pass, each on 1/M of the batch's units (a prompt's responses, or a
    row), shuffled with the step's seed."""
    mixed_precision: str = "no"
    """``"no"`` or ``"bf16"`` (autocast; weights and AdamW state stay float32)."""
    lr_schedule: str = "constant"
    """``"constant"``, ``"linear"`` or ``"cosine"`` after a linear warmup, counted in update
    calls (:mod:`nodes.update.schedule`)."""
    lr_warmup_steps: int = 0
    """Update calls of linear warmup."""
    lr_decay_steps: int = 0
    """Update calls of the linear or cosine decay, after the warmup."""
    max_grad_norm: float = 1.0
    """Clip each model's gradient norm to this; 0 (or None given): no clipping."""
    temperature: float = 1.0
    """The rollout's sampling temperature (logprobs are of ``logits / T``)."""
    seed: int = 0
    """Seeds randomness inside a step (the mini-batches' shuffle, dropout if a model has any);
    the global RNG is left as it was."""
    on_nonfinite: str = "skip"
    """``"skip"`` or ``"raise"`` a step that meets a non-finite value (see :mod:`nodes.update`)."""

    @property
    def distill_loss(self) -> bool:
        """Whether the reverse KL to the teacher is a term of the loss."""
        return self.distill_coef > 0 and self.distill_mode == "loss"

    @property
    def loss_terms(self) -> list[str]:
        """The metrics of the optional loss terms this update computes."""
        return [
            *(["kl_ref"] if self.kl_coef > 0 else []),
            *(["distill_loss"] if self.distill_loss else []),
        ]

    @property
    def clip(self) -> tuple[float, float, float | None]:
        """The ratio's clip range below and above 1, and the dual clip of negative advantages."""
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        return self.clip_eps, high, self.dual_clip

    @classmethod
    def checked(cls, where: str, **options: Any) -> Self:
        """The hyper-parameters ``options`` (a node's keywords), checked and converted; a
        ValueError that starts with ``where`` (the node) and names the option otherwise."""
        given = cls(**options)  # as given: msgspec converts nothing here
        for ok, why in given._checks():
            if not ok:
                raise ValueError(f"{where}: {why}")
        return cls(**given._converted(where))

    def _checks(self) -> list[tuple[bool, str | None]]:
        hot = temperature_problem(self.temperature, greedy=False)
        why = schedule_problem(self.lr_schedule, self.lr_warmup_steps, self.lr_decay_steps)
        lr, clip_high, dual, tis = self.lr, self.clip_eps_high, self.dual_clip, self.tis_cap
        why_is = is_weights_problem(tis if tis > 0 else 2.0, self.tis_level, self.tis_mode)
        return [
            (0 < lr <= _FLOAT32_MAX, f"lr={lr}; it must be > 0 and fit float32"),
            (self.weight_decay >= 0, f"weight_decay={self.weight_decay}; it must be >= 0"),
            (0 < self.clip_eps < 1, f"clip_eps={self.clip_eps}; it must be in (0, 1)"),
            (
                clip_high is None or clip_high > 0,
                f"clip_eps_high={clip_high}; it must be > 0 (or None for clip_eps)",
            ),
            (
                dual is None or (dual > 1 and math.isfinite(dual)),
                f"dual_clip={dual}; it must be a finite number > 1 (or None: off)",
            ),
            (self.entropy_coef >= 0, f"entropy_coef={self.entropy_coef}; it must be >= 0"),
            (
                self.kl_coef >= 0,
                f"kl_coef={self.kl_coef}; it must be >= 0 (0 disables the KL term)",
            ),
            (
                self.distill_coef >= 0 and math.isfinite(self.distill_coef),
                f"distill_coef={self.distill_coef}; it must be a finite number >= 0 (0: off)",
            ),
            (
                self.distill_mode in DISTILL_MODES,
                f"distill_mode={self.distill_mode!r}; choose one of {', '.join(DISTILL_MODES)}",
            ),
            (
                self.reward_coef >= 0 and math.isfinite(self.reward_coef),
                f"reward_coef={self.reward_coef}; it must be a finite number >= 0",
            ),
            (int(self.epochs) >= 1, f"epochs={self.epochs}; it must be >= 1"),
            (
                int(self.micro_batch_size) >= 0,
                f"micro_batch_size={self.micro_batch_size}; 0 = whole batch",
            ),
            (
                int(self.micro_batch_tokens) >= 0,
                f"micro_batch_tokens={self.micro_batch_tokens}; it must be >= 0 (0: no budget)",
            ),
            (
                int(self.mini_batches) >= 1,
                f"mini_batches={self.mini_batches}; it must be >= 1 (optimizer steps per epoch)",
            ),
            (
                self.mixed_precision in PRECISIONS,
                f"mixed_precision={self.mixed_precision!r}; choose one of {', '.join(PRECISIONS)}",
            ),
            (why is None, why),
            (
                self.max_grad_norm is None or self.max_grad_norm >= 0,
                f"max_grad_norm={self.max_grad_norm}; it must be >= 0 (0 or None: no clipping)",
            ),
            (hot is None, f"{hot} (the rollout's)"),
            (
                self.on_nonfinite in ("raise", "skip"),
                f"on_nonfinite={self.on_nonfinite!r}; choose 'raise' or 'skip' (as on_bad_sample)",
            ),
            (
                tis >= 0 and math.isfinite(tis),
                f"tis_cap={tis}; it must be a finite number >= 0 (0: no correction)",
            ),
            (
                why_is is None,
                f"tis_cap={tis}, tis_level={self.tis_level!r}, "
                f"tis_mode={self.tis_mode!r}: {why_is}",
            ),
        ]

    def _converted(self, where: str) -> dict[str, Any]:
        """The fields as their types (``int`` for ``1.0``, ...), the registered names checked."""
        out = {}
        for field in msgspec.structs.fields(self):
            value, kind = getattr(self, field.name), field.type
            if value is not None and kind in (float, int, bool, float | None):
                value = (float if kind == float | None else kind)(value)
            out[field.name] = value
        out["kl_estimator"] = KL_ESTIMATORS.check(self.kl_estimator, f"{where}: kl_estimator")
        out["distill_estimator"] = KL_ESTIMATORS.check(
            self.distill_estimator, f"{where}: distill_estimator"
        )
        out["policy_loss"] = POLICY_LOSSES.check(self.policy_loss, f"{where}: policy_loss")
        out["max_grad_norm"] = float(self.max_grad_norm or 0.0)
        return out


class GRPOHyper(UpdateHyper, frozen=True, kw_only=True):
    """GRPO's hyper-parameters: the shared ones, and how the loss aggregates."""

    aggregation: str = "seq-mean-token-mean"
    """A registered aggregation (``nodes.rl.aggregate.AGGREGATIONS``) of the loss and the
    entropy term: the paper's ``"seq-mean-token-mean"``, ``"token-mean"``,
    ``"seq-mean-token-sum"`` or ``"seq-mean-token-sum-norm"`` (Dr.GRPO's)."""
    horizon: int = 0
    """The constant token count of ``"seq-mean-token-sum-norm"``: the generation budget
    (``max_new_tokens``); 0: the width of each mini-batch's responses."""

    def _checks(self) -> list[tuple[bool, str | None]]:
        h = self.horizon
        return [
            *super()._checks(),
            (
                isinstance(h, int) and not isinstance(h, bool) and h >= 0,
                f"horizon={h!r}; it must be an int >= 0 (the generation budget, max_new_tokens; "
                "0: the responses' padded width)",
            ),
        ]

    def _converted(self, where: str) -> dict[str, Any]:
        converted = super()._converted(where)
        converted["aggregation"] = AGGREGATIONS.check(self.aggregation, f"{where}: aggregation")
        return converted


class PPOHyper(UpdateHyper, frozen=True, kw_only=True):
    """PPO's hyper-parameters: the shared ones, and the value model's."""

    critic_lr: float | None = None
    """The value model's AdamW learning rate; None: ``lr``."""
    value_clip_eps: float | None = 0.2
    """Value clip range around the old values; None disables it."""
    vf_coef: float = 0.5
    """Weight of the value loss."""

    def _checks(self) -> list[tuple[bool, str | None]]:
        critic_lr, clip = self.critic_lr, self.value_clip_eps
        return [
            *super()._checks(),
            (
                critic_lr is None or 0 < critic_lr <= _FLOAT32_MAX,
                f"critic_lr={critic_lr}; it must be > 0 and fit float32 (or None: lr)",
            ),
            (
                clip is None or clip > 0,
                f"value_clip_eps={clip}; it must be > 0 (or None: no clip)",
            ),
            (self.vf_coef >= 0, f"vf_coef={self.vf_coef}; it must be >= 0"),
        ]

    def _converted(self, where: str) -> dict[str, Any]:
        converted = super()._converted(where)
        converted["critic_lr"] = converted["critic_lr"] or converted["lr"]
        return converted
