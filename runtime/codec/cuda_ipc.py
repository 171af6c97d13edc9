"""CUDA tensors between controllers on one host, by CUDA IPC instead of through host memory.

**When.** The driver decides per controller which GPUs it may take IPC tensors on
(:func:`peer_gpus`, through ``runtime.zmq.options.setup_gpus``) and says it in SETUP
(``Setup.cuda_ipc_gpus``): for a controller it started on its own host, the GPUs of its
``Resources.cuda`` (or all the driver sees when it has none assigned), as *physical*
indices, the ordinals among the driver's visible GPUs, in the controller's local-ordinal
order (its ``CUDA_VISIBLE_DEVICES``, so local ordinal ``j`` is physical ``gpus[j]``). A
controller that joined from elsewhere (``--no-spawn``) gets ``[]``, and so does every
controller when IPC is off (``ZmqExecutor(cuda_ipc=False)`` or ``$YATT_CUDA_IPC=0``). The
sender decides per message (:func:`ipc_devices`): a tensor on its local GPU ``j`` travels by
IPC only when every destination sees physical GPU ``gpus[j]``, and it is at least
:data:`MIN_BYTES`; anything else takes the host copy (the "CPU fallback" of
:mod:`runtime.codec`). The receiver cannot undo that choice, so it is made where the tensor
is.

**Wire.** One msgpack extension (``_CUDA_IPC``), no pickle: ``[dtype, shape, stride,
storage_offset, physical_gpu, shares]``, where each share is ``[dest, mem_handle,
storage_bytes, storage_offset_bytes, ref_counter_handle, ref_counter_offset, event_handle,
event_sync_required]``, the fields of ``UntypedStorage._share_cuda_()`` (as
``torch.multiprocessing.reductions.reduce_tensor`` uses them) with the sender's local device
replaced by the physical index. The receiver picks the share of its own controller index,
maps the physical GPU to its local ordinal and calls torch's ``rebuild_cuda_tensor``.

**Lifetime.** Each ``_share_cuda_()`` wraps the storage's memory in a ``CudaIPCSentData``
with its own counter (set to 1) in a shared-memory ref-counter file; so the sender shares a
tensor once *per destination*, and each receiver's storage decrements its own counter when
it is freed. When the sender's last reference goes, a block whose counter is not 0 moves to
torch's "limbo" instead of back to the caching allocator; it is freed by the next collect
(torch runs one on every freed shared block, when the allocator runs short, and at
``torch.cuda.ipc_collect()``, which :class:`runtime.zmq.peers.Peers` calls about once a
second once it has sent by IPC). The sender's stream is recorded in an event that the
receiver waits on before using the memory, so the sender need not synchronize. What the
producer must not do: modify a tensor in place after it is sent (the receiver reads the same
memory, and a receiver's in-place write reaches the sender's tensor: treat sent tensors as
read-only on both sides, as the in-process executor shares the object too). A message a
receiver drops without decoding (stale epoch, an edge it does not read) has its counters
decremented all the same (:meth:`IpcReceive.release`, through
:func:`runtime.codec.decode.release_ipc`), without opening the memory, so the sender's
block is freed by its next collect. A tensor that itself arrived by
IPC cannot be shared again (torch refuses), so it is first cloned on its GPU.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from runtime.codec.wire import _CUDA_IPC, DecodeError, _dims_ok

__all__ = [
    "ENV",
    "MIN_BYTES",
    "OPENED",
    "IpcReceive",
    "IpcSend",
    "enabled_from_env",
    "ipc_devices",
    "peer_gpus",
]

ENV = "YATT_CUDA_IPC"
"""``0`` (or ``false``/``off``/``no``) turns CUDA IPC off for a run (the driver reads it)."""

MIN_BYTES = 1 << 16
"""CUDA tensors smaller than this take the host copy: opening an IPC handle costs more than
copying a few KiB (a guess to be measured by bench/gpu_check.py, not a measured figure). Read
when a sender's :class:`IpcSend` is made, so a process may change it before it first sends
(the GPU check's size sweep does)."""

FIX = "turn CUDA IPC off: ZmqExecutor(cuda_ipc=False) or YATT_CUDA_IPC=0"

_encoder = msgspec.msgpack.Encoder()


def enabled_from_env(value: bool | None) -> bool:
    """``ZmqExecutor(cuda_ipc=...)``: a bool wins; None: on unless ``$YATT_CUDA_IPC`` says off."""
    if value is not None:
        return bool(value)
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def peer_gpus(
    cuda: Sequence[Sequence[int]],
    on_host: Sequence[bool],
    *,
    enabled: bool,
    driver_gpus: int,
) -> list[list[int]]:
    """Per controller, the physical GPUs it may take IPC tensors on, in its local-ordinal order
    (a pure function; the driver's half of the decision).

    ``cuda[c]``: controller c's ``Resources.cuda`` (ordinals among the driver's visible GPUs;
    empty: it keeps the driver's environment, so it sees all ``driver_gpus``). ``on_host[c]``:
    the driver started it on its own host. A controller not on the host, or every controller
    when ``enabled`` is false, gets ``[]``.
    """
    if not enabled:
        return [[] for _ in cuda]
    return [
        (list(gpus) if gpus else list(range(driver_gpus))) if here else []
        for gpus, here in zip(cuda, on_host, strict=True)
    ]


def ipc_devices(gpus: Sequence[Sequence[int]], sender: int, dests: Sequence[int]) -> dict[int, int]:
    """The sender's local GPU ordinal -> physical index, for the GPUs that every destination
    sees (a pure function; the sender's half). Empty (everything takes the host copy) when
    the sender or a destination has no GPUs listed, or ``gpus`` is empty (IPC off)."""
    if not 0 <= sender < len(gpus) or not dests:
        return {}
    mine = gpus[sender]
    seen = [set(gpus[d]) if 0 <= d < len(gpus) else set() for d in dests]
    return {j: p for j, p in enumerate(mine) if all(p in s for s in seen)}


@dataclass
class IpcSend:
    """The encoder's side (``encode_value(..., cuda_ipc=)``): which local GPUs may send by IPC
    (local ordinal -> physical index) and to which controllers (one share each)."""

    devices: Mapping[int, int]
    dests: Sequence[int]
    min_bytes: int = field(default_factory=lambda: MIN_BYTES)
    sent: int = 0
    """Tensors sent by IPC so far (the controller calls ipc_collect once this is > 0)."""

    def physical(self, t: Any) -> int | None:
        """The physical GPU of CUDA tensor ``t`` if it may go by IPC, else None."""
        if t.nbytes < self.min_bytes or t.nbytes == 0:
            return None
        return self.devices.get(t.device.index)

    def ext(self, t: Any, name: str, physical: int) -> msgspec.msgpack.Ext:
        """The IPC extension for CUDA tensor ``t`` (detached, strided, dtype ``name``)."""
        try:
            storage = t.untyped_storage()
            shares = [_share(storage, d) for d in self.dests]
        except RuntimeError:  # a tensor that arrived by IPC cannot be shared again (torch)
            t = t.clone()
            storage = t.untyped_storage()
            shares = [_share(storage, d) for d in self.dests]
        self.sent += 1
        fields = [name, list(t.shape), list(t.stride()), t.storage_offset(), physical, shares]
        return msgspec.msgpack.Ext(_CUDA_IPC, _encoder.encode(fields))


def _share(storage: Any, dest: int) -> list[Any]:
    _device, handle, size, offset, ref, ref_offset, event, sync = storage._share_cuda_()
    return [dest, handle, size, offset, ref, ref_offset, event, bool(sync)]


@dataclass
class Opened:
    """What this process has opened by CUDA IPC: tensors, and the bytes of their views (not of
    the whole storages they share). A receiving controller's count tells IPC from the host
    copy, which looks the same to the node (bench/gpu_check.py's IPC rows read it)."""

    tensors: int = 0
    bytes: int = 0

    def add(self, args: Mapping[str, Any]) -> None:
        from runtime.codec.wire import _torch_dtype

        self.tensors += 1
        self.bytes += math.prod(args["size"]) * _torch_dtype(args["dtype"]).itemsize


OPENED = Opened()
"""This process's count (the decoder adds each tensor it opens)."""


@dataclass
class IpcReceive:
    """The decoder's side (``decode_value(..., cuda_ipc=)``): this controller's index (which
    share is its own) and its GPUs as physical indices in local-ordinal order."""

    index: int
    gpus: Sequence[int]
    _local: dict[int, int] = field(default_factory=dict)

    def local(self, physical: int) -> int:
        if not self._local:
            self._local.update({p: j for j, p in enumerate(self.gpus)})
        if physical not in self._local:
            raise DecodeError(
                f"a CUDA IPC tensor on GPU {physical}, which controller {self.index} does not see "
                f"(it sees {list(self.gpus)}); {FIX}"
            )
        return self._local[physical]

    def tensor(self, fields: Any) -> Any:
        """The tensor of an IPC extension's (decoded) fields; DecodeError if it cannot open."""
        args = rebuild_args(fields, self.index, self.local)
        try:
            tensor = _rebuild(args)
            OPENED.add(args)
            return tensor
        except DecodeError:
            raise
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise DecodeError(
                f"cannot open the CUDA IPC handle of a tensor on GPU {fields[4]} "
                f"({type(exc).__name__}: {first}); {FIX}"
            ) from None

    def release(self, fields: Any) -> None:
        """Decrement this controller's counter of an IPC tensor it will not open (its message
        is dropped undecoded), so the sender can free the block; DecodeError if garbage."""
        args = rebuild_args(fields, self.index, lambda physical: physical)
        _release_counter(args["ref_counter"], args["ref_counter_offset"])


def rebuild_args(fields: Any, index: int, local: Any) -> dict[str, Any]:
    """The checked arguments of ``rebuild_cuda_tensor`` (less the classes and dtype object) for
    the share of controller ``index``; ``local(physical)`` is the local ordinal."""
    if not isinstance(fields, list) or len(fields) != 6:
        raise DecodeError(f"bad CUDA IPC header {fields!r:.80}")
    name, shape, stride, offset, physical, shares = fields
    for what, dims in (("shape", shape), ("stride", stride)):
        if not _dims_ok(dims):
            raise DecodeError(f"bad CUDA IPC {what} {dims!r:.80}")
    if len(shape) != len(stride) or type(offset) is not int or offset < 0:
        raise DecodeError("bad CUDA IPC shape/stride/offset")
    if type(physical) is not int or not isinstance(shares, list):
        raise DecodeError("bad CUDA IPC device or shares")
    mine = [s for s in shares if isinstance(s, list) and len(s) == 8 and s[0] == index]
    if len(mine) != 1:
        raise DecodeError(f"a CUDA IPC tensor with no share for controller {index}")
    _, handle, size, soffset, ref, ref_offset, event, sync = mine[0]
    ints = (size, soffset, ref_offset)
    if not all(type(x) is int and 0 <= x < 2**63 for x in ints):
        raise DecodeError("bad CUDA IPC sizes")
    if not (isinstance(handle, bytes) and isinstance(event, bytes) and type(sync) is bool):
        raise DecodeError("bad CUDA IPC handles")
    if not _ref_name_ok(ref):
        raise DecodeError(f"bad CUDA IPC ref-counter handle {ref!r:.60}")
    return dict(
        dtype=name, size=tuple(shape), stride=tuple(stride), offset=offset,
        device=local(physical), handle=handle, storage_bytes=size, storage_offset=soffset,
        ref_counter=ref, ref_counter_offset=ref_offset, event=event, event_sync=sync,
    )  # fmt: skip


def _ref_name_ok(ref: Any) -> bool:
    """A shared-memory object's name as torch makes it (``/torch_...``): one path component,
    so a bad header cannot make the receiver open another file."""
    return (
        isinstance(ref, bytes)
        and 1 < len(ref) < 256
        and ref.startswith(b"/")
        and b"/" not in ref[1:]
        and b"\0" not in ref
    )


def _rebuild(args: dict[str, Any]) -> Any:
    """torch's own rebuild (shared cache, ref counter, event wait) from :func:`rebuild_args`."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from runtime.codec.wire import _torch_dtype

    dtype = _torch_dtype(args["dtype"])
    return rebuild_cuda_tensor(
        torch.Tensor, args["size"], args["stride"], args["offset"], torch.storage.TypedStorage,
        dtype, args["device"], args["handle"], args["storage_bytes"], args["storage_offset"],
        False, args["ref_counter"], args["ref_counter_offset"], args["event"], args["event_sync"],
    )  # fmt: skip


def _release_counter(ref_counter: bytes, offset: int) -> None:
    """What torch's rebuild does for a storage it already holds: one decrement of the
    sender's shared-memory ref counter (no CUDA call)."""
    import torch

    torch.UntypedStorage._release_ipc_counter_cuda(ref_counter, offset)


class Collector:
    """Calls ``torch.cuda.ipc_collect()`` at most once a second once IPC tensors were sent
    (before that it would initialize CUDA in a process that may not use it)."""

    def __init__(self) -> None:
        self._last = time.monotonic()

    def maybe(self, sent: int) -> None:
        if sent and time.monotonic() - self._last >= 1.0:
            import torch

            torch.cuda.ipc_collect()
            self._last = time.monotonic()
