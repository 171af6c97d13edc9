"""Log-probs and entropy of tokens from logits, with padding never read.

The conventions are those of :mod:`nodes.rl.losses`, which re-exports these functions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nodes.rl.aggregate import _aggregate
from nodes.rl.masked import (
    _check_float,
    _check_mask,
    _check_tensor,
)

__all__ = ["entropy_from_logits", "logprobs_from_logits", "token_entropy_from_logits"]

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
