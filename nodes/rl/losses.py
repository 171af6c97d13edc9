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

References:
    PPO: Schulman et al. 2017, "Proximal Policy Optimization Algorithms". Asymmetric clipping
    (``clip_eps_high``): Yu et al. 2025, "DAPO". GRPO: Shao et al. 2024, "DeepSeekMath".
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from nodes.rl.advantages import KLKind, _kl_estimate
from nodes.rl.masked import (
    _check_bt,
    _check_finite,
    _check_float,
    _check_mask,
    _check_real_count,
    _check_same_shape,
    _check_tensor,
)

__all__ = [
    "Aggregation",
    "aggregate_token_loss",
    "logprobs_from_logits",
    "token_entropy_from_logits",
    "entropy_from_logits",
    "ppo_policy_loss",
    "value_loss",
    "kl_loss",
    "grpo_loss",
]

Aggregation = Literal["token-mean", "seq-mean-token-mean"]


# ---------------------------------------------------------------------------------------------
# aggregation and shared checks
# ---------------------------------------------------------------------------------------------


def _aggregate(fn: str, token_loss: Tensor, real: Tensor, aggregation: str) -> Tensor:
    """``aggregate_token_loss`` without the shape checks (``real`` is a bool mask)."""
    token_loss = torch.where(real, token_loss, 0)  # (B, T) padding -> 0
    if aggregation == "token-mean":
        _check_real_count(fn, real)
        return token_loss.sum() / real.sum().to(token_loss.dtype)  # ()
    if aggregation == "seq-mean-token-mean":
        _check_real_count(fn, real)
        tokens_per_seq = real.sum(dim=1).to(token_loss.dtype)  # (B,)
        seq_loss = token_loss.sum(dim=1) / tokens_per_seq.clamp(min=1)  # (B,)
        n_seqs = (tokens_per_seq > 0).sum().to(token_loss.dtype)  # ()
        return seq_loss.sum() / n_seqs  # () empty rows add 0 and are not counted
    raise ValueError(
        f"{fn}: aggregation is {aggregation!r}; it must be 'token-mean' or 'seq-mean-token-mean'"
    )


def aggregate_token_loss(
    token_loss: Tensor, mask: Tensor, aggregation: Aggregation = "token-mean"
) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar, ignoring padding exactly.

    Args:
        token_loss: (B, T) per-token loss.
        mask: (B, T) 1 on real tokens, 0 on padding.
        aggregation: ``"token-mean"`` or ``"seq-mean-token-mean"`` (see the module docstring).

    Returns:
        A 0-d tensor.
    """
    fn = "aggregate_token_loss"
    token_loss = _check_float(fn, "token_loss", token_loss)
    _check_bt(fn, "token_loss", token_loss)
    real = _check_mask(fn, mask, token_loss.shape, "token_loss")  # (B, T) bool
    return _aggregate(fn, token_loss, real, aggregation)


def _check_token_tensors(fn: str, mask: Tensor, **tensors: Tensor) -> Tensor:
    """Check that every tensor is a finite (on real tokens) (B, T) float like the first one.

    Returns the mask as bool (B, T).
    """
    (ref_name, ref), *rest = tensors.items()
    ref = _check_float(fn, ref_name, ref)
    _check_bt(fn, ref_name, ref)
    for name, x in rest:
        _check_float(fn, name, x)
        _check_same_shape(fn, ref_name, ref, name, x, "(B, T)")
    real = _check_mask(fn, mask, ref.shape, ref_name)  # (B, T) bool
    for name, x in tensors.items():
        _check_finite(fn, name, x, real)
    return real


def _clip_range(fn: str, clip_eps: float, clip_eps_high: float | None) -> tuple[float, float]:
    eps_low = clip_eps
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if not 0.0 < eps_low < 1.0:
        raise ValueError(f"{fn}: clip_eps is {clip_eps}; it must be in (0, 1)")
    if not eps_high > 0.0:
        raise ValueError(f"{fn}: clip_eps_high is {clip_eps_high}; it must be > 0")
    return eps_low, eps_high


def _clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    real: Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO clipped surrogate loss (B, T) and its stats (inputs already checked)."""
    log_ratio = torch.where(real, logprobs - old_logprobs, 0)  # (B, T) log pi/pi_old
    advantages = torch.where(real, advantages, 0)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    pg_loss_unclipped = -advantages * ratio  # (B, T)
    pg_loss_clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)  # (B, T)
    token_loss = torch.maximum(pg_loss_unclipped, pg_loss_clipped)  # (B, T) pessimistic bound
    with torch.no_grad():
        n = real.sum().to(ratio.dtype)  # ()
        # the clipped branch wins exactly where the token's gradient is cut off
        clipped = (pg_loss_clipped > pg_loss_unclipped) & real  # (B, T)
        approx_kl = torch.where(real, ratio - 1 - log_ratio, 0)  # (B, T) k3 of KL(pi_old || pi)
        stats = {
            "clip_fraction": clipped.sum().to(ratio.dtype) / n,
            "approx_kl": approx_kl.sum() / n,
            "ratio_mean": torch.where(real, ratio, 0).sum() / n,
        }
    return token_loss, stats


# ---------------------------------------------------------------------------------------------
# log-probs and entropy from logits
# ---------------------------------------------------------------------------------------------


def _upcast(logits: Tensor) -> Tensor:
    # half/bfloat16 log-softmax loses too much precision; float32 and float64 stay as they are
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def logprobs_from_logits(logits: Tensor, token_ids: Tensor, mask: Tensor | None = None) -> Tensor:
    """Log-probability of each chosen token: ``log_softmax(logits)[b, t, token_ids[b, t]]``.

    Computed as ``logits[token] - logsumexp(logits)``, which equals the gather of
    ``log_softmax`` without materializing a second (B, T, V) tensor.

    Args:
        logits: (B, T, V) next-token logits, aligned with ``token_ids`` (logits[:, t] scores
            token_ids[:, t]). float16/bfloat16 are computed in float32.
        token_ids: (B, T) integer token ids in [0, V).
        mask: optional (B, T); where it is 0, ``token_ids`` may hold anything (e.g. -100) and
            ``logits`` may hold NaN: the result there is 0 and no gradient flows.

    Returns:
        (B, T) log-probs (float32, or float64 for float64 logits).
    """
    fn = "logprobs_from_logits"
    logits = _check_float(fn, "logits", logits)
    token_ids = _check_tensor(fn, "token_ids", token_ids)
    if logits.dim() != 3 or logits.shape[0] == 0 or logits.shape[1] == 0 or logits.shape[2] == 0:
        raise ValueError(
            f"{fn}: logits has shape {tuple(logits.shape)}; it must be non-empty (B, T, V)"
        )
    if token_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"{fn}: logits has shape {tuple(logits.shape)} but token_ids has shape "
            f"{tuple(token_ids.shape)}; they must be (B, T, V) and (B, T)"
        )
    if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
        raise ValueError(f"{fn}: token_ids has dtype {token_ids.dtype}; it must be integer")
    V = logits.shape[2]
    if mask is not None:
        real = _check_mask(fn, mask, token_ids.shape, "token_ids")  # (B, T) bool
        logits = torch.where(real[..., None], logits, 0)  # (B, T, V) padding -> 0
        token_ids = torch.where(real, token_ids, 0)  # (B, T)
    out_of_range = (token_ids < 0) | (token_ids >= V)  # (B, T)
    if bool(out_of_range.any()):
        b, t = out_of_range.nonzero()[0].tolist()
        raise ValueError(
            f"{fn}: token_ids[{b}, {t}] is {int(token_ids[b, t])}, outside the vocabulary "
            f"[0, {V}) of logits; mask padding out with mask="
        )
    logits = _upcast(logits)  # (B, T, V)
    chosen = torch.gather(logits, -1, token_ids[..., None].long()).squeeze(-1)  # (B, T)
    logprobs = chosen - torch.logsumexp(logits, dim=-1)  # (B, T)
    if mask is not None:
        logprobs = torch.where(real, logprobs, 0)  # (B, T)
    return logprobs


def token_entropy_from_logits(logits: Tensor, mask: Tensor) -> Tensor:
    """Per-token entropy of the next-token distribution, ``-sum_v p_v log p_v``.

    Args:
        logits: (B, T, V) next-token logits.
        mask: (B, T) 1 on real tokens, 0 on padding.

    Returns:
        (B, T) entropy in nats, 0 at padding.
    """
    fn = "token_entropy_from_logits"
    return _token_entropy(fn, logits, mask)[0]


def _token_entropy(fn: str, logits: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    logits = _check_float(fn, "logits", logits)
    if logits.dim() != 3 or 0 in logits.shape:
        raise ValueError(
            f"{fn}: logits has shape {tuple(logits.shape)}; it must be non-empty (B, T, V)"
        )
    mask = _check_tensor(fn, "mask", mask)
    if mask.shape != logits.shape[:2]:
        raise ValueError(
            f"{fn}: logits has shape {tuple(logits.shape)} but mask has shape "
            f"{tuple(mask.shape)}; they must be (B, T, V) and (B, T)"
        )
    real = _check_mask(fn, mask, mask.shape, "mask")  # (B, T) bool
    logits = _upcast(torch.where(real[..., None], logits, 0))  # (B, T, V) padding -> 0
    # vocabulary entries masked with -inf: a finite floor keeps 0 * log 0 = 0 and grads finite
    logits = logits.clamp(min=torch.finfo(logits.dtype).min)  # (B, T, V)
    log_p = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)  # (B, T)
    return torch.where(real, entropy, 0), real  # (B, T), (B, T)


def entropy_from_logits(logits: Tensor, mask: Tensor) -> Tensor:
    """Masked token-mean entropy of the policy (a bonus term: subtract ``coef * entropy``).

    Args:
        logits: (B, T, V) next-token logits.
        mask: (B, T) 1 on real tokens, 0 on padding.

    Returns:
        A 0-d tensor: mean entropy in nats over real tokens.
    """
    fn = "entropy_from_logits"
    entropy, real = _token_entropy(fn, logits, mask)  # (B, T), (B, T)
    return _aggregate(fn, entropy, real, "token-mean")  # ()


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
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss.

    ``ratio = exp(logprobs - old_logprobs)``;
    ``loss = mean_t max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))``.

    Args:
        logprobs: (B, T) log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs: (B, T) log-probs under the policy that sampled them.
        advantages: (B, T) per-token advantages (e.g. from ``compute_gae``).
        mask: (B, T) 1 on real tokens, 0 on padding.
        clip_eps: clip range below 1 (and above 1 unless ``clip_eps_high`` is given).
        clip_eps_high: clip range above 1 (DAPO's "clip-higher"); None = ``clip_eps``.
        aggregation: ``"token-mean"`` (default) or ``"seq-mean-token-mean"``.

    Returns:
        ``(loss, stats)``: a 0-d loss, and detached 0-d stats ``clip_fraction`` (fraction of
        real tokens where the clipped term is the larger one, i.e. whose gradient is cut off),
        ``approx_kl`` (mean k3 estimate of KL(pi_old || pi)) and ``ratio_mean``.
    """
    fn = "ppo_policy_loss"
    real = _check_token_tensors(
        fn, mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages
    )
    eps_low, eps_high = _clip_range(fn, clip_eps, clip_eps_high)
    token_loss, stats = _clipped_surrogate(
        logprobs, old_logprobs, advantages, real, eps_low, eps_high
    )  # (B, T)
    return _aggregate(fn, token_loss, real, aggregation), stats


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
    return _aggregate(fn, token_loss, real, "token-mean"), stats


# ---------------------------------------------------------------------------------------------
# KL to the reference, and GRPO
# ---------------------------------------------------------------------------------------------


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kind: KLKind = "k3",
    *,
    aggregation: Aggregation = "token-mean",
) -> Tensor:
    """KL(pi || pi_ref) as a loss term (add ``beta * kl_loss``), from tokens sampled from pi.

    Args:
        logprobs: (B, T) log-probs under the current policy (with grad).
        ref_logprobs: (B, T) log-probs under the frozen reference policy.
        mask: (B, T) 1 on real tokens, 0 on padding.
        kind: estimator, see ``nodes.rl.advantages.kl_penalty``; ``"k3"`` is unbiased and >= 0.
        aggregation: ``"token-mean"`` (default) or ``"seq-mean-token-mean"``.

    Returns:
        A 0-d tensor.
    """
    fn = "kl_loss"
    real = _check_token_tensors(fn, mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    if kind not in ("k1", "k2", "k3", "abs"):
        raise ValueError(f"{fn}: kind is {kind!r}; it must be one of 'k1', 'k2', 'k3', 'abs'")
    kl = _kl_estimate(logprobs, ref_logprobs, real, kind)  # (B, T)
    return _aggregate(fn, kl, real, aggregation)


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
        aggregation: ``"seq-mean-token-mean"`` (default) or ``"token-mean"``.

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
    )
    eps_low, eps_high = _clip_range(fn, clip_eps, clip_eps_high)
    pg_token_loss, stats = _clipped_surrogate(
        logprobs, old_logprobs, advantages, real, eps_low, eps_high
    )  # (B, T)
    kl_token = _kl_estimate(logprobs, ref_logprobs, real, "k3")  # (B, T)
    pg_loss = _aggregate(fn, pg_token_loss, real, aggregation)  # ()
    ref_kl = _aggregate(fn, kl_token, real, aggregation)  # ()
    stats["pg_loss"] = pg_loss.detach()
    stats["ref_kl"] = ref_kl.detach()
    return pg_loss + beta * ref_kl, stats
