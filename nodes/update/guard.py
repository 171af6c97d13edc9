"""The update's guard on its own steps: the trained weights checked after an optimizer step, and
a copy from before it to put back when the step made them (or what they compute) non-finite.

``trained`` is the update's list of ``(metric, what, parameters, optimizer)`` per model. A
parameter sharded by FSDP2 (a DTensor) is handled through this rank's shard, so the copy is
1/K of the model per rank and nothing waits on a collective but :func:`weights_finite`'s flag.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["copy_weights", "restore_weights", "weights_finite"]


def _shards(trained: Sequence[tuple[Any, ...]]) -> list[list[Tensor]]:
    """Each trained model's weights as plain tensors: this rank's shard of a DTensor."""
    return [
        [getattr(p, "_local_tensor", p).detach() for p in params] for _, _, params, _ in trained
    ]


def weights_finite(trained: Sequence[tuple[Any, ...]], ranks: Any = None) -> bool:
    """Whether every trained weight is finite (with a rank group: on every rank): one fused
    norm per model, not finite when a weight is not (or so large its square overflows)."""
    with torch.no_grad():
        bad = any(
            local and not bool(torch.stack(torch._foreach_norm(local)).isfinite().all())
            for local in _shards(trained)
        )
    return not (ranks.any_flag(bad) if ranks is not None else bad)


def copy_weights(
    trained: Sequence[tuple[Any, ...]], into: list[list[Tensor]] | None = None
) -> list[list[Tensor]]:
    """The trained weights as they are (into the buffers of an earlier copy, if given)."""
    with torch.no_grad():
        if into is None:
            return [[t.clone() for t in local] for local in _shards(trained)]
        for local, saved in zip(_shards(trained), into):
            torch._foreach_copy_(saved, local)
    return into


def restore_weights(trained: Sequence[tuple[Any, ...]], saved: list[list[Tensor]]) -> None:
    """Put a :func:`copy_weights` copy back into the trained weights."""
    with torch.no_grad():
        for local, copies in zip(_shards(trained), saved):
            torch._foreach_copy_(local, copies)
