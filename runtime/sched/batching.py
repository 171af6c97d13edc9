"""Fuse, split and partition batches: the pure functions under the batching scheduler.

A *batch* (:data:`Batch`) is a ``dict`` from port name to value, in the form nodes take: the
project's one batch type. A value is
*batched* when it has one entry per sample along its first axis: a ``torch.Tensor``
(``[B, ...]``) or a ``list``/``tuple`` of length B. Anything else (``None``, a number, a
weight-sync state dict) is *shared*: carried unchanged into every part and required to be
the same object (or equal) when batches are fused. A port may also be named shared
explicitly, for a tensor whose first axis is not the batch axis.

* :func:`fuse`: many requests become one batch (with each request's span).
* :func:`split` / :func:`merge`: one batch is cut into pieces by index lists and the
  results are put back in the original order with the inverse permutation (as verl's
  ``seqlen_balancing`` does).
* :func:`cut_pieces`: how many parts a budget needs, balanced by
  :func:`yatt_graph.partition.partition` (Karmarkar-Karp or LPT).
* :func:`default_costs`: tokens for text, images for encoders, else one per sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from yatt_graph.partition import partition

__all__ = [
    "Batch",
    "CostFn",
    "batch_size",
    "concat",
    "default_costs",
    "fuse",
    "inverse_permutation",
    "join_outputs",
    "merge",
    "cut_pieces",
    "sample_costs",
    "split",
    "take",
]

Batch = dict[str, Any]
CostFn = Callable[[Mapping[str, Any]], Sequence[float]]
"""Per-sample cost estimate of a batch: one non-negative number per sample."""

_MASK_PORTS = ("prompt_mask", "response_mask", "attention_mask")


def _is_batched(value: Any) -> bool:
    return isinstance(value, torch.Tensor | list | tuple) and not (
        isinstance(value, torch.Tensor) and value.dim() == 0
    )


def batch_size(batch: Mapping[str, Any], shared: Collection[str] = (), where: str = "batch") -> int:
    """The number of samples B, read from the batched values; all of them must agree.

    Raises ValueError naming the port when two batched values disagree, and when there is
    no batched value at all (a batch of only shared values has no size).
    """
    size, first = None, None
    for port, value in batch.items():
        if port in shared or not _is_batched(value):
            continue
        n = len(value)
        if size is None:
            size, first = n, port
        elif n != size:
            raise ValueError(
                f"{where}: port {port!r} has {n} samples but {first!r} has {size}; every "
                "batched value (tensor dim 0, list length) must have one entry per sample "
                "(name the port in shared= if its first axis is not the batch axis)"
            )
    if size is None:
        raise ValueError(
            f"{where}: no batched value (tensor or list) among ports {sorted(batch)}; "
            "cannot tell how many samples it holds"
        )
    return size


def take(batch: Mapping[str, Any], index: Sequence[int], shared: Collection[str] = ()) -> Batch:
    """The samples at ``index`` (in that order); shared values are carried as they are."""
    out: Batch = {}
    idx_t: torch.Tensor | None = None
    for port, value in batch.items():
        if port in shared or not _is_batched(value):
            out[port] = value
        elif isinstance(value, torch.Tensor):
            if idx_t is None:
                idx_t = torch.as_tensor(list(index), dtype=torch.long)  # [n]
            out[port] = value.index_select(0, idx_t.to(value.device))  # [n, ...]
        else:
            out[port] = (
                type(value)(value[i] for i in index)
                if isinstance(value, tuple)
                else [value[i] for i in index]
            )
    return out


def _pad_to(t: torch.Tensor, shape: Sequence[int], value: float, left: bool) -> torch.Tensor:
    if tuple(t.shape[1:]) == tuple(shape):
        return t
    pad: list[int] = []
    # F.pad lists the last dim first: (left, right) pairs from the last axis backwards.
    for have, want in zip(reversed(t.shape[1:]), reversed(shape)):
        pad += [want - have, 0] if left else [0, want - have]
    return torch.nn.functional.pad(t, pad, value=value)


def concat(
    parts: Sequence[Mapping[str, Any]],
    shared: Collection[str] = (),
    pad_values: Mapping[str, float] | None = None,
    left_pad: Collection[str] = (),
    where: str = "fuse",
) -> Batch:
    """Concatenate batches along the sample axis.

    Tensors whose trailing dims differ (ragged ``response_ids: [B, R]``) are padded to the
    largest size: on the right with ``pad_values.get(port, 0)``, or on the left for ports in
    ``left_pad`` (``prompt_ids``, ``prompt_mask``, which this project left-pads). Parts on
    different devices (a node's own on its GPU, a replica's through host memory) are joined on
    the first part's.
    """
    if not parts:
        raise ValueError(f"{where}: nothing to concatenate (no parts)")
    ports = list(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if set(part) != set(ports):
            raise ValueError(
                f"{where}: part {i} has ports {sorted(part)} but part 0 has {sorted(ports)}; "
                "fused requests must carry the same ports"
            )
    pad_values = pad_values or {}
    out: Batch = {}
    for port in ports:
        values = [p[port] for p in parts]
        first = values[0]
        if port in shared or not _is_batched(first):
            for v in values[1:]:
                if v is not first and not _same_shared(v, first):
                    raise ValueError(
                        f"{where}: shared port {port!r} differs between fused requests; "
                        "a non-batched value must be the same for every request in a batch "
                        "(send it per sample as a list, or do not fuse these requests)"
                    )
            out[port] = first
        elif isinstance(first, torch.Tensor):
            if any(not isinstance(v, torch.Tensor) or v.dim() != first.dim() for v in values):
                raise ValueError(
                    f"{where}: port {port!r} mixes tensors of rank {first.dim()} with other "
                    "values; fused requests must agree on each port's type and rank"
                )
            widths = [max(v.shape[d] for v in values) for d in range(1, first.dim())]
            value = pad_values.get(port, 0)
            padded = [_pad_to(v, widths, value, port in left_pad).to(first.device) for v in values]
            out[port] = torch.cat(padded, 0)  # [sum B_i, *max trailing]
        else:
            out[port] = [x for v in values for x in v]
    return out


def _same_shared(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # tensors in dicts compare elementwise; treat those as different
        return False


def fuse(
    requests: Sequence[Mapping[str, Any]],
    shared: Collection[str] = (),
    pad_values: Mapping[str, float] | None = None,
    left_pad: Collection[str] = (),
) -> tuple[Batch, list[tuple[int, int]]]:
    """Merge requests into one batch; return it with each request's ``(start, stop)`` span."""
    spans, start = [], 0
    for i, req in enumerate(requests):
        n = batch_size(req, shared, where=f"fuse: request {i}")
        spans.append((start, start + n))
        start += n
    return concat(requests, shared, pad_values, left_pad), spans


def split(
    batch: Mapping[str, Any], parts: Sequence[Sequence[int]], shared: Collection[str] = ()
) -> list[Batch]:
    """Micro-batches of ``batch``: one per index list in ``parts``."""
    return [take(batch, p, shared) for p in parts]


def inverse_permutation(perm: Sequence[int]) -> list[int]:
    """``inv`` with ``inv[perm[i]] == i``: where each original sample ended up."""
    inv = [-1] * len(perm)
    for i, p in enumerate(perm):
        if not 0 <= p < len(perm) or inv[p] != -1:
            raise ValueError(f"not a permutation of 0..{len(perm) - 1}: {list(perm)}")
        inv[p] = i
    return inv


def merge(
    outputs: Sequence[Mapping[str, Any]],
    parts: Sequence[Sequence[int]],
    shared: Collection[str] = (),
    pad_values: Mapping[str, float] | None = None,
    left_pad: Collection[str] = (),
) -> Batch:
    """Put piece outputs back in the original sample order.

    ``outputs[j]`` holds the results for samples ``parts[j]`` (in that order); the parts
    together must be a permutation of ``0..B-1``.
    """
    if len(outputs) != len(parts):
        raise ValueError(f"merge: {len(outputs)} outputs for {len(parts)} parts")
    kept = [(o, p) for o, p in zip(outputs, parts) if len(p)]
    perm = [i for _, p in kept for i in p]
    inv = inverse_permutation(perm)
    joined = concat([o for o, _ in kept], shared, pad_values, left_pad, where="merge")
    return take(joined, inv, shared)


def join_outputs(
    outputs: Sequence[Mapping[str, Any]],
    parts: Sequence[Sequence[int]],
    pad_values: Mapping[str, float] | None = None,
    left_pad: Collection[str] = (),
) -> Batch:
    """A node's whole-batch outputs from its outputs on the pieces ``parts``.

    Per-sample values are put back in the batch's order (:func:`merge`); a value with nothing
    per sample (a metric) is the first part's.
    """
    first = outputs[0]
    per = [p for p, v in first.items() if _is_batched(v)]
    if not per:
        return dict(first)
    rows = merge([{p: o[p] for p in per} for o in outputs], parts, (), pad_values, left_pad)
    return {p: rows.get(p, v) for p, v in first.items()}


# --- costs -------------------------------------------------------------------------------


def default_costs(batch: Mapping[str, Any]) -> list[float]:
    """Estimated cost per sample: tokens for text, images for encoders, else 1.

    Tokens are the sum of the mask ports present (``prompt_mask``, ``response_mask``,
    ``attention_mask``), else ``response_lengths``; images count 1 per image (a list of
    images per sample counts its length).
    """
    masks = [batch[p] for p in _MASK_PORTS if isinstance(batch.get(p), torch.Tensor)]
    if masks:
        total = sum(m.reshape(m.shape[0], -1).float().sum(1) for m in masks)  # [B]
        return [float(x) for x in total]
    lengths = batch.get("response_lengths")
    if isinstance(lengths, torch.Tensor):
        return [float(x) for x in lengths.reshape(-1)]
    images = batch.get("images")
    if isinstance(images, list | tuple):
        return [float(len(x)) if isinstance(x, list | tuple) else 1.0 for x in images]
    return [1.0] * batch_size(batch)


def sample_costs(
    batch: Mapping[str, Any], cost: CostFn | None = None, where: str = "batch"
) -> list[float]:
    """Per-sample costs by ``cost`` (default :func:`default_costs`), checked for length and sign."""
    n = batch_size(batch, where=where)
    try:
        costs = [float(c) for c in (cost or default_costs)(batch)]
    except Exception as exc:
        raise ValueError(f"{where}: the cost function failed: {type(exc).__name__}: {exc}") from exc
    if len(costs) != n:
        raise ValueError(f"{where}: the cost function gave {len(costs)} costs for {n} samples")
    bad = [c for c in costs if not math.isfinite(c) or c < 0]
    if bad:
        raise ValueError(f"{where}: costs must be finite and >= 0, got {bad[:3]}")
    return costs


# --- partitioning ------------------------------------------------------------------------


def cut_pieces(
    costs: Sequence[float],
    workers: int = 1,
    max_batch_size: int = 0,
    max_cost: float = 0.0,
    method: str = "kk",
) -> list[list[int]]:
    """Cut samples into balanced pieces that fit a per-call budget.

    At least ``min(workers, n)`` parts (so that every worker serving the node gets work), and
    as many more as the budget needs: no part above ``max_batch_size`` samples or
    ``max_cost`` summed cost (0 = no limit). A single sample above ``max_cost`` cannot be
    cut and forms a part alone. Parts come heaviest first, the order to hand them to
    free workers in (LPT list scheduling).
    """
    n = len(costs)
    if n == 0:
        return []
    if workers < 1:
        raise ValueError(f"cut_pieces: workers must be >= 1, got {workers}")
    total = sum(costs)
    k = min(n, workers)
    if max_batch_size:
        k = max(k, math.ceil(n / max_batch_size))
    if max_cost:
        k = max(k, min(n, math.ceil(total / max_cost)))
    while True:
        parts = [p for p in partition(costs, k, method) if p]
        fits = all(
            (not max_batch_size or len(p) <= max_batch_size)
            and (not max_cost or len(p) == 1 or sum(costs[i] for i in p) <= max_cost)
            for p in parts
        )
        if fits:
            break
        if k >= n:
            parts = [[i] for i in range(n)]
            break
        k = min(n, k + max(1, k // 8))
    parts.sort(key=lambda p: (-sum(costs[i] for i in p), p[0]))
    return parts
