"""The codec's wire format, shared by the encoder (:mod:`runtime.codec.encode`) and the
decoder (:mod:`runtime.codec.decode`): extension codes, the one dtype table, the errors,
the shared-memory protocols and the registry of Struct classes. The CUDA IPC extension's
fields and lifetime rules are in :mod:`runtime.codec.cuda_ipc`."""

from __future__ import annotations

import struct
from typing import Any, Protocol

import msgspec

__all__ = [
    "INLINE_BYTES",
    "TENSOR_DTYPES",
    "DecodeError",
    "ShmReader",
    "ShmWriter",
    "UnsupportedValueError",
    "register_struct",
]

INLINE_BYTES = 1024
"""Tensors and arrays of at most this many bytes travel inside the header (one copy, no frame)."""

_BYTES_FRAME = 64 * 1024
"""bytes values of at least this size get a frame of their own."""

_TENSOR, _NDARRAY, _STRUCT, _TUPLE, _IMAGE, _BYTES, _MAP, _SMALL = 1, 2, 3, 4, 5, 6, 7, 8
_CUDA_IPC = 9
"""A CUDA tensor sent by CUDA IPC between controllers on one host (:mod:`runtime.codec.cuda_ipc`):
plain msgpack fields (dtype, shape, stride, offset, physical GPU, one IPC share per destination)."""
_SMALL_HEAD = struct.Struct("<BB")
"""A small CPU tensor's extension: dtype index (in _TORCH_DTYPES), ndim, then ndim little-endian
uint64 sizes and the raw bytes: read with struct, no nested msgpack (the dispatch path)."""
_MAX_DIMS = 64

_TORCH_DTYPES = [
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "complex32",
    "complex64",
    "complex128",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
]
"""The one table of tensor dtypes the codec carries (torch's names); an index into it is a
small tensor's dtype byte, so entries are only ever appended."""
_NO_NUMPY = frozenset(n for n in _TORCH_DTYPES if n in ("bfloat16", "complex32") or "float8" in n)
"""The dtypes that ``Tensor.numpy()`` refuses: they take the general tensor path."""
_NUMPY_KINDS = "biufc"

TENSOR_DTYPES: tuple[str, ...] = tuple(_TORCH_DTYPES)
"""Every tensor dtype the codec carries, by torch's name without ``torch.``."""
_DTYPE_INDEX = {name: i for i, name in enumerate(_TORCH_DTYPES)}
_NUMPY_TORCH: dict[Any, str] = {}
"""torch dtype -> name, for the dtypes ``Tensor.numpy()`` takes (filled on first use)."""
_structs: dict[str, type] = {}


class UnsupportedValueError(TypeError):
    """A value the codec cannot carry (it would need pickle)."""


class DecodeError(ValueError):
    """Frames that do not decode to a value: garbage, truncation, or an unknown type."""


class ShmWriter(Protocol):
    """Puts large tensor bytes in shared memory (the ZeroMQ runtime's ``ShmPool``, in
    ``runtime/zmq/transport.py``)."""

    threshold: int

    def put(self, flat: Any) -> list[Any]: ...


class ShmReader(Protocol):
    def read(self, handle: list[Any], nbytes: int) -> Any: ...

    def read_tensor(self, handle: list[Any], nbytes: int) -> Any: ...


def register_struct(cls: type) -> type:
    """Allow a msgspec Struct class to be decoded even where its module is not yet imported."""
    if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
        raise TypeError(f"register_struct expects a msgspec.Struct class, got {cls!r}")
    _structs[f"{cls.__module__}:{cls.__qualname__}"] = cls
    return cls


_dtype_cache: dict[str, Any] = {}


def _torch_dtype(name: Any) -> Any:
    if not _dtype_cache:
        import torch

        dtypes = {n: getattr(torch, n, None) for n in _TORCH_DTYPES}
        _dtype_cache.update({n: d for n, d in dtypes.items() if isinstance(d, torch.dtype)})
    if not isinstance(name, str) or name not in _dtype_cache:
        raise DecodeError(f"unknown tensor dtype {name!r}")
    return _dtype_cache[name]


def _dims_ok(dims: Any) -> bool:
    """A shape or strides the wire may carry: a list of at most _MAX_DIMS ints in [0, 2**62)."""
    return (
        isinstance(dims, list)
        and len(dims) <= _MAX_DIMS
        and all(type(d) is int and 0 <= d < 2**62 for d in dims)
    )


def _plain_key(k: Any) -> bool:
    if k is None or type(k) in (bool, int, float, str, bytes):
        return True
    return type(k) is tuple and all(_plain_key(x) for x in k)
