"""The value codec of the data plane: msgpack for structure, raw frames for tensor bytes.

:func:`encode_value` turns a value into ``[header, *buffers]``: ``header`` is a msgpack tree
in which tensors, numpy arrays, PIL images, tuples and msgspec Structs are msgpack
extension objects; a tensor's extension holds ``(dtype, shape, device, where)``, where
``where`` is the bytes themselves (tensors up to :data:`INLINE_BYTES`), the index of a
buffer frame (sent with ``copy=False``, rebuilt with ``torch.frombuffer``: no copy on
either side), or a shared-memory handle (see :mod:`runtime.zmq.transport`). A CPU tensor of at
most :data:`INLINE_BYTES` with a numpy dtype takes a compact extension instead (dtype byte,
ndim byte, sizes, bytes), read without a nested msgpack decode: the dispatch path.

What can travel: None, bool, int (64-bit), float, str, bytes, list, tuple, dict with str
keys, torch tensors (any dense dtype incl. bfloat16 and float8; non-contiguous ones are
made contiguous; ``requires_grad`` is dropped; CUDA tensors arrive on the receiver's
current CUDA device, or on the CPU where it has none), numpy arrays and scalars of
bool/int/uint/float/complex dtypes, PIL images (mode, size, pixels and palette; ``info``
metadata is dropped), and msgspec Structs whose class is registered with
:func:`register_struct` or already imported by the receiver. Nothing is pickled; anything
else raises :class:`UnsupportedValueError` naming where in the value it sits.

Subclasses of list/dict/tuple/int/float/str arrive as the base type (an OrderedDict as a
dict, a namedtuple as a tuple, an IntEnum as an int).

Dicts with keys other than str (an optimizer's ``state_dict()`` has int keys) travel only
with ``encode_value(..., any_keys=True)``: the runtime uses it for node state (checkpoints
of a ZeroMQ run), not for data between nodes. Keys may then be None, bool, int, float, str,
bytes or tuples of those. The decoder accepts such dicts always: decoding never runs code.
"""

from __future__ import annotations

import math
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

__all__ = [
    "INLINE_BYTES",
    "TENSOR_DTYPES",
    "DecodeError",
    "UnsupportedValueError",
    "decode_value",
    "encode_value",
    "register_struct",
]

INLINE_BYTES = 1024
"""Tensors and arrays of at most this many bytes travel inside the header (one copy, no frame)."""

_BYTES_FRAME = 64 * 1024
"""bytes values of at least this size get a frame of their own."""

_TENSOR, _NDARRAY, _STRUCT, _TUPLE, _IMAGE, _BYTES, _MAP, _SMALL = 1, 2, 3, 4, 5, 6, 7, 8
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
"""The one table of tensor dtypes the data plane carries (torch's names); an index into it is a
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
_local = threading.local()
_encoder = msgspec.msgpack.Encoder()


class UnsupportedValueError(TypeError):
    """A value the data plane cannot carry (it would need pickle)."""


class DecodeError(ValueError):
    """Frames that do not decode to a value: garbage, truncation, or an unknown type."""


class ShmWriter(Protocol):
    """Puts large tensor bytes in shared memory; see :class:`runtime.zmq.transport.ShmPool`."""

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


def _torch_dtypes() -> dict[str, Any]:
    import torch

    return {
        n: getattr(torch, n)
        for n in _TORCH_DTYPES
        if isinstance(getattr(torch, n, None), torch.dtype)
    }


_dtype_cache: dict[str, Any] = {}


def _torch_dtype(name: Any) -> Any:
    if not _dtype_cache:
        _dtype_cache.update(_torch_dtypes())
    if not isinstance(name, str) or name not in _dtype_cache:
        raise DecodeError(f"unknown tensor dtype {name!r}")
    return _dtype_cache[name]


class _Unsupported(Exception):
    def __init__(self, message: str):
        self.message, self.path = message, []


def _where(path: list[str]) -> str:
    return "".join(reversed(path))


# --- encoding ------------------------------------------------------------------------------
class _Packer:
    def __init__(self, inline: int, shm: ShmWriter | None, any_keys: bool = False):
        self.buffers: list[Any] = []
        self.inline, self.shm, self.any_keys = inline, shm, any_keys
        self.torch = sys.modules.get("torch")
        if self.torch is not None and not _NUMPY_TORCH:
            for n in _TORCH_DTYPES:
                dtype = getattr(self.torch, n, None)
                if n not in _NO_NUMPY and isinstance(dtype, self.torch.dtype):
                    _NUMPY_TORCH[dtype] = n
        self.np = sys.modules.get("numpy")
        pil = sys.modules.get("PIL.Image")
        self.image_cls = getattr(pil, "Image", None)

    def pack(self, v: Any) -> Any:
        t = type(v)
        if v is None or t is bool or t is float or t is str:
            return v
        if t is int:
            if not -(2**63) <= v < 2**64:
                raise _Unsupported(f"int {v} does not fit in 64 bits; send it as a str or a tensor")
            return v
        if t is list:
            return [self._item(x, i) for i, x in enumerate(v)]
        if t is dict:
            return self._dict(v)
        if t is bytes:
            return self._bytes(v)
        torch, np = self.torch, self.np
        if torch is not None and isinstance(v, torch.Tensor):
            return self._tensor(v)
        if np is not None and isinstance(v, np.ndarray | np.generic):
            return self._ndarray(v)
        if isinstance(v, msgspec.Struct):
            return self._struct(v)
        if self.image_cls is not None and isinstance(v, self.image_cls):
            return self._image(v)
        if isinstance(v, tuple):
            return msgspec.msgpack.Ext(
                _TUPLE, _encoder.encode([self._item(x, i) for i, x in enumerate(v)])
            )
        if isinstance(v, list):
            return [self._item(x, i) for i, x in enumerate(v)]
        if isinstance(v, dict):
            return self._dict(v)
        for base in (int, float, str):
            if isinstance(v, base):  # IntEnum, str subclasses: sent as the base type
                return self.pack(base(v))
        if isinstance(v, bytearray | memoryview):
            return self._bytes(bytes(v))
        raise _Unsupported(
            f"a {t.__module__}.{t.__qualname__} cannot be sent between controllers (pickle is off); "
            "send tensors, numpy arrays, PIL images, msgspec Structs, or None/bool/int/float/str/"
            "bytes/list/tuple/dict with str keys"
        )

    def _item(self, x: Any, index: int) -> Any:
        try:
            return self.pack(x)
        except _Unsupported as exc:
            exc.path.append(f"[{index}]")
            raise

    def _dict(self, v: dict[Any, Any]) -> Any:
        if self.any_keys and not all(type(k) is str for k in v):
            return self._map(v)
        out = {}
        for k, x in v.items():
            if type(k) is not str:
                raise _Unsupported(f"dict key {k!r} is a {type(k).__name__}; keys must be str")
            try:
                out[k] = self.pack(x)
            except _Unsupported as exc:
                exc.path.append(f"[{k!r}]")
                raise
        return out

    def _map(self, v: dict[Any, Any]) -> Any:
        pairs = []
        for k, x in v.items():
            if not _plain_key(k):
                raise _Unsupported(
                    f"dict key {k!r:.40} is a {type(k).__name__}; keys must be None, bool, int, "
                    "float, str, bytes or tuples of those"
                )
            try:
                pairs.append([self.pack(k), self.pack(x)])
            except _Unsupported as exc:
                exc.path.append(f"[{k!r}]")
                raise
        return msgspec.msgpack.Ext(_MAP, _encoder.encode(pairs))

    def _bytes(self, v: bytes) -> Any:
        if len(v) < _BYTES_FRAME:
            return v
        self.buffers.append(v)
        return msgspec.msgpack.Ext(_BYTES, _encoder.encode(len(self.buffers) - 1))

    def _place(self, flat: Any, nbytes: int, as_numpy: Any) -> Any:
        """Inline bytes, a frame index, or a shared-memory handle for ``nbytes`` of data."""
        if nbytes <= self.inline:
            return as_numpy().tobytes()
        if self.shm is not None and self.torch is not None and nbytes >= self.shm.threshold:
            return self.shm.put(flat)
        self.buffers.append(as_numpy())
        return len(self.buffers) - 1

    def _tensor(self, v: Any) -> Any:
        torch = self.torch
        if v.layout == torch.strided and v.is_cpu and v.nbytes <= self.inline:
            # The dispatch path: a small CPU tensor goes inline in a few calls (numpy's
            # tobytes() is C order for any strides); the general path below costs several times more.
            name = _NUMPY_TORCH.get(v.dtype)
            if name is not None:
                t = v.detach() if v.requires_grad else v
                if t.is_conj() or t.is_neg():
                    t = t.resolve_conj().resolve_neg()
                shape = t.shape
                head = _SMALL_HEAD.pack(_DTYPE_INDEX[name], len(shape))
                dims = struct.pack(f"<{len(shape)}Q", *shape)
                return msgspec.msgpack.Ext(_SMALL, head + dims + t.numpy().tobytes())
        if v.layout != torch.strided:
            raise _Unsupported(f"a {v.layout} tensor cannot be sent; call .to_dense() first")
        name = str(v.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise _Unsupported(f"tensor dtype {name} cannot be sent")
        t = v.detach()
        device = t.device.type
        if device == "meta":
            raise _Unsupported("a meta tensor has no data to send")
        if device != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        flat = t.reshape(-1).view(torch.uint8)  # (numel * itemsize,) the raw bytes, no copy
        where = self._place(flat, flat.numel(), flat.numpy)
        return msgspec.msgpack.Ext(_TENSOR, _encoder.encode([name, list(t.shape), device, where]))

    def _ndarray(self, v: Any) -> Any:
        np = self.np
        scalar = isinstance(v, np.generic)
        a = np.asarray(v)
        if a.dtype.kind not in _NUMPY_KINDS or a.dtype.fields is not None:
            raise _Unsupported(
                f"a numpy array of dtype {a.dtype} cannot be sent (only bool/int/uint/float/complex)"
            )
        if not a.flags.c_contiguous:
            a = a.copy(order="C")
        flat = a.reshape(-1).view(np.uint8)  # raw bytes, no copy
        where = self._place(
            None if self.torch is None else self.torch.from_numpy(flat), flat.nbytes, lambda: flat
        )
        return msgspec.msgpack.Ext(
            _NDARRAY, _encoder.encode([a.dtype.str, list(a.shape), where, scalar])
        )

    def _struct(self, v: msgspec.Struct) -> Any:
        cls = type(v)
        if "<locals>" in cls.__qualname__:
            raise _Unsupported(
                f"Struct {cls.__qualname__} is defined in a function; define it at module level"
            )
        fields = {}
        for f in cls.__struct_fields__:
            try:
                fields[f] = self.pack(getattr(v, f))
            except _Unsupported as exc:
                exc.path.append(f".{f}")
                raise
        return msgspec.msgpack.Ext(
            _STRUCT, _encoder.encode([f"{cls.__module__}:{cls.__qualname__}", fields])
        )

    def _image(self, v: Any) -> Any:
        data = v.tobytes()
        palette = v.getpalette() if v.mode in ("P", "PA") else None
        where: Any = data
        if len(data) > self.inline:
            self.buffers.append(data)
            where = len(self.buffers) - 1
        return msgspec.msgpack.Ext(_IMAGE, _encoder.encode([v.mode, list(v.size), where, palette]))


def _plain_key(k: Any) -> bool:
    if k is None or type(k) in (bool, int, float, str, bytes):
        return True
    return type(k) is tuple and all(_plain_key(x) for x in k)


def encode_value(
    value: Any,
    *,
    where: str = "value",
    inline: int = INLINE_BYTES,
    shm: ShmWriter | None = None,
    any_keys: bool = False,
) -> list[Any]:
    """``[header, *buffers]`` for a value; buffers share memory with the value's tensors.

    Raises UnsupportedValueError naming ``where`` and the path inside the value
    (``node 'update' output 'metrics'['opt'][2]: a set cannot be sent ...``).
    ``any_keys=True`` also carries dicts with non-str keys (node state; see the module doc).
    """
    packer = _Packer(inline, shm, any_keys)
    try:
        tree = packer.pack(value)
    except _Unsupported as exc:
        raise UnsupportedValueError(f"{where}{_where(exc.path)}: {exc.message}") from None
    except RecursionError:
        raise UnsupportedValueError(
            f"{where}: the value is nested too deeply (or contains itself)"
        ) from None
    return [_encoder.encode(tree), *packer.buffers]


# --- decoding ------------------------------------------------------------------------------
def _buffer(frame: Any) -> memoryview:
    mv = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _shape(shape: Any) -> tuple[int, ...]:
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_DIMS
        or not all(type(d) is int and 0 <= d < 2**62 for d in shape)
    ):
        raise DecodeError(f"bad shape {shape!r}")
    return tuple(shape)


class _Unpacker:
    def __init__(self) -> None:
        self.frames: Sequence[Any] = ()
        self.shm: ShmReader | None = None
        self.decoder = msgspec.msgpack.Decoder(ext_hook=self.ext)

    def frame(self, index: Any) -> memoryview:
        if type(index) is not int or not 0 <= index < len(self.frames):
            raise DecodeError(
                f"frame index {index!r} out of range (the message has {len(self.frames)} buffers)"
            )
        return _buffer(self.frames[index])

    def raw(self, where: Any, nbytes: int) -> Any:
        """Writable bytes of a tensor/array: an inline copy, a frame (no copy), or shared memory."""
        if isinstance(where, bytes):
            data: Any = memoryview(bytearray(where))
        elif isinstance(where, list):
            if self.shm is None:
                raise DecodeError("a shared-memory handle arrived on a link without shared memory")
            data = self.shm.read(where, nbytes)
        else:
            data = self.frame(where)
            if data.readonly:
                data = memoryview(bytearray(data))
        if len(data) != nbytes:
            raise DecodeError(f"buffer holds {len(data)} bytes, the header says {nbytes}")
        return data

    def ext(self, code: int, payload: memoryview) -> Any:
        if code == _SMALL:
            return self.small_tensor(payload)
        fields = self.decoder.decode(payload)
        if code == _TENSOR:
            return self.tensor(*_fields(fields, 4, "tensor"))
        if code == _NDARRAY:
            return self.ndarray(*_fields(fields, 4, "ndarray"))
        if code == _TUPLE:
            if not isinstance(fields, list):
                raise DecodeError("bad tuple")
            return tuple(fields)
        if code == _STRUCT:
            return self.struct(*_fields(fields, 2, "struct"))
        if code == _IMAGE:
            return self.image(*_fields(fields, 4, "image"))
        if code == _BYTES:
            return bytes(self.frame(fields))
        if code == _MAP:
            if not isinstance(fields, list) or not all(
                isinstance(p, list) and len(p) == 2 and _plain_key(p[0]) for p in fields
            ):
                raise DecodeError("bad map")
            return {k: x for k, x in fields}
        raise DecodeError(f"unknown extension type {code}")

    def small_tensor(self, payload: memoryview) -> Any:
        import torch

        if len(payload) < 2:
            raise DecodeError("bad small-tensor header")
        index, ndim = _SMALL_HEAD.unpack_from(payload)
        if index >= len(_TORCH_DTYPES) or ndim > _MAX_DIMS or len(payload) < 2 + 8 * ndim:
            raise DecodeError(f"bad small-tensor header (dtype {index}, {ndim} dims)")
        dtype = _torch_dtype(_TORCH_DTYPES[index])
        dims = _shape(list(struct.unpack_from(f"<{ndim}Q", payload, 2)))
        data = payload[2 + 8 * ndim :]
        nbytes = math.prod(dims) * dtype.itemsize
        if len(data) != nbytes:
            raise DecodeError(f"buffer holds {len(data)} bytes, the header says {nbytes}")
        if nbytes == 0:
            return torch.empty(dims, dtype=dtype)
        t = torch.frombuffer(bytearray(data), dtype=dtype)  # one copy into a fresh buffer
        return t if ndim == 1 else t.reshape(dims)

    def tensor(self, name: Any, shape: Any, device: Any, where: Any) -> Any:
        import torch

        dtype = _torch_dtype(name)
        dims = _shape(shape)
        nbytes = math.prod(dims) * dtype.itemsize
        if nbytes == 0:
            t = torch.empty(dims, dtype=dtype)
        elif isinstance(where, bytes):  # inline: one copy into a fresh (aligned) buffer
            if len(where) != nbytes:
                raise DecodeError(f"buffer holds {len(where)} bytes, the header says {nbytes}")
            t = torch.frombuffer(bytearray(where), dtype=dtype)
            if len(dims) != 1:
                t = t.reshape(dims)
        else:
            if (
                isinstance(where, list)
                and self.shm is not None
                and hasattr(self.shm, "read_tensor")
            ):
                t = self.shm.read_tensor(where, nbytes)
            else:
                t = torch.frombuffer(
                    self.raw(where, nbytes), dtype=torch.uint8
                )  # (nbytes,) no copy
            if t.numel() != nbytes:
                raise DecodeError(f"buffer holds {t.numel()} bytes, the header says {nbytes}")
            if dtype.itemsize > 1 and t.data_ptr() % min(dtype.itemsize, 8):
                t = t.clone()  # unaligned frame (small messages share a receive buffer)
            t = t.view(dtype).reshape(dims)
        if device == "cuda" and torch.cuda.is_available():
            t = t.to("cuda", non_blocking=False)
        return t

    def ndarray(self, dtype: Any, shape: Any, where: Any, scalar: Any) -> Any:
        import numpy as np

        if not isinstance(dtype, str):
            raise DecodeError(f"bad numpy dtype {dtype!r}")
        dt = np.dtype(dtype)
        if dt.kind not in _NUMPY_KINDS or dt.fields is not None:
            raise DecodeError(f"numpy dtype {dtype!r} is not allowed on the wire")
        dims = _shape(shape)
        nbytes = math.prod(dims) * dt.itemsize
        a = (
            np.empty(dims, dt)
            if nbytes == 0
            else np.frombuffer(self.raw(where, nbytes), dtype=dt).reshape(dims)
        )
        return a[()] if scalar and a.ndim == 0 else a

    def struct(self, ref: Any, fields: Any) -> Any:
        if not isinstance(ref, str) or not isinstance(fields, dict):
            raise DecodeError("bad struct")
        cls = _structs.get(ref) or _imported(ref)
        if cls is None:
            raise DecodeError(
                f"Struct type {ref!r} is neither registered nor imported in this process; import its "
                "module in the receiving node's module, or call runtime.zmq.serial.register_struct(cls)"
            )
        return cls(**fields)

    def image(self, mode: Any, size: Any, where: Any, palette: Any) -> Any:
        from PIL import Image

        dims = _shape(size)
        if not isinstance(mode, str) or len(dims) != 2:
            raise DecodeError(f"bad image mode/size {mode!r} {size!r}")
        data = bytes(where) if isinstance(where, bytes) else bytes(self.frame(where))
        if dims[0] * dims[1] > 8 * len(data):  # never let a header allocate more than the data
            raise DecodeError(f"image size {dims} needs more than the {len(data)} bytes sent")
        image = Image.frombytes(mode, dims, data)
        if palette is not None:
            image.putpalette(palette)
        return image


def _fields(fields: Any, n: int, what: str) -> list[Any]:
    if not isinstance(fields, list) or len(fields) != n:
        raise DecodeError(f"bad {what} header {fields!r:.80}")
    return fields


def _imported(ref: str) -> type | None:
    module_name, _, qualname = ref.partition(":")
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        if obj is None or part.startswith("_") and part != qualname.split(".")[-1]:
            return None
        obj = getattr(obj, part, None)
    if isinstance(obj, type) and issubclass(obj, msgspec.Struct):
        return obj
    return None


def decode_value(
    frames: Sequence[Any], *, where: str = "value", shm: ShmReader | None = None
) -> Any:
    """The value :func:`encode_value` made ``frames`` from; DecodeError (naming ``where``) if garbage.

    Tensors read from frames share the frames' memory (kept alive by the tensor).
    """
    if not frames:
        raise DecodeError(f"{where}: no frames")
    unpacker = getattr(_local, "unpacker", None)
    if unpacker is None:
        unpacker = _local.unpacker = _Unpacker()  # one per thread: a Decoder is costly to make
    unpacker.frames, unpacker.shm = frames[1:], shm
    try:
        return unpacker.decoder.decode(_buffer(frames[0]))
    except DecodeError as exc:
        raise DecodeError(f"{where}: {exc}") from None
    except Exception as exc:  # garbage may fail anywhere: msgspec, numpy, PIL, torch
        raise DecodeError(
            f"{where}: cannot decode the value: {type(exc).__name__}: {exc}"
        ) from None
    finally:
        unpacker.frames, unpacker.shm = (), None  # hold no frame past the call
