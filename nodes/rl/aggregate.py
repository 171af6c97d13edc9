"""Reducing per-token losses to a scalar, and the checks the loss functions share.

The conventions and the aggregations are described in :mod:`nodes.rl.losses`, which
re-exports :func:`aggregate_token_loss`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from nodes.registry import Registry
from nodes.rl.masked import (
    _check_bt,
    _check_finite,
    _check_float,
    _check_mask,
    _check_real_count,
    _check_same_shape,
)

__all__ = ["AGGREGATIONS", "Aggregation", "TokenMean", "aggregate_token_loss"]


class TokenMean(NamedTuple):
    """A mean of a per-token loss: ``total(token_loss, real) / count(real)``. Written so, a
    batch cut into micro-batches gets the whole batch's value exactly as the sum of each
    micro-batch's value weighted by its share of ``count`` (what the updates accumulate)."""

    total: Callable[[Tensor, Tensor], Tensor]
    """(B, T) loss, zero at padding, and bool (B, T) real tokens -> () what is averaged, summed."""
    count: Callable[[Tensor, int], Tensor]
    """bool (B, T) real tokens and the horizon (a constant token count, for
    ``seq-mean-token-sum-norm``) -> () what it is averaged over."""


AGGREGATIONS: Registry[TokenMean] = Registry("loss aggregation")
"""How the losses reduce a per-token loss to a scalar (``aggregation=``)."""

AGGREGATIONS.register("token-mean", "every real token of the batch weighs the same")(
    TokenMean(
        total=lambda loss, real: loss.sum(),  # ()
        count=lambda real, horizon: real.sum(),  # () real tokens
    )
)
AGGREGATIONS.register("seq-mean-token-mean", "the mean per sequence, then over sequences")(
    TokenMean(
        total=lambda loss, real: (loss.sum(1) / real.sum(1).clamp(min=1)).sum(),  # ()
        count=lambda real, horizon: real.any(1).sum(),  # () sequences with a real token
    )
)
AGGREGATIONS.register("seq-mean-token-sum", "the sum per sequence, then the mean over sequences")(
    TokenMean(
        total=lambda loss, real: loss.sum(),  # ()
        count=lambda real, horizon: real.any(1).sum(),  # () sequences with a real token
    )
)

AGGREGATIONS.register(
    "seq-mean-token-sum-norm",
    "Dr.GRPO's constant normaliser: the sum per sequence over a fixed horizon of tokens "
    "(the generation budget), then the mean over sequences",
)(
    TokenMean(
        total=lambda loss, real: loss.sum(),  # ()
        count=lambda real, horizon: real.any(1).sum() * horizon,  # () sequences x horizon
    )
)

Aggregation = AGGREGATIONS.literal()
"""The names of :data:`AGGREGATIONS`, as a type."""

# ---------------------------------------------------------------------------------------------
# aggregation and shared checks
# ---------------------------------------------------------------------------------------------


def _aggregate(
    fn: str, token_loss: Tensor, real: Tensor, aggregation: str, horizon: int | None = None
) -> Tensor:
    """``aggregate_token_loss`` without the shape checks (``real`` is a bool mask)."""
    mean = AGGREGATIONS[AGGREGATIONS.check(aggregation, f"{fn}: aggregation")]
    _check_real_count(fn, real)
    token_loss = torch.where(real, token_loss, 0)  # (B, T) padding -> 0
    count = mean.count(real, _horizon(fn, real, horizon))  # ()
    return mean.total(token_loss, real) / count.to(token_loss.dtype)  # ()


def _horizon(fn: str, real: Tensor, horizon: int | None) -> int:
    """The constant token count of a normalised aggregation: ``horizon``, or the mask's width
    T when None; it is refused below the longest real response (a sequence would weigh more
    than 1)."""
    width = int(real.shape[1])
    if horizon is None:
        return width
    longest = int(real.sum(1).max()) if real.numel() else 0
    if not isinstance(horizon, int) or isinstance(horizon, bool) or horizon < max(longest, 1):
        raise ValueError(
            f"{fn}: horizon is {horizon!r}; it must be an int >= the longest response "
            f"({longest} tokens): the generation budget, max_new_tokens"
        )
    return horizon


def aggregate_token_loss(
    token_loss: Tensor,
    mask: Tensor,
    aggregation: Aggregation = "token-mean",
    *,
    horizon: int | None = None,
) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar, ignoring padding exactly.

    Args:
        token_loss: (B, T) per-token loss.
        mask: (B, T) 1 on real tokens, 0 on padding.
        aggregation: a registered aggregation (see the module docstring of
            :mod:`nodes.rl.losses`).
        horizon: the constant token count of ``"seq-mean-token-sum-norm"`` (Dr.GRPO: the
            generation budget); None: the width T.

    Returns:
        A 0-d tensor.
    """
    fn = "aggregate_token_loss"
    token_loss = _check_float(fn, "token_loss", token_loss)
    _check_bt(fn, "token_loss", token_loss)
    real = _check_mask(fn, mask, token_loss.shape, "token_loss")  # (B, T) bool
    return _aggregate(fn, token_loss, real, aggregation, horizon)


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


def _check_dual_clip(fn: str, dual_clip: float | None) -> None:
    if dual_clip is not None and not (dual_clip > 1.0 and math.isfinite(dual_clip)):
        raise ValueError(
            f"{fn}: dual_clip is {dual_clip}; it must be a finite number > 1 (or None)"
        )


def _clip_range(fn: str, clip_eps: float, clip_eps_high: float | None) -> tuple[float, float]:
    eps_low = clip_eps
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if not 0.0 < eps_low < 1.0:
        raise ValueError(f"{fn}: clip_eps is {clip_eps}; it must be in (0, 1)")
    if not eps_high > 0.0:
        raise ValueError(f"{fn}: clip_eps_high is {clip_eps_high}; it must be > 0")
    return eps_low, eps_high
