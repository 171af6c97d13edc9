"""The codec's decoder (:mod:`runtime.codec` describes the format): frames back to a value,
zero-copy for tensors in frames; garbage raises DecodeError, never anything else, and
decoding never runs code (a Struct class is looked up only among those registered or already
imported). A CUDA IPC tensor opens torch's IPC handle (:mod:`runtime.codec.cuda_ipc`), only
where the caller passes ``cuda_ipc``."""

from __future__ import annotations

import contextlib
import math
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any

import msgspec

from runtime.codec.cuda_ipc import IpcReceive
from runtime.codec.wire import (
    _BYTES,
    _CUDA_IPC,
    _IMAGE,
    _MAP,
    _MAX_DIMS,
    _NDARRAY,
    _NUMPY_KINDS,
    _SMALL,
    _SMALL_HEAD,
    _STRUCT,
    _TENSOR,
    _TORCH_DTYPES,
    _TUPLE,
    DecodeError,
    ShmReader,
    _dims_ok,
    _plain_key,
    _structs,
    _torch_dtype,
)

__all__ = ["decode_value", "release_ipc"]

_local = threading.local()


# --- decoding ------------------------------------------------------------------------------
def _buffer(frame: Any) -> memoryview:
    mv = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _shape(shape: Any) -> tuple[int, ...]:
    if not _dims_ok(shape):
        raise DecodeError(f"bad shape {shape!r}")
    return tuple(shape)


class _Unpacker:
    def __init__(self) -> None:
        self.frames: Sequence[Any] = ()
        self.shm: ShmReader | None = None
        self.cuda_ipc: IpcReceive | None = None
        self.opened = 0
        """CUDA IPC tensors opened by this decode, in the order they appear."""
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
        if code == _CUDA_IPC:
            if self.cuda_ipc is None:
                raise DecodeError("a CUDA IPC tensor arrived on a link without CUDA IPC")
            t = self.cuda_ipc.tensor(fields)
            self.opened += 1
            return t
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
        else:  # inline bytes are copied into a fresh buffer (raw), frames and shm are not
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
                "module in the receiving node's module, or call runtime.codec.register_struct(cls)"
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


def release_ipc(frames: Sequence[Any], cuda_ipc: IpcReceive, skip: int = 0) -> int:
    """For a message dropped undecoded: release this controller's share of every CUDA IPC
    tensor in it (:meth:`~runtime.codec.cuda_ipc.IpcReceive.release`) without opening any, and
    build nothing else; the first ``skip`` are left alone (a decode that failed part-way
    opened them, and their storages release their shares when freed). Returns how many it
    released; garbage releases what came before it, never raises."""
    released = 0
    seen = 0

    def ext(code: int, payload: memoryview) -> None:
        nonlocal released, seen
        if code != _SMALL:
            fields = decoder.decode(payload)  # nested extensions come through here too
            if code == _CUDA_IPC:
                seen += 1
                if seen > skip:
                    cuda_ipc.release(fields)
                    released += 1

    decoder = msgspec.msgpack.Decoder(ext_hook=ext)
    # garbage, or a share that is not ours, ends the walk: nothing more to release
    with contextlib.suppress(Exception):
        decoder.decode(_buffer(frames[0]))
    return released


def decode_value(
    frames: Sequence[Any],
    *,
    where: str = "value",
    shm: ShmReader | None = None,
    cuda_ipc: IpcReceive | None = None,
) -> Any:
    """The value :func:`encode_value` made ``frames`` from; DecodeError (naming ``where``) if garbage.

    Tensors read from frames share the frames' memory (kept alive by the tensor). A CUDA IPC
    tensor decodes only with ``cuda_ipc`` (this controller's share and GPUs,
    :class:`runtime.codec.cuda_ipc.IpcReceive`); one whose handle does not open is a
    DecodeError that says how to turn IPC off. A decode that fails part-way releases the
    shares of the IPC tensors it did not open (:func:`release_ipc`), so their sender can
    free them; those it opened release theirs as the partial value is freed.
    """
    if not frames:
        raise DecodeError(f"{where}: no frames")
    unpacker = getattr(_local, "unpacker", None)
    if unpacker is None:
        unpacker = _local.unpacker = _Unpacker()  # one per thread: a Decoder is costly to make
    unpacker.frames, unpacker.shm, unpacker.cuda_ipc = frames[1:], shm, cuda_ipc
    unpacker.opened = 0
    try:
        return unpacker.decoder.decode(_buffer(frames[0]))
    except Exception as exc:  # garbage may fail anywhere: msgspec, numpy, PIL, torch
        if cuda_ipc is not None:  # the shares of the tensors it did not open, back to the sender
            release_ipc(frames, cuda_ipc, skip=unpacker.opened)
        if isinstance(exc, DecodeError):
            raise DecodeError(f"{where}: {exc}") from None
        raise DecodeError(
            f"{where}: cannot decode the value: {type(exc).__name__}: {exc}"
        ) from None
    finally:
        unpacker.frames, unpacker.shm, unpacker.cuda_ipc = (), None, None  # hold nothing
