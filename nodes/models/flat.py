"""Tensors laid out in one flat ``uint8`` buffer, each a view of it at an aligned offset: the
offloaded state's host buffer (:mod:`nodes.models.offload`) and the vLLM engine's staging
bucket (:mod:`nodes.models.vllm_ipc`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["aligned", "layout", "nbytes", "view"]


def nbytes(t: Tensor) -> int:
    """The bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def aligned(offset: int, align: int) -> int:
    """``offset`` rounded up to a multiple of ``align``."""
    return -(-offset // align) * align


def layout(tensors: Sequence[Tensor], align: int) -> tuple[list[int], int]:
    """Each tensor's offset in one buffer, in order, each a multiple of ``align``, and the
    bytes the buffer needs."""
    offsets, end = [], 0
    for t in tensors:
        end = aligned(end, align)
        offsets.append(end)
        end += nbytes(t)
    return offsets, end


def view(flat: Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> Tensor:
    """The ``dtype`` tensor of ``shape`` at byte ``offset`` of ``flat`` (a view of it)."""
    size = math.prod(shape) * dtype.itemsize
    return flat[offset : offset + size].view(dtype).view(tuple(shape))
