"""Weight updates into a colocated vLLM engine by CUDA IPC, through one reusable staging bucket.

The sender (the rollout's process) keeps one flat ``uint8`` tensor on the engine's GPU
(:class:`StagingBucket`), allocated at the first update and reused by every later one; for
each chunk of an update it copies the tensors into it at :data:`ALIGN`-byte offsets,
synchronizes, and calls the worker's method by name with plain msgpack values: the bucket's
key, its IPC fields (only when the bucket is new to the worker) and per tensor ``[checkpoint
name, dtype, shape, offset]``. The worker (``WeightReceiver`` in
:mod:`nodes.models.vllm_engine`, inside vLLM's worker process) opens the bucket once
(:func:`open_storage`), keeps it, and hands views of it (:func:`views`) to the model's
``load_weights``. ``collective_rpc`` returns after the worker has loaded and synchronized, so
the next chunk may overwrite the bucket. No tensor is pickled and nothing passes through host
memory: the bytes stay on the GPU, one device-to-device copy into the bucket and one from it
into vLLM's parameters.

The IPC fields are those of ``UntypedStorage._share_cuda_()``, as
``torch.multiprocessing.reductions.reduce_tensor`` takes them, opened with torch's own
``rebuild_cuda_tensor``, with the GPU named by its UUID (the engine's process narrows
``CUDA_VISIBLE_DEVICES``, so the two processes number the GPU differently). The data plane's
counterpart between controllers is ``runtime/codec/cuda_ipc.py`` (which ``nodes/`` may not
import); the few torch calls here mirror it.

A tensor larger than the bucket's size (``bucket_mb``) goes alone in a chunk, and the bucket
grows to hold it: every tensor takes the same path. The bucket stays on the GPU for the
engine's life.

The functions that touch CUDA (:func:`cuda_ready`, :func:`allocate`, :func:`share_storage`,
:func:`open_storage`, :func:`synchronize`) are the seam the CPU tests replace.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from nodes.models.flat import aligned, nbytes, view

__all__ = ["ALIGN", "IpcSender", "StagingBucket", "chunks", "ipc_unavailable_reason", "views"]

ALIGN = 256
"""Every tensor starts at a multiple of this many bytes of the bucket (so that a view of any
dtype is aligned, as CUDA's allocator aligns its blocks)."""


# --- the CUDA seam ----------------------------------------------------------------------------
def cuda_ready() -> bool:
    """Whether this process can put the bucket on a GPU."""
    return torch.cuda.is_available()


def allocate(nbytes: int, device: torch.device) -> Tensor:
    """A new bucket: ``uint8[nbytes]`` on ``device``."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device ``index`` (the same string in every process)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def local_ordinal(uuid: str) -> int:
    """This process's ordinal of the GPU with ``uuid``; RuntimeError if it sees no such GPU."""
    count = torch.cuda.device_count()
    for index in range(count):
        if device_uuid(index) == uuid:
            return index
    raise RuntimeError(f"no GPU with UUID {uuid} among the {count} this process sees")


def share_storage(bucket: Tensor) -> list[Any]:
    """The IPC fields of the bucket's storage, as plain values: ``[device UUID, handle,
    storage bytes, storage offset bytes, ref-counter handle, ref-counter offset, event handle,
    event sync required]`` (``_share_cuda_()``'s, the device as its UUID)."""
    _device, handle, size, offset, ref, ref_offset, event, sync = (
        bucket.untyped_storage()._share_cuda_()
    )
    uuid = device_uuid(bucket.device.index)
    return [uuid, handle, size, offset, ref, ref_offset, event, bool(sync)]


def open_storage(fields: Sequence[Any]) -> Tensor:
    """The bucket :func:`share_storage` described, opened in this process (``uint8``, the whole
    storage); ValueError for fields of another form, RuntimeError if CUDA cannot open it."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not isinstance(fields, list | tuple) or len(fields) != 8:
        raise ValueError(f"bad CUDA IPC fields {fields!r:.80}")
    uuid, handle, size, offset, ref, ref_offset, event, sync = fields
    ints = (size, offset, ref_offset)
    if not (isinstance(uuid, str) and all(type(x) is int and x >= 0 for x in ints)):
        raise ValueError(f"bad CUDA IPC fields {fields!r:.80}")
    if not all(isinstance(b, bytes) for b in (handle, ref, event)) or type(sync) is not bool:
        raise ValueError("bad CUDA IPC handles")
    return rebuild_cuda_tensor(
        torch.Tensor, (size,), (1,), 0, torch.storage.TypedStorage, torch.uint8,
        local_ordinal(uuid), handle, size, offset, False, ref, ref_offset, event, sync,
    )  # fmt: skip


def synchronize(devices: set[torch.device]) -> None:
    """Wait for the copies on each CUDA device of ``devices``."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def ipc_unavailable_reason(device: torch.device, tensor_parallel_size: int) -> str | None:
    """Why an engine's weight updates cannot go by CUDA IPC (None when they can)."""
    if tensor_parallel_size != 1:
        return f"tensor_parallel_size={tensor_parallel_size}: each rank loads its own shard"
    if device.type != "cuda" or not cuda_ready():
        return "no CUDA device in this process"
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        return "VLLM_ENABLE_V1_MULTIPROCESSING=0 runs vLLM's worker in this process"
    return None


# --- chunks and the bucket ------------------------------------------------------------------
Chunk = list[tuple[str, Tensor, int]]
"""``(checkpoint name, tensor, byte offset in the bucket)`` of one call."""


def chunks(items: Sequence[tuple[str, Tensor]], bucket_bytes: int) -> list[Chunk]:
    """The update cut into chunks of at most ``bucket_bytes`` (a larger tensor goes alone),
    each tensor at an aligned offset."""
    out: list[Chunk] = []
    chunk: Chunk = []
    used = 0
    for name, tensor in items:
        size = nbytes(tensor)
        if chunk and aligned(used, ALIGN) + size > bucket_bytes:
            out.append(chunk)
            chunk, used = [], 0
        offset = aligned(used, ALIGN)
        chunk.append((name, tensor, offset))
        used = offset + size
    if chunk:
        out.append(chunk)
    return out


def _end(chunk: Chunk) -> int:
    name, tensor, offset = chunk[-1]
    return offset + nbytes(tensor)


class StagingBucket:
    """The sender's bucket on the engine's GPU: allocated once, grown only when a chunk needs
    more, and shared with the worker once per allocation."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tensor: Tensor | None = None
        self.allocations = 0
        """How many buckets were made (a new one is shared with the worker again)."""
        self._shared = False

    @property
    def key(self) -> str:
        """Names this allocation, so the worker knows whether it has it open."""
        return f"{os.getpid()}:{id(self)}:{self.allocations}"

    def reserve(self, parts: Sequence[Chunk]) -> None:
        """Make sure the bucket holds the largest of an update's chunks (a new allocation only
        when it does not: the first update, or one with a larger tensor than any before)."""
        need = max(aligned(_end(chunk), ALIGN) for chunk in parts)
        if self.tensor is None or self.tensor.numel() < need:
            self.tensor = None  # (the old one first: the GPU may not hold both)
            self.tensor = allocate(need, self.device)
            self.allocations += 1
            self._shared = False

    def fill(self, chunk: Chunk) -> tuple[list[Any], list[list[Any]]]:
        """Copy ``chunk`` into the (reserved) bucket and wait for the copies; returns the
        bucket's ``[key, IPC fields or None]`` (the fields only when the worker has not opened
        this allocation) and a ``[name, dtype, shape, offset]`` row per tensor."""
        assert self.tensor is not None and self.tensor.numel() >= _end(chunk)
        rows, devices = [], {self.tensor.device}
        for name, tensor, offset in chunk:
            if nbytes(tensor):
                view(self.tensor, offset, tensor.dtype, tensor.shape).copy_(tensor.detach())
                devices.add(tensor.device)
            dtype = str(tensor.dtype).removeprefix("torch.")
            rows.append([name, dtype, list(tensor.shape), offset])
        synchronize(devices)
        fields = None if self._shared else share_storage(self.tensor)
        self._shared = True
        return [self.key, fields], rows

    def release(self) -> None:
        """Free the bucket (the engine no longer sends by IPC)."""
        self.tensor = None


class IpcSender:
    """The engine's side: whether its updates go by IPC, its bucket, and the fall back to the
    bytes path (once, for the engine's life, said in one line on stderr)."""

    def __init__(self, device: torch.device, tensor_parallel_size: int, who: str) -> None:
        self.on = ipc_unavailable_reason(device, tensor_parallel_size) is None
        self.bucket = StagingBucket(device)
        self.who = who

    def send(
        self,
        items: list[tuple[str, Tensor]],
        bucket_bytes: int,
        call: Callable[[list[Any], list[list[Any]]], list[Any]],
        add: Callable[[int, list[str] | None], None],
    ) -> list[tuple[str, Tensor]]:
        """Send ``items`` a chunk at a time: fill the bucket, then ``call(bucket, rows)`` (the
        worker's method; its replies), whose first reply goes to ``add(count, names)``.
        Returns what is left for the bytes path: nothing, or every chunk from the one that
        could not go by IPC on."""
        parts = chunks(items, bucket_bytes)
        for i, chunk in enumerate(parts):
            try:
                if i == 0:
                    self.bucket.reserve(parts)
                bucket, rows = self.bucket.fill(chunk)
            except RuntimeError as exc:  # no memory for it, or a storage CUDA cannot share
                return self._fall_back(first_line(exc), parts[i:])
            replies = call(bucket, rows)
            count, names = replies[0] if replies else (0, None)
            if count is None:  # the worker could not open the bucket: it loaded nothing
                return self._fall_back(str(names), parts[i:])
            add(count, names)
        return []

    def _fall_back(self, why: str, parts: list[Chunk]) -> list[tuple[str, Tensor]]:
        self.on = False
        self.bucket.release()
        print(
            f"{self.who}: weight updates go to vLLM as bytes through the engine core from now "
            f"on: CUDA IPC of the staging bucket failed ({why})",
            file=sys.stderr,
        )
        return [(name, tensor) for chunk in parts for name, tensor, _ in chunk]


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, for a one-line report."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def views(bucket: Tensor, rows: Sequence[Sequence[Any]]) -> list[tuple[str, Tensor]]:
    """The tensors of one chunk: views of the opened ``bucket`` at the rows' offsets."""
    out = []
    for name, dtype, shape, offset in rows:
        dt = getattr(torch, str(dtype), None)
        if not isinstance(dt, torch.dtype) or type(offset) is not int or offset < 0:
            raise ValueError(f"bad bucket row {[name, dtype, shape, offset]!r:.80}")
        end = offset + math.prod(shape) * dt.itemsize
        if end > bucket.numel():
            raise ValueError(f"{name!r} ends past the bucket ({end} > {bucket.numel()})")
        out.append((str(name), view(bucket, offset, dt, shape)))
    return out
