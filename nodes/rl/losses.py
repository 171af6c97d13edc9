"""Policy-gradient and value losses for RLHF updates (PPO, GRPO), as pure torch functions.

Conventions are those of ``nodes.rl.advantages``: (B, T) token tensors with a ``mask`` that is 1 on
real response tokens and 0 on padding. Padding is never read: it may hold NaN or inf, it does
not change any loss or stat, and the gradient of a loss with respect to a padded entry is
exactly 0. Losses return a 0-d tensor; stats are detached 0-d tensors (call ``.item()`` when
logging).

Aggregation of per-token losses (``aggregation=``):

- ``"token-mean"``: mean over every real token of the batch (each token weighs the same).
- ``"seq-mean-token-mean"``: mean over tokens within each sample, then over samples (each
  sample weighs the same; the GRPO paper's ``1/G sum_i 1/|o_i| sum_t``). Samples without a real
  token are left out.
- ``"seq-mean-token-sum"``: the sum over tokens within each sample, then the mean over samples.
- ``"seq-mean-token-sum-norm"``: Dr.GRPO's constant normaliser, ``1/G sum_i sum_t / L`` with
  ``L`` a fixed ``horizon`` (the generation budget), so that neither a response's length nor
  the batch's padded width changes a token's weight.

Policy losses (``policy_loss=``, :data:`POLICY_LOSSES`), each of checked (B, T) inputs:

- ``"ppo"``: the clipped surrogate of the per-token ratio ``pi / pi_old`` (PPO's, GRPO's).
- ``"gspo"``: GSPO's sequence ratio ``s_i = exp(mean_t (log pi - log pi_old))`` over each
  response's tokens, clipped per sequence; the gradient flows through the token form
  ``s_i * pi_t / sg(pi_t)`` (GSPO-token), so per-token advantages work too. Its clip range
  is far smaller than PPO's: the paper uses ``clip_eps=3e-4, clip_eps_high=4e-4``.

Importance weights between the trainer and the sampler (``truncated_is_weights``,
``importance_weights``): per token or per sequence (the geometric mean of the response's
token ratios), truncated at a cap or masked (0) outside ``[1/cap, cap]``.

References:
    PPO: Schulman et al. 2017, "Proximal Policy Optimization Algorithms". Asymmetric clipping
    (``clip_eps_high``): Yu et al. 2025, "DAPO". GRPO: Shao et al. 2024, "DeepSeekMath".
    GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization". Truncated importance
    sampling: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training" (the token-level, truncated form; masking and the sequence level are its
    variants in verl's rollout correction).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from nodes.registry import Registry
from nodes.rl.advantages import KL_ESTIMATORS, KLEstimator, _kl_estimate
from nodes.rl.aggregate import (
    Aggregation,
    _aggregate,
    _check_dual_clip,
    _check_token_tensors,
    _clip_range,
    aggregate_token_loss,
)
from nodes.rl.logits import entropy_from_logits, logprobs_from_logits, token_entropy_from_logits
from nodes.rl.masked import (
    _check_bt,
    _check_float,
)

__all__ = [
    "IS_LEVELS",
    "DISTILL_MODES",
    "IS_MODES",
    "POLICY_LOSSES",
    "Aggregation",
    "gspo_policy_loss",
    "importance_weights",
    "is_weights_problem",
    "aggregate_token_loss",
    "logprobs_from_logits",
    "token_entropy_from_logits",
    "entropy_from_logits",
    "ppo_policy_loss",
    "value_loss",
    "kl_loss",
    "distill_advantages",
    "grpo_loss",
    "truncated_is_weights",
]

# ---------------------------------------------------------------------------------------------
# PPO
# ---------------------------------------------------------------------------------------------


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    *,
    aggregation: Aggregation = "token-mean",
    dual_clip: float | None = None,
    is_weights: Tensor | None = None,
    horizon: int | None = None,
    policy_loss: str = "ppo",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss.

    ``ratio = exp(logprobs - old_logprobs)``;
    ``loss = mean_t max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))``;
    with ``policy_loss="gspo"`` the ratio is each response's (:func:`gspo_policy_loss`).

    Args:
        logprobs: (B, T) log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs: (B, T) log-probs under the policy that sampled them.
        advantages: (B, T) per-token advantages (e.g. from ``compute_gae``).
        mask: (B, T) 1 on real tokens, 0 on padding.
        clip_eps: clip range below 1 (and above 1 unless ``clip_eps_high`` is given).
        clip_eps_high: clip range above 1 (DAPO's "clip-higher"); None = ``clip_eps``.
        aggregation: a registered aggregation (``"token-mean"``, the default).
        dual_clip: with a value c > 1, a negative-advantage token's loss is at most ``-A * c``.
        is_weights: (B, T) weights of each token's loss, e.g. :func:`truncated_is_weights`.
        horizon: the constant token count of ``"seq-mean-token-sum-norm"``; None: T.
        policy_loss: the registered ratio (:data:`POLICY_LOSSES`): ``"ppo"`` each token's,
            ``"gspo"`` each response's.

    Returns:
        ``(loss, stats)``: a 0-d loss, and detached 0-d stats ``clip_fraction`` (fraction of
        real tokens where the clipped term is the larger one, i.e. whose gradient is cut off),
        ``approx_kl`` (mean k3 estimate of KL(pi_old || pi) from each token's ratio) and
        ``ratio_mean`` (of the ratio the loss clips).
    """
    fn = "ppo_policy_loss"
    weights = {} if is_weights is None else {"is_weights": is_weights}
    real = _check_token_tensors(
        fn, mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, **weights
    )
    eps_low, eps_high = _clip_range(fn, clip_eps, clip_eps_high)
    _check_dual_clip(fn, dual_clip)
    POLICY_LOSSES.check(policy_loss, f"{fn}: policy_loss")
    return _ppo_policy_loss(
        logprobs, old_logprobs, advantages, real, eps_low, eps_high, dual_clip, aggregation,
        is_weights, horizon, policy_loss=policy_loss,
    )  # fmt: skip


POLICY_LOSSES: Registry = Registry("policy loss")
"""The ratio a policy loss clips (``policy_loss=``): ``fn(logprobs, old_logprobs, real) ->
(ratio, log_ratio)``, of checked (B, T) inputs (``real`` a bool mask): the ratio that weighs
each token's advantage in the clipped surrogate (with its gradient), and each token's own
``log pi / pi_old`` (0 at padding; the ``approx_kl`` stat reads it)."""

_MAX_LOG_RATIO = 10.0
"""GSPO's sequence log-ratio is clamped here before ``exp`` (as verl does): a sequence that
far off-policy (a ratio above e^10) gets no gradient rather than an overflow."""


@POLICY_LOSSES.register("ppo", "PPO's clipped surrogate of each token's ratio pi / pi_old")
def _token_ratio(logprobs: Tensor, old_logprobs: Tensor, real: Tensor) -> tuple[Tensor, Tensor]:
    log_ratio = torch.where(real, logprobs - old_logprobs, 0)  # (B, T) log pi/pi_old
    return torch.exp(log_ratio), log_ratio  # (B, T), (B, T)


@POLICY_LOSSES.register(
    "gspo", "GSPO: each response's length-normalised sequence ratio, clipped per sequence"
)
def _sequence_ratio(logprobs: Tensor, old_logprobs: Tensor, real: Tensor) -> tuple[Tensor, Tensor]:
    """GSPO-token's ratio: ``s_i = exp(1/|o_i| sum_t (log pi_t - log pi_old_t))`` and, per
    token, ``s_{i,t} = sg(s_i) * pi_t / sg(pi_t)``: its value is ``s_i`` (so the clip acts on
    the sequence), its gradient ``s_i * grad log pi_t``, which the per-sequence token mean
    turns into GSPO's ``s_i * 1/|o_i| sum_t grad log pi_t``."""
    log_ratio = torch.where(real, logprobs - old_logprobs, 0)  # (B, T) log pi/pi_old
    lengths = real.sum(1).clamp(min=1)  # (B,) real tokens per response
    seq_log_ratio = log_ratio.sum(1) / lengths  # (B,) log s_i
    token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach()[:, None]  # (B, T)
    token_log_ratio = torch.where(real, token_log_ratio, 0).clamp(max=_MAX_LOG_RATIO)  # (B, T)
    return torch.exp(token_log_ratio), log_ratio  # (B, T) s_i on each token of response i


def _ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    real: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    is_weights: Tensor | None = None,
    horizon: int | None = None,
    *,
    fn: str = "ppo_policy_loss",
    policy_loss: str = "ppo",
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`ppo_policy_loss` of checked inputs (finite on ``real``, a bool mask): what an
    update calls on every micro-batch of the inputs it checked once, and GRPO's policy term
    (errors name ``fn``). With ``dual_clip`` c (> 1), a token with a negative advantage loses
    at most ``-A * c`` (Ye et al. 2020, "dual-clip PPO"): a huge ratio on a bad token cannot
    dominate the batch. ``is_weights`` (B, T), detached, scale each token's loss (truncated
    importance sampling). ``policy_loss`` names the ratio (:data:`POLICY_LOSSES`)."""
    ratio, log_ratio = POLICY_LOSSES[policy_loss](logprobs, old_logprobs, real)  # (B, T) x 2
    advantages = torch.where(real, advantages, 0)  # (B, T)
    pg_loss_unclipped = -advantages * ratio  # (B, T)
    pg_loss_clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)  # (B, T)
    token_loss = torch.maximum(pg_loss_unclipped, pg_loss_clipped)  # (B, T) pessimistic bound
    if dual_clip is not None:
        capped = torch.minimum(token_loss, -advantages * dual_clip)  # (B, T)
        token_loss = torch.where(advantages < 0, capped, token_loss)  # (B, T)
    if is_weights is not None:
        token_loss = token_loss * torch.where(real, is_weights.detach(), 0)  # (B, T)
    with torch.no_grad():
        n = real.sum().to(ratio.dtype)  # ()
        # the clipped branch wins exactly where the token's gradient is cut off
        clipped = (pg_loss_clipped > pg_loss_unclipped) & real  # (B, T)
        k3 = torch.where(real, torch.exp(log_ratio) - 1 - log_ratio, 0)  # (B, T) KL(pi_old||pi)
        stats = {
            "clip_fraction": clipped.sum().to(ratio.dtype) / n,
            "approx_kl": k3.sum() / n,
            "ratio_mean": torch.where(real, ratio, 0).sum() / n,
        }
    return _aggregate(fn, token_loss, real, aggregation, horizon), stats


def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 3e-4,
    clip_eps_high: float | None = 4e-4,
    *,
    aggregation: Aggregation = "seq-mean-token-mean",
    **options: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO's clipped surrogate of the sequence ratio (Zheng et al. 2025), GSPO-token form:
    :func:`ppo_policy_loss` with ``policy_loss="gspo"`` and the paper's defaults, a clip range
    of 3e-4 below 1 and 4e-4 above and the per-sequence token mean (with a per-response
    advantage it is the paper's objective exactly; per-token advantages, e.g. GAE's, make it
    the GSPO-token objective). ``options``: the other keywords of :func:`ppo_policy_loss`."""
    return ppo_policy_loss(
        logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps_high,
        aggregation=aggregation, policy_loss="gspo", **options,
    )  # fmt: skip


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float | None = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value-function loss.

    ``V_clip = old_values + clip(values - old_values, -clip_eps, clip_eps)``;
    ``loss = 0.5 * mean_t max((values - returns)**2, (V_clip - returns)**2)``.

    Args:
        values: (B, T) current critic values (with grad).
        old_values: (B, T) critic values at rollout time.
        returns: (B, T) value targets (e.g. from ``compute_gae``).
        mask: (B, T) 1 on real tokens, 0 on padding.
        clip_eps: how far the value may move from ``old_values`` before its gradient is cut;
            None disables clipping (plain ``0.5 * MSE``).

    Returns:
        ``(loss, stats)``: a 0-d loss, and detached 0-d stats ``value_clip_fraction`` (fraction
        of real tokens where the clipped error is the larger one) and ``value_mean``.
    """
    fn = "value_loss"
    real = _check_token_tensors(fn, mask, values=values, old_values=old_values, returns=returns)
    if clip_eps is not None and not clip_eps > 0.0:
        raise ValueError(f"{fn}: clip_eps is {clip_eps}; it must be > 0 (or None for no clip)")
    return _value_loss(values, old_values, returns, real, clip_eps)


def _value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, real: Tensor, clip_eps: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`value_loss` of checked inputs (finite on ``real``, a bool mask)."""
    values = torch.where(real, values, 0)  # (B, T) padding -> 0
    old_values = torch.where(real, old_values, 0)  # (B, T)
    returns = torch.where(real, returns, 0)  # (B, T)
    vf_loss_unclipped = (values - returns) ** 2  # (B, T)
    if clip_eps is None:
        vf_loss_clipped = vf_loss_unclipped  # (B, T)
    else:
        values_clipped = old_values + torch.clamp(
            values - old_values, -clip_eps, clip_eps
        )  # (B, T)
        vf_loss_clipped = (values_clipped - returns) ** 2  # (B, T)
    token_loss = 0.5 * torch.maximum(vf_loss_unclipped, vf_loss_clipped)  # (B, T)
    with torch.no_grad():
        n = real.sum().to(values.dtype)  # ()
        clipped = (vf_loss_clipped > vf_loss_unclipped) & real  # (B, T)
        stats = {
            "value_clip_fraction": clipped.sum().to(values.dtype) / n,
            "value_mean": values.sum() / n,
        }
    return _aggregate("value_loss", token_loss, real, "token-mean"), stats


# ---------------------------------------------------------------------------------------------
# KL to the reference, and GRPO


IS_LEVELS = ("token", "sequence")
"""Where an importance weight is taken (``level=``): each token's own ratio, or one ratio per
response (the geometric mean of its tokens' ratios) on all of its tokens."""

IS_MODES = ("truncate", "mask")
"""What a weight outside the cap becomes (``mode=``): ``min(ratio, cap)``, or 0 outside
``[1/cap, cap]`` (the ratio itself inside)."""


def truncated_is_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cap: float = 2.0
) -> Tensor:
    """Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"): per token ``min(pi_old / pi_rollout, cap)``,
    where ``old_logprobs`` are the trainer's and ``rollout_logprobs`` the sampler's (vLLM's, or
    any other engine's) for the same tokens. Weighing each token's policy loss by it corrects
    the gradient for the gap between what sampled and what trains; the cap bounds its variance.
    :func:`importance_weights` with ``level="token", mode="truncate"``.

    Args:
        old_logprobs: (B, T) the trainer's logprobs of the sampled tokens, before the update.
        rollout_logprobs: (B, T) the sampler's logprobs of the same tokens.
        mask: (B, T) 1 on real tokens, 0 on padding (the weight there is 0).
        cap: the largest weight (> 0, finite).

    Returns:
        (B, T) detached weights, 0 at padding.
    """
    return importance_weights(old_logprobs, rollout_logprobs, mask, cap)


def importance_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    cap: float = 2.0,
    level: str = "token",
    mode: str = "truncate",
) -> Tensor:
    """Importance weights of the trainer's policy against the sampler's, per token or per
    sequence, truncated or masked.

    The ratio is ``pi_old / pi_rollout``: per token ``exp(old - rollout)``; per sequence
    (``level="sequence"``) ``exp(mean_t (old - rollout))`` over the response's real tokens,
    the geometric mean of its token ratios, given to each of its tokens. The geometric mean
    rather than the product: a product over a long response drifts exponentially with its
    length (a gap of 0.01 per token is a factor e^10 over 1000 tokens), so nearly every long
    response would sit at the cap or be masked; the mean is the length-normalised ratio
    GSPO clips. ``mode="truncate"``: ``min(ratio, cap)``; ``mode="mask"`` (masked importance
    sampling): the ratio where it lies in ``[1/cap, cap]``, 0 outside (that token, or the
    whole response, leaves the loss).

    Args:
        old_logprobs: (B, T) the trainer's logprobs of the sampled tokens, before the update.
        rollout_logprobs: (B, T) the sampler's logprobs of the same tokens.
        mask: (B, T) 1 on real tokens, 0 on padding (the weight there is 0).
        cap: the largest weight: finite, > 0 to truncate, > 1 to mask.
        level: ``"token"`` or ``"sequence"`` (:data:`IS_LEVELS`).
        mode: ``"truncate"`` or ``"mask"`` (:data:`IS_MODES`).

    Returns:
        (B, T) detached weights, 0 at padding.
    """
    fn = "importance_weights"
    real = _check_token_tensors(
        fn, mask, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs
    )
    if why := is_weights_problem(cap, level, mode):
        raise ValueError(f"{fn}: {why}")
    return _is_weights(old_logprobs, rollout_logprobs, real, cap, level, mode)


def is_weights_problem(cap: float, level: str, mode: str) -> str | None:
    """Why these importance-weight settings cannot be used, or None."""
    if level not in IS_LEVELS:
        return f"level is {level!r}; choose one of {', '.join(IS_LEVELS)}"
    if mode not in IS_MODES:
        return f"mode is {mode!r}; choose one of {', '.join(IS_MODES)}"
    low = 1.0 if mode == "mask" else 0.0
    if not (cap > low and math.isfinite(cap)):
        why = " (masking keeps [1/cap, cap])" if mode == "mask" else ""
        return f"cap is {cap}; it must be a finite number > {low:g}{why}"
    return None


def _is_weights(
    old: Tensor,
    rollout: Tensor,
    real: Tensor,
    cap: float,
    level: str = "token",
    mode: str = "truncate",
) -> Tensor:
    """:func:`importance_weights` of checked inputs."""
    with torch.no_grad():
        gap = torch.where(real, old.float() - rollout.float(), 0)  # (B, T) log pi_old/pi_rollout
        if level == "sequence":
            lengths = real.sum(1).clamp(min=1)  # (B,)
            gap = (gap.sum(1) / lengths)[:, None].expand_as(gap)  # (B, T) the response's mean
        ratio = torch.exp(gap)  # (B, T)
        if mode == "mask":
            kept = (ratio >= 1.0 / cap) & (ratio <= cap)  # (B, T)
            return torch.where(real & kept, ratio, 0)  # (B, T)
        return torch.where(real, ratio.clamp(max=cap), 0)  # (B, T)


# ---------------------------------------------------------------------------------------------


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kind: KLEstimator = "k3",
    *,
    aggregation: Aggregation = "token-mean",
    horizon: int | None = None,
) -> Tensor:
    """KL(pi || pi_ref) as a loss term (add ``beta * kl_loss``), from tokens sampled from pi.

    Args:
        logprobs: (B, T) log-probs under the current policy (with grad).
        ref_logprobs: (B, T) log-probs under the frozen reference policy.
        mask: (B, T) 1 on real tokens, 0 on padding.
        kind: estimator, see ``nodes.rl.advantages.kl_penalty``; ``"k3"`` is unbiased and >= 0.
        aggregation: a registered aggregation (``"token-mean"``, the default).
        horizon: the constant token count of ``"seq-mean-token-sum-norm"``; None: T.

    Returns:
        A 0-d tensor.
    """
    fn = "kl_loss"
    real = _check_token_tensors(fn, mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    KL_ESTIMATORS.check(kind, f"{fn}: kind")
    return _kl_loss(logprobs, ref_logprobs, real, kind, aggregation, horizon)


def _kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    real: Tensor,
    kind: str,
    aggregation: str,
    horizon: int | None = None,
) -> Tensor:
    """:func:`kl_loss` of checked inputs (finite on ``real``, a bool mask)."""
    kl = _kl_estimate(logprobs, ref_logprobs, real, kind)  # (B, T)
    return _aggregate("kl_loss", kl, real, aggregation, horizon)


DISTILL_MODES = ("loss", "advantage")
"""How a teacher's reverse KL enters an update: a term of the loss (:func:`kl_loss` of the
teacher's logprobs in place of the reference's), or a term of the advantages
(:func:`distill_advantages`)."""


def distill_advantages(
    advantages: Tensor,
    logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    distill_coef: float,
    reward_coef: float = 1.0,
) -> Tensor:
    """On-policy distillation's advantages: ``reward_coef * A_t - distill_coef * (log pi(t) -
    log pi_teacher(t))`` per sampled token, 0 on padding.

    The second term is each token's reward of the reverse KL to the teacher (k1 of the
    sampled token), added after any normalisation of ``A`` (as Tinker's on-policy distillation,
    slime and verl add it): with ``reward_coef=0`` it is pure on-policy distillation.

    Args:
        advantages: (B, T) the reward's advantages.
        logprobs: (B, T) the sampling policy's logprobs (no gradient is taken).
        teacher_logprobs: (B, T) the teacher's logprobs of the same tokens.
        mask: (B, T) 1 on real tokens, 0 on padding.
        distill_coef, reward_coef: the weights (>= 0).

    Returns:
        (B, T), in ``advantages``' dtype.
    """
    fn = "distill_advantages"
    real = _check_token_tensors(
        fn, mask, advantages=advantages, logprobs=logprobs, teacher_logprobs=teacher_logprobs
    )
    for name, coef in (("distill_coef", distill_coef), ("reward_coef", reward_coef)):
        if not (coef >= 0 and math.isfinite(coef)):
            raise ValueError(f"{fn}: {name}={coef}; it must be a finite number >= 0")
    return _distill_advantages(
        advantages, logprobs, teacher_logprobs, real, distill_coef, reward_coef
    )


def _distill_advantages(
    advantages: Tensor,
    logprobs: Tensor,
    teacher_logprobs: Tensor,
    real: Tensor,
    distill_coef: float,
    reward_coef: float,
) -> Tensor:
    """:func:`distill_advantages` of checked inputs (``real``: a bool mask)."""
    reverse_kl = _kl_estimate(logprobs.detach(), teacher_logprobs, real, "k1")  # (B, T)
    mixed = reward_coef * advantages - distill_coef * reverse_kl  # (B, T)
    return torch.where(real, mixed, 0).to(advantages.dtype)  # (B, T)


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    beta: float = 0.04,
    *,
    aggregation: Aggregation = "seq-mean-token-mean",
    dual_clip: float | None = None,
    kl_estimator: KLEstimator = "k3",
    is_weights: Tensor | None = None,
    horizon: int | None = None,
    policy_loss: str = "ppo",
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO objective: PPO-clipped surrogate with per-sample advantages, plus ``beta`` * k3 KL.

    Per token: ``max(-A_i * ratio_t, -A_i * clip(ratio_t)) + beta * k3(pi || pi_ref)_t``,
    aggregated per ``aggregation`` (the paper's ``1/G sum_i 1/|o_i| sum_t`` is
    ``"seq-mean-token-mean"``, the default; ``"token-mean"`` weighs every token the same).

    Args:
        logprobs: (B, T) log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs: (B, T) log-probs under the sampling policy; None means one update per
            batch (``old = logprobs.detach()``, the ratio is 1 but the gradient is the same).
        ref_logprobs: (B, T) log-probs under the reference policy; may be None if ``beta == 0``.
        advantages: (B,) per-sample advantages (e.g. ``grpo_advantages``), broadcast over
            tokens; or (B, T) already per token.
        mask: (B, T) 1 on real tokens, 0 on padding.
        clip_eps: clip range below 1 (and above 1 unless ``clip_eps_high`` is given).
        clip_eps_high: clip range above 1; None = ``clip_eps``.
        beta: weight of the KL-to-reference term (>= 0).
        aggregation: a registered aggregation (``"seq-mean-token-mean"``, the default).
        dual_clip: with a value c > 1, a negative-advantage token's loss is at most ``-A * c``.
        kl_estimator: the registered KL estimator of the reference term (k3, the paper's).
        is_weights: (B, T) weights of each token's policy-gradient loss, e.g.
            :func:`truncated_is_weights`.
        horizon: the constant token count of ``"seq-mean-token-sum-norm"`` (Dr.GRPO: the
            generation budget); None: T.
        policy_loss: the registered policy loss of the policy term (:data:`POLICY_LOSSES`):
            ``"ppo"`` (the paper's) or ``"gspo"`` (with GSPO's far smaller clip range).

    Returns:
        ``(loss, stats)``: a 0-d loss, and detached 0-d stats ``clip_fraction``, ``approx_kl``,
        ``ratio_mean`` (as in ``ppo_policy_loss``), ``pg_loss`` and ``ref_kl`` (the aggregated
        policy-gradient and k3 terms, before ``beta``).
    """
    fn = "grpo_loss"
    logprobs = _check_float(fn, "logprobs", logprobs)
    _check_bt(fn, "logprobs", logprobs)
    advantages = _check_float(fn, "advantages", advantages)
    if advantages.dim() == 1:
        if advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(
                f"{fn}: logprobs has shape {tuple(logprobs.shape)} but advantages has shape "
                f"{tuple(advantages.shape)}; advantages must be (B,) or (B, T)"
            )
        advantages = advantages[:, None].expand_as(logprobs)  # (B, T)
    if old_logprobs is None:
        old_logprobs = logprobs.detach()  # (B, T)
    if not beta >= 0.0:
        raise ValueError(f"{fn}: beta is {beta}; it must be >= 0")
    if ref_logprobs is None:
        if beta != 0.0:
            raise ValueError(f"{fn}: ref_logprobs is None but beta is {beta}; pass ref_logprobs")
        ref_logprobs = logprobs.detach()  # (B, T) KL term is exactly 0
    real = _check_token_tensors(
        fn,
        mask,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        advantages=advantages,
        **({} if is_weights is None else {"is_weights": is_weights}),
    )
    eps_low, eps_high = _clip_range(fn, clip_eps, clip_eps_high)
    _check_dual_clip(fn, dual_clip)
    KL_ESTIMATORS.check(kl_estimator, f"{fn}: kl_estimator")
    POLICY_LOSSES.check(policy_loss, f"{fn}: policy_loss")
    return _grpo_loss(
        logprobs, old_logprobs, ref_logprobs, advantages, real, eps_low, eps_high, dual_clip,
        beta, aggregation, kl_estimator, is_weights, horizon, policy_loss,
    )  # fmt: skip


def _grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    advantages: Tensor,
    real: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
    beta: float,
    aggregation: str,
    kl_estimator: str = "k3",
    is_weights: Tensor | None = None,
    horizon: int | None = None,
    policy_loss: str = "ppo",
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`grpo_loss` of checked (B, T) inputs (finite on ``real``, a bool mask)."""
    fn = "grpo_loss"
    pg_loss, stats = _ppo_policy_loss(
        logprobs, old_logprobs, advantages, real, eps_low, eps_high, dual_clip, aggregation,
        is_weights, horizon, fn=fn, policy_loss=policy_loss,
    )  # fmt: skip
    kl_token = _kl_estimate(logprobs, ref_logprobs, real, kl_estimator)  # (B, T)
    ref_kl = _aggregate(fn, kl_token, real, aggregation, horizon)  # ()
    stats["pg_loss"] = pg_loss.detach()
    stats["ref_kl"] = ref_kl.detach()
    return pg_loss + beta * ref_kl, stats
