"""Masked reductions over padded (B, T) token tensors, and the input checks shared by the RL math.

A *mask* marks real tokens with 1 (or True) and padding with 0 (or False). Every function here
reads a tensor only where the mask is 1: padding may hold anything, NaN and inf included, and it
never reaches a result or a gradient (masked entries are replaced with 0 by ``torch.where``
before any arithmetic, so their gradient is exactly 0).

The ``_check_*`` helpers raise ``ValueError`` messages of the form
``"<function>: <argument> <what is wrong>; <what it must be>"`` and are used by
``nodes.rl.advantages`` and ``nodes.rl.losses``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten"]


# ---------------------------------------------------------------------------------------------
# input checks (private, shared by nodes.rl.advantages and nodes.rl.losses)
# ---------------------------------------------------------------------------------------------


def _shape(x: Tensor) -> str:
    return str(tuple(x.shape))


def _check_tensor(fn: str, name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _check_float(fn: str, name: str, x: object) -> Tensor:
    x = _check_tensor(fn, name, x)
    if not x.is_floating_point():
        raise ValueError(f"{fn}: {name} has dtype {x.dtype}; it must be a floating-point tensor")
    return x


def _check_bt(fn: str, name: str, x: Tensor) -> tuple[int, int]:
    """Check that ``x`` is a non-empty (B, T) tensor and return (B, T)."""
    if x.dim() != 2:
        raise ValueError(f"{fn}: {name} has shape {_shape(x)}; it must be 2-D (B, T)")
    B, T = x.shape
    if B == 0 or T == 0:
        raise ValueError(
            f"{fn}: {name} is empty (shape {_shape(x)}); need at least one sample and one token"
        )
    return B, T


def _check_b(fn: str, name: str, x: Tensor) -> int:
    """Check that ``x`` is a non-empty (B,) tensor and return B."""
    if x.dim() != 1:
        raise ValueError(f"{fn}: {name} has shape {_shape(x)}; it must be 1-D (B,)")
    if x.shape[0] == 0:
        raise ValueError(f"{fn}: {name} is empty (shape {_shape(x)}); need at least one sample")
    return x.shape[0]


def _check_same_shape(fn: str, ref_name: str, ref: Tensor, name: str, x: Tensor, dims: str) -> None:
    if x.shape != ref.shape:
        raise ValueError(
            f"{fn}: {ref_name} has shape {_shape(ref)} but {name} has shape {_shape(x)}; "
            f"both must be {dims}"
        )


def _check_mask(fn: str, mask: object, shape: torch.Size, ref_name: str) -> Tensor:
    """Return ``mask`` as a bool tensor after checking its shape and that it holds only 0/1."""
    mask = _check_tensor(fn, "mask", mask)
    if mask.shape != shape:
        raise ValueError(
            f"{fn}: {ref_name} has shape {str(tuple(shape))} but mask has shape {_shape(mask)}; "
            "both must be (B, T)"
        )
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(
            f"{fn}: mask must hold only 0 and 1 (1 = real token, 0 = padding); "
            f"got dtype {mask.dtype} with other values"
        )
    return mask != 0


def _check_finite(fn: str, name: str, x: Tensor, mask: Tensor | None = None) -> None:
    """Refuse NaN/inf in ``x`` where ``mask`` is True (everywhere if ``mask`` is None)."""
    bad = ~torch.isfinite(x)  # same shape as x
    if mask is not None:
        bad = bad & mask
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()  # first offending index
        value = x[tuple(where)].item()
        if x.dim() == 1:
            at = f"sample {where[0]}"
        elif x.dim() == 2:
            at = f"sample {where[0]}, token {where[1]}"
        else:
            at = f"index {tuple(where)}"
        scope = " on real (mask=1) tokens" if mask is not None else ""
        raise ValueError(
            f"{fn}: {name} has a non-finite value ({value}) at {at} "
            f"({int(bad.sum())} non-finite in all); {name} must be finite{scope}"
        )


def _check_real_count(fn: str, mask: Tensor, at_least: int = 1) -> None:
    n = int(mask.sum())
    if n < at_least:
        raise ValueError(f"{fn}: mask has {n} real (mask=1) token(s); need at least {at_least}")


# ---------------------------------------------------------------------------------------------
# masked reductions
# ---------------------------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over entries where ``mask`` is 1.

    Args:
        x: any shape, e.g. (B, T).
        mask: same shape as ``x``; 1 = real, 0 = padding (bool or 0/1 numbers).
        dim: reduce over this dim only (e.g. ``-1`` for a per-row sum (B,)); all dims if None.

    Returns:
        A 0-d tensor, or ``x`` reduced over ``dim``.
    """
    x = _check_float("masked_sum", "x", x)
    mask = _check_mask("masked_sum", mask, x.shape, "x")
    x = torch.where(mask, x, 0)  # same shape as x; padding -> 0 so NaN/inf there cannot leak
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over entries where ``mask`` is 1 (padding is ignored exactly).

    Args:
        x: any shape, e.g. (B, T).
        mask: same shape as ``x``; 1 = real, 0 = padding.
        dim: reduce over this dim only (e.g. ``-1`` for a per-row mean (B,)); all dims if None.
            A slice with no real entry has mean 0.

    Returns:
        A 0-d tensor (``dim=None``), or ``x`` reduced over ``dim``.

    Raises:
        ValueError: with ``dim=None`` and no real entry at all (the mean is undefined).
    """
    x = _check_float("masked_mean", "x", x)
    mask = _check_mask("masked_mean", mask, x.shape, "x")
    x = torch.where(mask, x, 0)  # same shape as x; padding -> 0
    if dim is None:
        _check_real_count("masked_mean", mask)
        return x.sum() / mask.sum().to(x.dtype)  # ()
    count = mask.sum(dim).to(x.dtype)  # x.shape without dim
    return x.sum(dim) / count.clamp(min=1)  # x.shape without dim; empty slice -> 0


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all entries where ``mask`` is 1.

    Args:
        x: any shape, e.g. (B, T).
        mask: same shape as ``x``; 1 = real, 0 = padding.
        unbiased: divide by n - 1 (Bessel's correction) instead of n.

    Returns:
        A 0-d tensor.

    Raises:
        ValueError: fewer than 2 real entries with ``unbiased=True`` (fewer than 1 otherwise).
    """
    x = _check_float("masked_var", "x", x)
    mask = _check_mask("masked_var", mask, x.shape, "x")
    _check_real_count("masked_var", mask, at_least=2 if unbiased else 1)
    n = mask.sum().to(x.dtype)  # ()
    x = torch.where(mask, x, 0)  # same shape as x; padding -> 0
    mean = x.sum() / n  # ()
    sq_dev = torch.where(mask, (x - mean) ** 2, 0)  # same shape as x
    return sq_dev.sum() / (n - 1 if unbiased else n)  # ()


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalize ``x`` to unit variance (and zero mean) using statistics of real entries only.

    ``(x - mean) / sqrt(var + eps)``, with the unbiased masked variance; with
    ``shift_mean=False`` the mean is added back (only the scale changes).

    Args:
        x: any shape, e.g. advantages (B, T).
        mask: same shape as ``x``; 1 = real, 0 = padding.
        shift_mean: keep the result centred at 0 (True) or at the original mean (False).
        eps: added to the variance before the square root.

    Returns:
        Same shape as ``x``; 0 at padding.
    """
    x = _check_float("masked_whiten", "x", x)
    mask = _check_mask("masked_whiten", mask, x.shape, "x")
    _check_real_count("masked_whiten", mask, at_least=2)
    x = torch.where(mask, x, 0)  # same shape as x; padding -> 0
    mean = masked_mean(x, mask)  # ()
    var = masked_var(x, mask)  # ()
    whitened = (x - mean) * torch.rsqrt(var + eps)  # same shape as x
    if not shift_mean:
        whitened = whitened + mean  # same shape as x
    return torch.where(mask, whitened, 0)  # same shape as x
