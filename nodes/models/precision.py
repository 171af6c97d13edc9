"""Mixed precision of the model nodes' forward passes, and which devices do bf16 in hardware.

``"bf16"`` is mixed precision done the standard way: the weights (and a trained model's AdamW
state) stay in their own dtype (float32: the master copy), the forward passes run under
``torch.autocast`` in bfloat16, and log-softmaxes of logits are taken in float32. ``"no"``
computes in the weights' dtype (pure bfloat16 with ``dtype=bfloat16``). The update's forwards
and backwards, the rollout's sampling and the reference's scoring take it alike, so the
sampler's logprobs and the trainer's come from the same arithmetic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["PRECISIONS", "autocast", "check_precision", "native_bf16"]

PRECISIONS = ("no", "bf16")
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""The x86 CPU flags (Linux ``/proc/cpuinfo``) of bfloat16 dot products in hardware."""


def check_precision(precision: str, where: str) -> str:
    """``precision``, or a ValueError naming ``where``, the value and the choices."""
    if precision not in PRECISIONS:
        raise ValueError(f"{where}: precision={precision!r}; choose one of {', '.join(PRECISIONS)}")
    return precision


def native_bf16(device: str, cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether ``device`` (``"cpu"`` or ``"cuda"``) does bfloat16 matrix math in hardware: a
    CUDA GPU that supports it, or a CPU with AVX512-BF16 or AMX-BF16. Without them bf16 is
    emulated (a CPU's oneDNN converts to float32) and no faster than float32."""
    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        with open(cpuinfo) as f:
            flags = next(
                (line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []
            )
    except OSError:
        return False
    return any(flag in flags for flag in CPU_BF16_FLAGS)


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """Forward passes on ``device`` in ``precision`` (see the module doc)."""
    if precision == "bf16":
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            yield
    else:
        yield
