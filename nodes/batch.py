"""A batch of samples as it moves between nodes.

A :class:`SampleBatch` holds two kinds of per-sample data, with the sample index first:

* ``tensors``: ``dict[str, torch.Tensor]``, each of shape ``(B, ...)`` (at least one dim;
  a 0-d tensor has no sample axis and is refused: put it in a field or reshape it to ``(1,)``);
* ``fields``: ``dict[str, list]``, one Python value per sample (texts, dicts of metadata,
  PIL images, variable-length tensors).

Every tensor and field must have the same length B; construction names the one that does not.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = ["SampleBatch", "inverse_permutation"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# permutations
# ---------------------------------------------------------------------------------------------


def _as_index_list(indices: Any, n: int, where: str) -> list[int]:
    """Normalize ints / a long tensor / a bool mask to a list of indices in [0, n)."""
    if isinstance(indices, torch.Tensor):
        if indices.dtype == torch.bool:
            if indices.shape != (n,):
                raise ValueError(
                    f"{where}: a bool mask must have shape ({n},), got {tuple(indices.shape)}"
                )
            return indices.nonzero().reshape(-1).tolist()
        if indices.is_floating_point() or indices.is_complex() or indices.dim() > 1:
            raise ValueError(
                f"{where}: indices must be a 1-D integer tensor or a bool mask, got "
                f"{_dtype_name(indices.dtype)}{list(indices.shape)}"
            )
        indices = indices.reshape(-1).tolist()
    elif isinstance(indices, int | slice):
        raise TypeError(
            f"{where}: pass a sequence of indices (e.g. [i] or range(a, b)), "
            f"not {type(indices).__name__}"
        )
    out = []
    for i in indices:
        if isinstance(i, bool):
            raise TypeError(f"{where}: index {i!r} is a bool; pass ints or a bool mask tensor")
        try:
            i = operator.index(i)
        except TypeError:
            raise TypeError(f"{where}: index {i!r} is not an int") from None
        if not -n <= i < n:
            raise IndexError(f"{where}: index {i} is out of range for a batch of {n}")
        out.append(i % n)
    return out


def inverse_permutation(permutation: Sequence[int] | torch.Tensor) -> list[int]:
    """The permutation that undoes ``permutation``: ``b.reorder(p).reorder(inverse_permutation(p))``
    is ``b``. ``inverse[p[i]] = i``."""
    perm = permutation.tolist() if isinstance(permutation, torch.Tensor) else list(permutation)
    _check_permutation(perm, len(perm), "inverse_permutation")
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return inverse


def _check_permutation(perm: list[int], n: int, where: str) -> None:
    if len(perm) != n or sorted(perm) != list(range(n)):
        raise ValueError(
            f"{where}: {perm if n <= 16 else f'{perm[:16]}...'} is not a permutation of "
            f"range({n}); it must hold each index 0..{n - 1} exactly once"
        )


# ---------------------------------------------------------------------------------------------
# the container
# ---------------------------------------------------------------------------------------------


class SampleBatch:
    """Per-sample tensors (first dim = sample) and per-sample Python values, all of length B.

    ``select``/``split``/``concat``/``reorder`` return new batches; tensors from ``split`` are
    views, field lists are new lists holding the same objects (a shallow copy).
    """

    __slots__ = ("_len", "fields", "tensors")

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        fields: Mapping[str, Sequence[Any]] | None = None,
        *,
        length: int | None = None,
    ) -> None:
        """Args:
        tensors: name -> tensor of shape (B, ...).
        fields: name -> list of B values.
        length: B, needed only for a batch with neither tensors nor fields (else checked).
        """
        self.tensors: dict[str, torch.Tensor] = {}
        self.fields: dict[str, list[Any]] = {}
        sizes: dict[str, int] = {}
        for name, t in (tensors or {}).items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"SampleBatch: tensor {name!r} is a {type(t).__name__}; put non-tensor values "
                    "in fields (a list with one value per sample)"
                )
            if t.dim() == 0:
                raise ValueError(
                    f"SampleBatch: tensor {name!r} is 0-d; tensors in a batch need the sample "
                    "dimension first (B, ...): reshape it to (1,) or put the value in fields"
                )
            self.tensors[name] = t
            sizes[name] = t.shape[0]
        for name, values in (fields or {}).items():
            if name in self.tensors:
                raise ValueError(f"SampleBatch: {name!r} is both a tensor and a field; rename one")
            if isinstance(values, tuple):
                values = list(values)
            if not isinstance(values, list):
                raise TypeError(
                    f"SampleBatch: field {name!r} must be a list with one value per sample, "
                    f"got {type(values).__name__}"
                )
            self.fields[name] = values
            sizes[name] = len(values)
        if length is not None:
            source = f"length={length}"
        elif sizes:
            source = repr(next(iter(sizes)))
            length = sizes[next(iter(sizes))]
        else:
            length = 0
        for name, size in sizes.items():
            if size != length:
                kind = "tensor" if name in self.tensors else "field"
                raise ValueError(
                    f"SampleBatch: {kind} {name!r} has {size} samples but the batch has {length} "
                    f"(set by {source}); every tensor's first dim and every field's length must "
                    "be the batch size"
                )
        self._len = length

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SampleBatch:
        """Build from a node's input/output dict: tensors go to ``tensors``, lists to ``fields``."""
        tensors, fields = {}, {}
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[name] = value
            elif isinstance(value, list | tuple):
                fields[name] = value
            else:
                raise TypeError(
                    f"SampleBatch.from_dict: {name!r} is a {type(value).__name__}; each value must "
                    "be a tensor (B, ...) or a list of B values"
                )
        return cls(tensors, fields)

    def to_dict(self) -> dict[str, Any]:
        """Tensors and fields in one dict (the shape of a node's inputs)."""
        return {**self.tensors, **self.fields}

    # --- mapping-like access ------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def keys(self) -> list[str]:
        return [*self.tensors, *self.fields]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.fields

    def __getitem__(self, key: str) -> Any:
        if not isinstance(key, str):
            raise TypeError(
                f"SampleBatch[...] takes a key (str), got {type(key).__name__}; "
                "use batch.select(indices) to pick samples"
            )
        if key in self.tensors:
            return self.tensors[key]
        if key in self.fields:
            return self.fields[key]
        raise KeyError(f"SampleBatch has no {key!r}; its keys are {self.keys()}")

    def __repr__(self) -> str:
        ts = ", ".join(
            f"{k}: {_dtype_name(t.dtype)}{list(t.shape)}" for k, t in self.tensors.items()
        )
        fs = ", ".join(f"{k}: list[{len(v)}]" for k, v in self.fields.items())
        return f"SampleBatch(len={self._len}, tensors={{{ts}}}, fields={{{fs}}})"

    # --- sample operations --------------------------------------------------------------------
    def select(self, indices: Sequence[int] | torch.Tensor) -> SampleBatch:
        """The samples at ``indices`` (ints, negative allowed, repeats allowed; a long tensor; or a
        bool mask of shape (B,)), in that order."""
        idx = _as_index_list(indices, self._len, "SampleBatch.select")
        index = torch.tensor(idx, dtype=torch.long)  # (K,)
        tensors = {k: t.index_select(0, index.to(t.device)) for k, t in self.tensors.items()}
        fields = {k: [v[i] for i in idx] for k, v in self.fields.items()}
        return SampleBatch(tensors, fields, length=len(idx))

    def reorder(self, permutation: Sequence[int] | torch.Tensor) -> SampleBatch:
        """Sample ``i`` of the result is sample ``permutation[i]`` of this batch; undo with
        ``reorder(inverse_permutation(permutation))``."""
        perm = _as_index_list(permutation, self._len, "SampleBatch.reorder")
        _check_permutation(perm, self._len, "SampleBatch.reorder")
        return self.select(perm)

    def split(self, sizes: int | Sequence[int]) -> list[SampleBatch]:
        """Cut into consecutive parts.

        ``sizes`` is either an int n (n near-equal parts; the first ``B % n`` parts are one
        longer, as in ``numpy.array_split``; parts may be empty when n > B) or a list of part
        sizes summing to B.
        """
        if isinstance(sizes, int) and not isinstance(sizes, bool):
            if sizes < 1:
                raise ValueError(f"SampleBatch.split: number of parts must be >= 1, got {sizes}")
            q, r = divmod(self._len, sizes)
            parts = [q + (1 if i < r else 0) for i in range(sizes)]
        else:
            parts = [int(s) for s in sizes]
            if any(s < 0 for s in parts) or sum(parts) != self._len:
                raise ValueError(
                    f"SampleBatch.split: sizes {parts} must be >= 0 and sum to the batch size "
                    f"{self._len} (they sum to {sum(parts)})"
                )
        out, start = [], 0
        for size in parts:
            stop = start + size
            tensors = {k: t[start:stop] for k, t in self.tensors.items()}  # (size, ...) views
            fields = {k: v[start:stop] for k, v in self.fields.items()}
            out.append(SampleBatch(tensors, fields, length=size))
            start = stop
        return out

    @classmethod
    def concat(cls, batches: Sequence[SampleBatch]) -> SampleBatch:
        """Join batches end to end. All must have the same tensor and field keys, and tensors of
        one key the same dtype, device and trailing shape (no padding is done here)."""
        batches = list(batches)
        if not batches:
            raise ValueError("SampleBatch.concat: got no batches; pass at least one")
        first = batches[0]
        for j, b in enumerate(batches[1:], start=1):
            if not isinstance(b, SampleBatch):
                raise TypeError(f"SampleBatch.concat: item {j} is a {type(b).__name__}")
            for kind, mine, theirs in (
                ("tensor", first.tensors, b.tensors),
                ("field", first.fields, b.fields),
            ):
                if set(mine) != set(theirs):
                    missing, extra = (
                        sorted(set(mine) - set(theirs)),
                        sorted(set(theirs) - set(mine)),
                    )
                    raise ValueError(
                        f"SampleBatch.concat: batch {j} has {kind} keys {sorted(theirs)} but batch "
                        f"0 has {sorted(mine)} (missing {missing}, unexpected {extra}); all "
                        "batches must hold the same keys"
                    )
            for k, t in first.tensors.items():
                u = b.tensors[k]
                if u.dtype != t.dtype or u.shape[1:] != t.shape[1:] or u.device != t.device:
                    raise ValueError(
                        f"SampleBatch.concat: tensor {k!r} is {_dtype_name(u.dtype)}"
                        f"{list(u.shape)} on {u.device} in batch {j} but {_dtype_name(t.dtype)}"
                        f"{list(t.shape)} on {t.device} in batch 0; dtype, device and all dims "
                        "but the first must agree (pad to a common length first)"
                    )
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        fields = {k: [v for b in batches for v in b.fields[k]] for k in first.fields}
        return cls(tensors, fields, length=sum(len(b) for b in batches))

    def to(self, device: str | torch.device, *, non_blocking: bool = False) -> SampleBatch:
        """Tensors moved to ``device``; fields are shared, unchanged."""
        tensors = {k: t.to(device, non_blocking=non_blocking) for k, t in self.tensors.items()}
        return SampleBatch(tensors, dict(self.fields), length=self._len)
