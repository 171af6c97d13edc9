"""The codec's encoder: a value to ``[header, *buffers]`` (:func:`encode_value`); the format
is described in :mod:`runtime.codec`."""

from __future__ import annotations

import struct
import sys
from typing import Any

import msgspec

from runtime.codec.cuda_ipc import IpcSend
from runtime.codec.wire import (
    _BYTES,
    _BYTES_FRAME,
    _DTYPE_INDEX,
    _IMAGE,
    _MAP,
    _NDARRAY,
    _NO_NUMPY,
    _NUMPY_KINDS,
    _NUMPY_TORCH,
    _SMALL,
    _SMALL_HEAD,
    _STRUCT,
    _TENSOR,
    _TORCH_DTYPES,
    _TUPLE,
    INLINE_BYTES,
    ShmWriter,
    UnsupportedValueError,
    _plain_key,
)

__all__ = ["encode_value"]

_encoder = msgspec.msgpack.Encoder()


class _Unsupported(Exception):
    def __init__(self, message: str):
        self.message, self.path = message, []


def _where(path: list[str]) -> str:
    return "".join(reversed(path))


# --- encoding ------------------------------------------------------------------------------
class _Packer:
    def __init__(
        self,
        inline: int,
        shm: ShmWriter | None,
        any_keys: bool = False,
        cuda_ipc: IpcSend | None = None,
    ):
        self.buffers: list[Any] = []
        self.inline, self.shm, self.any_keys = inline, shm, any_keys
        self.cuda_ipc = cuda_ipc if cuda_ipc is not None and cuda_ipc.devices else None
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
            return [self._at(x, i) for i, x in enumerate(v)]
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
                _TUPLE, _encoder.encode([self._at(x, i) for i, x in enumerate(v)])
            )
        if isinstance(v, list):
            return [self._at(x, i) for i, x in enumerate(v)]
        if isinstance(v, dict):
            return self._dict(v)
        for base in (int, float, str):
            if isinstance(v, base):  # IntEnum, str subclasses: sent as the base type
                return self.pack(base(v))
        if isinstance(v, bytearray | memoryview):
            return self._bytes(bytes(v))
        raise _Unsupported(
            f"a {t.__module__}.{t.__qualname__} cannot be sent to another process (pickle is off); "
            "send tensors, numpy arrays, PIL images, msgspec Structs, or None/bool/int/float/str/"
            "bytes/list/tuple/dict with str keys"
        )

    def _at(self, x: Any, key: Any, form: str = "[{}]") -> Any:
        """``pack(x)``; an unsupported value names ``form.format(key)`` in its path."""
        try:
            return self.pack(x)
        except _Unsupported as exc:
            exc.path.append(form.format(key))
            raise

    def _dict(self, v: dict[Any, Any]) -> Any:
        if self.any_keys and not all(type(k) is str for k in v):
            return self._map(v)
        out = {}
        for k, x in v.items():
            if type(k) is not str:
                raise _Unsupported(f"dict key {k!r} is a {type(k).__name__}; keys must be str")
            out[k] = self._at(x, k, "[{!r}]")
        return out

    def _map(self, v: dict[Any, Any]) -> Any:
        pairs = []
        for k, x in v.items():
            if not _plain_key(k):
                raise _Unsupported(
                    f"dict key {k!r:.40} is a {type(k).__name__}; keys must be None, bool, int, "
                    "float, str, bytes or tuples of those"
                )
            pairs.append([self._at(k, k, "[{!r}]"), self._at(x, k, "[{!r}]")])
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
            ipc = self.cuda_ipc
            if ipc is not None and device == "cuda":
                physical = ipc.physical(t)
                if physical is not None:  # strides kept: the receiver maps the same memory
                    return ipc.ext(t.resolve_conj().resolve_neg(), name, physical)
            t = t.cpu()  # the host copy ("CPU fallback")
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
        fields = {f: self._at(getattr(v, f), f, ".{}") for f in cls.__struct_fields__}
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


def encode_value(
    value: Any,
    *,
    where: str = "value",
    inline: int = INLINE_BYTES,
    shm: ShmWriter | None = None,
    any_keys: bool = False,
    cuda_ipc: IpcSend | None = None,
) -> list[Any]:
    """``[header, *buffers]`` for a value; buffers share memory with the value's tensors.

    Raises UnsupportedValueError naming ``where`` and the path inside the value
    (``node 'update' output 'metrics'['opt'][2]: a set cannot be sent ...``).
    ``any_keys=True`` also carries dicts with non-str keys (node state; see the module doc).
    ``cuda_ipc``: CUDA tensors on the GPUs it lists go by CUDA IPC, one share per destination
    (:class:`runtime.codec.cuda_ipc.IpcSend`); None: every CUDA tensor takes the host copy.
    """
    packer = _Packer(inline, shm, any_keys, cuda_ipc)
    try:
        tree = packer.pack(value)
    except _Unsupported as exc:
        raise UnsupportedValueError(f"{where}{_where(exc.path)}: {exc.message}") from None
    except RecursionError:
        raise UnsupportedValueError(
            f"{where}: the value is nested too deeply (or contains itself)"
        ) from None
    return [_encoder.encode(tree), *packer.buffers]
