"""Advantage estimators and reward shaping for RLHF, as pure torch functions.

Conventions (shared with ``nodes.rl.losses``):

- ``B`` samples (responses), ``T`` response tokens per sample, right-padded.
- ``mask`` (B, T): 1 (or True) on real response tokens, 0 on padding; rows may be ragged.
  Nothing is read at padding: it may hold NaN or inf, and every (B, T) output is 0 there.
- Per-sample scalars (``scores``) are (B,). Groups of samples that answer the same prompt are
  given either by ``group_size`` (contiguous groups: samples ``[k*G, (k+1)*G)`` form group ``k``)
  or by ``group_ids`` (B,) integer labels in any order.
- Functions are dtype-agnostic: float32 in, float32 out; float64 in, float64 out.

References:
    GAE: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation". GRPO: Shao et al. 2024, "DeepSeekMath". RLOO: Ahmadian et al. 2024, "Back to
    Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs".
    KL estimators k1/k2/k3: Schulman 2020, "Approximating KL Divergence".
"""

from __future__ import annotations

import torch
from torch import Tensor

from nodes.registry import Registry
from nodes.rl.masked import (
    _check_b,
    _check_bt,
    _check_finite,
    _check_float,
    _check_mask,
    _check_same_shape,
    _check_tensor,
)

__all__ = [
    "GROUP_ESTIMATORS",
    "KL_ESTIMATORS",
    "KLEstimator",
    "compute_gae",
    "dr_grpo_advantages",
    "grpo_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "broadcast_to_tokens",
    "kl_penalty",
    "apply_kl_to_rewards",
]

GROUP_ESTIMATORS: Registry = Registry("group advantage estimator")
"""Per-sample advantages from the scores of each prompt's group: ``fn(scores (B,), *,
group_ids (B,)) -> (B,)``; :class:`nodes.advantage.GroupAdvantage` and the GRPO graphs'
``estimator`` option name one."""

KL_ESTIMATORS: Registry = Registry("KL estimator")
"""Per-token estimates of KL(pi || pi_ref) from ``log_ratio = log pi - log pi_ref``:
``fn(log_ratio (B, T)) -> (B, T)``; :func:`kl_penalty` and the KL loss name one."""


# ---------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------


def compute_gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Token-level Generalized Advantage Estimation.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``,
    run backwards over the real tokens of each row. The episode ends with the response: the
    value after the last real token is 0 (no bootstrap). Padding is skipped, so each real token
    is linked to the next *real* token of its row (for right padding this is plain GAE).

    Args:
        rewards: (B, T) per-token rewards (e.g. from ``apply_kl_to_rewards``).
        values: (B, T) critic values V(s_t).
        mask: (B, T) 1 on real response tokens, 0 on padding.
        gamma: discount factor in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        ``(advantages, returns)``, both (B, T), 0 at padding; ``returns = advantages + values``
        on real tokens (the value-function targets).
    """
    fn = "compute_gae"
    rewards = _check_float(fn, "rewards", rewards)
    values = _check_float(fn, "values", values)
    B, T = _check_bt(fn, "rewards", rewards)
    _check_same_shape(fn, "rewards", rewards, "values", values, "(B, T)")
    real = _check_mask(fn, mask, rewards.shape, "rewards")  # (B, T) bool
    _check_finite(fn, "rewards", rewards, real)
    _check_finite(fn, "values", values, real)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"{fn}: gamma is {gamma}; it must be in [0, 1]")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"{fn}: lam is {lam}; it must be in [0, 1]")

    rewards = torch.where(real, rewards, 0)  # (B, T) padding -> 0 so it cannot leak
    values = torch.where(real, values, 0)  # (B, T)
    next_value = values.new_zeros(B)  # (B,) V(s_{t+1}); 0 after the last real token
    next_advantage = values.new_zeros(B)  # (B,) A_{t+1}
    advantages_reversed = []
    for t in reversed(range(T)):
        real_t = real[:, t]  # (B,)
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        advantage_t = delta + gamma * lam * next_advantage  # (B,)
        advantage_t = torch.where(real_t, advantage_t, 0)  # (B,)
        # at padding, carry the state of the next real token across the gap
        next_advantage = torch.where(real_t, advantage_t, next_advantage)  # (B,)
        next_value = torch.where(real_t, values[:, t], next_value)  # (B,)
        advantages_reversed.append(advantage_t)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)  # (B, T)
    returns = torch.where(real, advantages + values, 0)  # (B, T)
    return advantages, returns


# ---------------------------------------------------------------------------------------------
# group baselines: GRPO and RLOO
# ---------------------------------------------------------------------------------------------


def _group_index(
    fn: str, scores: Tensor, group_size: int | None, group_ids: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Map samples to groups: returns (index (B,), counts (G,), labels (G,)), G = number of groups."""
    B = scores.shape[0]
    if (group_size is None) == (group_ids is None):
        raise ValueError(f"{fn}: pass exactly one of group_size (int) or group_ids (B,) tensor")
    if group_ids is None:
        if isinstance(group_size, Tensor) or not isinstance(group_size, int):
            raise ValueError(
                f"{fn}: group_size must be an int, got {type(group_size).__name__}; "
                "pass per-sample labels as group_ids="
            )
        if group_size < 1:
            raise ValueError(f"{fn}: group_size is {group_size}; it must be >= 1")
        if B % group_size != 0:
            raise ValueError(
                f"{fn}: scores has {B} samples, which is not a multiple of group_size "
                f"{group_size}; groups must be contiguous blocks of group_size samples"
            )
        group_ids = torch.arange(B, device=scores.device) // group_size  # (B,)
    group_ids = _check_tensor(fn, "group_ids", group_ids)
    if group_ids.shape != scores.shape:
        raise ValueError(
            f"{fn}: scores has shape {tuple(scores.shape)} but group_ids has shape "
            f"{tuple(group_ids.shape)}; both must be (B,)"
        )
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"{fn}: group_ids has dtype {group_ids.dtype}; it must be integer")
    labels, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return index, counts, labels  # (B,), (G,), (G,)


def _group_sum(x: Tensor, index: Tensor, n_groups: int) -> Tensor:
    return x.new_zeros(n_groups).index_add(0, index, x)  # (G,)


@GROUP_ESTIMATORS.register("grpo", "each score against its group's mean and std (DeepSeekMath)")
def grpo_advantages(
    scores: Tensor,
    group_size: int | None = None,
    *,
    group_ids: Tensor | None = None,
    eps: float = 1e-6,
    normalize_std: bool = True,
) -> Tensor:
    """GRPO outcome advantages: each score normalized within its group.

    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``, with the unbiased (n - 1) std as in
    DeepSeekMath and TRL. With ``normalize_std=False`` only the mean is removed (Dr. GRPO).
    A group of one sample gets advantage 0 (it has no baseline to compare with).

    Args:
        scores: (B,) one scalar reward per sample.
        group_size: contiguous groups of this many samples; or give ``group_ids`` instead.
        group_ids: (B,) integer group label per sample, in any order.
        eps: added to the std to avoid dividing by 0 when a group's scores are all equal.
        normalize_std: divide by the group std (True) or only subtract the group mean (False).

    Returns:
        (B,) advantages, in the order of ``scores``. Broadcast over tokens with
        ``broadcast_to_tokens``.
    """
    fn = "grpo_advantages"
    scores = _check_float(fn, "scores", scores)
    _check_b(fn, "scores", scores)
    _check_finite(fn, "scores", scores)
    index, counts, _ = _group_index(fn, scores, group_size, group_ids)  # (B,), (G,)
    n_groups = counts.shape[0]
    n = counts.to(scores.dtype)  # (G,)
    group_mean = _group_sum(scores, index, n_groups) / n  # (G,)
    deviation = scores - group_mean[index]  # (B,)
    if normalize_std:
        sq_dev_sum = _group_sum(deviation**2, index, n_groups)  # (G,)
        group_std = torch.sqrt(sq_dev_sum / (n - 1).clamp(min=1))  # (G,) unbiased
        advantages = deviation / (group_std[index] + eps)  # (B,)
    else:
        advantages = deviation  # (B,)
    return torch.where(counts[index] > 1, advantages, 0)  # (B,) group of one -> 0


@GROUP_ESTIMATORS.register("dr_grpo", "each score against its group's mean, no std (Dr. GRPO)")
def dr_grpo_advantages(scores: Tensor, *, group_ids: Tensor) -> Tensor:
    """GRPO advantages without the std normalization (Liu et al. 2025, "Understanding R1-Zero-Like
    Training"): ``A_i = r_i - mean(r_group)``."""
    return grpo_advantages(scores, group_ids=group_ids, normalize_std=False)


@GROUP_ESTIMATORS.register("rloo", "each score against the mean of the others in its group")
def rloo_advantages(
    scores: Tensor, group_size: int | None = None, *, group_ids: Tensor | None = None
) -> Tensor:
    """REINFORCE Leave-One-Out advantages: the baseline is the mean of the *other* samples.

    ``A_i = r_i - (1 / (n - 1)) * sum_{j != i} r_j`` over the n samples of i's group.

    Args:
        scores: (B,) one scalar reward per sample.
        group_size: contiguous groups of this many samples (>= 2); or give ``group_ids``.
        group_ids: (B,) integer group label per sample, in any order; every group needs >= 2.

    Returns:
        (B,) advantages, in the order of ``scores``.

    Raises:
        ValueError: a group has one sample (the leave-one-out baseline is undefined).
    """
    fn = "rloo_advantages"
    scores = _check_float(fn, "scores", scores)
    _check_b(fn, "scores", scores)
    _check_finite(fn, "scores", scores)
    if group_ids is None and group_size == 1:
        raise ValueError(
            f"{fn}: group_size is 1; the leave-one-out baseline needs at least 2 samples per "
            "group (sample several responses per prompt, or use grpo_advantages)"
        )
    index, counts, labels = _group_index(fn, scores, group_size, group_ids)  # (B,), (G,), (G,)
    if bool((counts < 2).any()):
        lonely = labels[counts < 2].tolist()
        raise ValueError(
            f"{fn}: group_ids has {len(lonely)} group(s) with a single sample (labels "
            f"{lonely[:5]}); the leave-one-out baseline needs at least 2 samples per group"
        )
    n = counts.to(scores.dtype)  # (G,)
    group_sum = _group_sum(scores, index, counts.shape[0])  # (G,)
    baseline = (group_sum[index] - scores) / (n[index] - 1)  # (B,) mean of the others
    return scores - baseline  # (B,)


def _batch_whiten(centred: Tensor, eps: float) -> Tensor:
    """``centred / (std over the batch + eps)``, the unbiased std (0 for a batch of one)."""
    std = centred.std() if centred.numel() > 1 else centred.new_zeros(())  # ()
    return centred / (std + eps)  # (B,)


@GROUP_ESTIMATORS.register(
    "reinforce_pp", "each score against the batch's mean and std (REINFORCE++)"
)
def reinforce_pp_advantages(scores: Tensor, *, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ outcome advantages (Hu 2025): no group baseline, the scores whitened over the
    whole batch, ``A_i = (r_i - mean(r)) / (std(r) + eps)``; ``group_ids`` is not read (the KL
    penalty, when wanted, is the update's ``kl_coef``)."""
    fn = "reinforce_pp_advantages"
    scores = _check_float(fn, "scores", scores)
    _check_b(fn, "scores", scores)
    _check_finite(fn, "scores", scores)
    return _batch_whiten(scores - scores.mean(), eps)


@GROUP_ESTIMATORS.register(
    "reinforce_pp_baseline", "each score against its group's mean, over the batch's std"
)
def reinforce_pp_baseline_advantages(
    scores: Tensor, *, group_ids: Tensor, eps: float = 1e-6
) -> Tensor:
    """REINFORCE++-baseline (Hu 2025, OpenRLHF's ``reinforce_baseline``): the group mean as the
    baseline, then one std over the whole batch, ``A_i = (r_i - mean(r_group)) / (std_batch + eps)``
    (a group's own std, as GRPO divides by, is not used: small groups make it noisy)."""
    centred = grpo_advantages(scores, group_ids=group_ids, normalize_std=False)  # (B,)
    return _batch_whiten(centred, eps)


def broadcast_to_tokens(per_sample: Tensor, mask: Tensor) -> Tensor:
    """Spread a per-sample value (e.g. a GRPO advantage) over the real tokens of its row.

    Args:
        per_sample: (B,) one value per sample.
        mask: (B, T) 1 on real tokens, 0 on padding.

    Returns:
        (B, T): ``per_sample[b]`` on the real tokens of row b, 0 at padding.
    """
    fn = "broadcast_to_tokens"
    per_sample = _check_float(fn, "per_sample", per_sample)
    mask = _check_tensor(fn, "mask", mask)
    B = _check_b(fn, "per_sample", per_sample)
    if mask.dim() != 2 or mask.shape[0] != B:
        raise ValueError(
            f"{fn}: per_sample has shape {tuple(per_sample.shape)} but mask has shape "
            f"{tuple(mask.shape)}; they must be (B,) and (B, T)"
        )
    real = _check_mask(fn, mask, mask.shape, "mask")  # (B, T) bool
    _check_finite(fn, "per_sample", per_sample, real.any(dim=1))
    return torch.where(real, per_sample[:, None], 0)  # (B, T)


# ---------------------------------------------------------------------------------------------
# KL to the reference policy
# ---------------------------------------------------------------------------------------------


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kind: KLEstimator = "k1"
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

    With ``log_ratio = log pi(y_t) - log pi_ref(y_t)``:

    - ``"k1"``: ``log_ratio`` (unbiased, can be negative; the usual PPO-RLHF reward penalty)
    - ``"k2"``: ``0.5 * log_ratio**2`` (biased, low variance)
    - ``"k3"``: ``exp(-log_ratio) - 1 + log_ratio`` (unbiased, always >= 0; GRPO's KL term)
    - ``"abs"``: ``|log_ratio|``

    Args:
        logprobs: (B, T) log-probs of the sampled tokens under the policy.
        ref_logprobs: (B, T) log-probs of the same tokens under the reference policy.
        mask: (B, T) 1 on real tokens, 0 on padding.
        kind: which estimator.

    Returns:
        (B, T) per-token KL estimate, 0 at padding.
    """
    fn = "kl_penalty"
    logprobs = _check_float(fn, "logprobs", logprobs)
    ref_logprobs = _check_float(fn, "ref_logprobs", ref_logprobs)
    _check_bt(fn, "logprobs", logprobs)
    _check_same_shape(fn, "logprobs", logprobs, "ref_logprobs", ref_logprobs, "(B, T)")
    real = _check_mask(fn, mask, logprobs.shape, "logprobs")  # (B, T) bool
    KL_ESTIMATORS.check(kind, f"{fn}: kind")
    _check_finite(fn, "logprobs", logprobs, real)
    _check_finite(fn, "ref_logprobs", ref_logprobs, real)
    return _kl_estimate(logprobs, ref_logprobs, real, kind)


@KL_ESTIMATORS.register("k1", "log_ratio: unbiased, can be negative")
def _k1(log_ratio: Tensor) -> Tensor:
    return log_ratio  # (B, T)


@KL_ESTIMATORS.register("k2", "0.5 * log_ratio**2: biased, low variance")
def _k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio**2  # (B, T)


@KL_ESTIMATORS.register("k3", "exp(-log_ratio) - 1 + log_ratio: unbiased, >= 0")
def _k3(log_ratio: Tensor) -> Tensor:
    return torch.exp(-log_ratio) - 1 + log_ratio  # (B, T) pi_ref/pi - 1 - log(pi_ref/pi)


@KL_ESTIMATORS.register("abs", "|log_ratio|")
def _abs(log_ratio: Tensor) -> Tensor:
    return log_ratio.abs()  # (B, T)


KLEstimator = KL_ESTIMATORS.literal()
"""The names of :data:`KL_ESTIMATORS`, as a type."""


def _kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, real: Tensor, kind: str) -> Tensor:
    """``kl_penalty`` without the checks (``real`` is a bool mask)."""
    log_ratio = torch.where(real, logprobs - ref_logprobs, 0)  # (B, T) log pi/pi_ref
    return torch.where(real, KL_ESTIMATORS[kind](log_ratio), 0)  # (B, T)


def apply_kl_to_rewards(rewards: Tensor, kl: Tensor, mask: Tensor, coef: float) -> Tensor:
    """KL-in-reward shaping: ``r_t = -coef * kl_t``, plus the sequence score on the last real token.

    Args:
        rewards: either (B,) one sequence score per sample, added on the last real token of
            its row, or (B, T) per-token rewards, added token by token.
        kl: (B, T) per-token KL estimate (e.g. ``kl_penalty(..., kind="k1")``).
        mask: (B, T) 1 on real tokens, 0 on padding.
        coef: KL coefficient (beta), >= 0.

    Returns:
        (B, T) shaped per-token rewards, 0 at padding (feed to ``compute_gae``).
    """
    fn = "apply_kl_to_rewards"
    rewards = _check_float(fn, "rewards", rewards)
    kl = _check_float(fn, "kl", kl)
    B, T = _check_bt(fn, "kl", kl)
    real = _check_mask(fn, mask, kl.shape, "kl")  # (B, T) bool
    _check_finite(fn, "kl", kl, real)
    if not coef >= 0.0:
        raise ValueError(f"{fn}: coef is {coef}; it must be >= 0")
    shaped = torch.where(real, -coef * kl, 0)  # (B, T)
    if rewards.dim() == 1:
        if rewards.shape[0] != B:
            raise ValueError(
                f"{fn}: rewards has shape {tuple(rewards.shape)} but kl has shape "
                f"{(B, T)}; sequence scores must be (B,) with the same B"
            )
        _check_finite(fn, "rewards", rewards)
        has_token = real.any(dim=1)  # (B,)
        if not bool(has_token.all()):
            empty = int((~has_token).nonzero()[0])
            raise ValueError(
                f"{fn}: sample {empty} has no real token in mask, so its score has no token "
                "to go on; drop empty responses before shaping"
            )
        positions = torch.arange(T, device=kl.device).expand(B, T)  # (B, T)
        last = torch.where(real, positions, -1).amax(dim=1)  # (B,) index of the last real token
        is_last = positions == last[:, None]  # (B, T)
        return shaped + torch.where(is_last, rewards[:, None], 0)  # (B, T)
    _check_same_shape(fn, "kl", kl, "rewards", rewards, "(B, T) (or rewards (B,))")
    _check_finite(fn, "rewards", rewards, real)
    return torch.where(real, shaped + rewards, 0)  # (B, T)
