"""A model node's state off its device and back, when roles take turns on the device.

Under colocated placement the roles of a step (rollout, reference, critic, reward, update)
share a GPU and take turns. When an executor offloads a node (:meth:`Node.offload`), its
modules' parameters, gradients and buffers and its optimizers' state tensors move to host
memory (one flat buffer per part, page-locked when CUDA is there, allocated at the first
offload and reused by every later one: :class:`HostBuffer`; copied with ``non_blocking``
and then synchronized), and the freed blocks go back to the driver
(``torch.cuda.empty_cache()``) so the next role, in this process or another, can use them;
:meth:`Node.reload` brings them back to where they were.
State that is already on the CPU stays where it is (nothing moves; see :data:`ALWAYS_COPY`).

Everything is moved in place: a ``Parameter`` keeps its identity (only its ``.data`` moves),
so an optimizer, a shared module or a closure that holds it stays valid.

Nodes of one process may share a module (:mod:`nodes.shared_models`: a rollout and an update
on one policy). Each part (a module or an optimizer) counts the nodes that hold it: it leaves
the device when the last of them is offloaded, and comes back when any of them is reloaded. A
node counts as a holder from its first ``offload()`` or ``reload()`` on; an executor reloads
each node once before the first switch (a no-op that registers it).

:class:`Offload` is the mixin model nodes take: its parts are the ``nn.Module`` and
``Optimizer`` values among the node's attributes (what ``build()`` set).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from nodes.models.flat import layout, nbytes, view

__all__ = [
    "ALWAYS_COPY",
    "HostBuffer",
    "Offload",
    "claim_node",
    "move",
    "offload_node",
    "parts_of",
    "reload_node",
]

ALWAYS_COPY = False
"""Tests: move state that is on the CPU too (a copy into fresh CPU tensors and back), so the
bookkeeping runs on a machine without a GPU."""

_HOST = torch.device("cpu")


def _to(t: Tensor, device: torch.device, copy: bool) -> Tensor:
    """``t`` on ``device`` (a fresh tensor, with ``copy``, when it is there already)."""
    if t.device == device and not copy:
        return t
    if device.type == "cpu":
        return t.clone() if t.device.type == "cpu" else t.to(device)
    return t.to(device, non_blocking=True)


_ALIGN = 64


def _allocate(nbytes: int, pin: bool) -> Tensor:
    """``nbytes`` of host memory, page-locked with ``pin``. Registered with CUDA as it is
    (``cudaHostRegister``) rather than taken from torch's pinned allocator, which rounds every
    request up to a power of two and keeps the blocks it hands back."""
    flat = torch.empty(nbytes, dtype=torch.uint8)
    if pin and nbytes:
        err = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"offload: cudaHostRegister of {nbytes} bytes failed ({err})")
    return flat


def _release(flat: Tensor, pinned: bool) -> None:
    if pinned and flat.numel():
        torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())


class HostBuffer:
    """One flat host allocation that a part's tensors are offloaded into, each a view of it
    (page-locked when they come from CUDA, so the copies run ``non_blocking``). Allocated at
    the part's first offload and reused by every later one; a new one replaces it only when
    the part has grown (gradients or an optimizer's state made after its first offload)."""

    def __init__(self) -> None:
        self.flat: Tensor | None = None
        self.pinned = False
        self.allocations = 0
        """How many times a buffer was allocated (1 in a steady run)."""

    def views(self, tensors: list[Tensor], pin: bool) -> list[Tensor]:
        """A view of the buffer for each of ``tensors`` (its dtype and shape, contiguous),
        each at an offset aligned to 64 bytes, in order."""
        offsets, end = layout(tensors, _ALIGN)
        if self.flat is None or self.flat.numel() < end or (pin and not self.pinned):
            self.close()
            self.flat, self.pinned = _allocate(end, pin), pin
            self.allocations += 1
        flat = self.flat
        return [view(flat, o, t.dtype, t.shape) for o, t in zip(offsets, tensors)]

    def close(self) -> None:
        """Hand the buffer back (nothing may view it any more)."""
        if self.flat is not None:
            _release(self.flat, self.pinned)
            self.flat, self.pinned = None, False

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (at interpreter exit CUDA may be gone)
            self.close()


Homes = dict[Any, torch.device]
"""Where each moved tensor was (by parameter id, (module id, buffer name) or (param id, state
key)): what :func:`move` with ``homes`` puts back."""


@dataclass
class _Job:
    """One tensor to move, where to, and every place that holds it."""

    key: Any
    tensor: Tensor
    dest: torch.device
    puts: list[Any]


def move(
    part: Any, device: torch.device | str | None = None, *, homes: Homes | None = None,
    copy: bool = False, host: HostBuffer | None = None,
) -> tuple[int, Homes]:  # fmt: skip
    """Move a module's parameters, gradients and buffers, or an optimizer's state tensors,
    in place: to ``device`` (those not there yet, or all with ``copy``), or, given ``homes``
    (what an earlier call returned), each back to where it was (an optimizer's state: beside
    its parameter, so move the modules first). What goes to the host goes into views of
    ``host`` when given (one allocation, reused), else into fresh tensors. Returns the bytes
    moved and the homes of what moved. Call :func:`settle` after a batch of moves."""
    target = None if device is None else torch.device(device)
    jobs: list[_Job] = []

    def where(key: Any, t: Tensor) -> torch.device | None:
        if homes is not None:
            return homes.get(key)
        assert target is not None
        return target if copy or t.device != target else None

    if isinstance(part, nn.Module):
        seen: dict[int, _Job | None] = {}  # a tensor shared by two modules moves once
        for m in part.modules():
            for p in m._parameters.values():
                if p is None or id(p) in seen:
                    continue
                dest = where(id(p), p.data)
                seen[id(p)] = None
                if dest is None:
                    continue
                jobs.append(_Job(id(p), p.data, dest, [lambda t, p=p: setattr(p, "data", t)]))
                if p.grad is not None:
                    jobs.append(_Job(None, p.grad, dest, [lambda t, p=p: setattr(p, "grad", t)]))
            for name, b in m._buffers.items():
                if b is None:
                    continue

                def put(t: Tensor, m: nn.Module = m, name: str = name) -> None:
                    m._buffers[name] = t

                if id(b) in seen:
                    job = seen[id(b)]
                    if job is not None:
                        job.puts.append(put)
                    continue
                dest = where((id(m), name), b)
                seen[id(b)] = job = None if dest is None else _Job((id(m), name), b, dest, [put])
                if job is not None:
                    jobs.append(job)
    elif isinstance(part, torch.optim.Optimizer):
        for p, state in part.state.items():
            for key, value in state.items():
                # Adam's ``step`` counter lives on the CPU unless capturable: it stays there.
                if not isinstance(value, Tensor) or (value.dim() == 0 and key == "step"):
                    continue
                if homes is not None:  # back beside its parameter (even state made meanwhile)
                    again = copy and (id(p), key) in homes
                    dest = p.device if again or value.device != p.device else None
                else:
                    dest = where((id(p), key), value)
                if dest is not None:
                    put = lambda t, state=state, key=key: state.__setitem__(key, t)  # noqa: E731
                    jobs.append(_Job((id(p), key), value, dest, [put]))
    else:
        raise TypeError(f"move: expected an nn.Module or an Optimizer, got {type(part).__name__}")

    into: dict[int, Tensor] = {}
    if host is not None:
        out_jobs = [j for j in jobs if j.dest.type == "cpu"]
        pin = any(j.tensor.device.type == "cuda" for j in out_jobs)
        views = host.views([j.tensor for j in out_jobs], pin) if out_jobs else []
        into = {id(j): v for j, v in zip(out_jobs, views)}
    moved, out = 0, {}
    for job in jobs:
        t = job.tensor
        view = into.get(id(job))
        new = view.copy_(t, non_blocking=True) if view is not None else _to(t, job.dest, copy)
        for put in job.puts:
            put(new)
        if job.key is not None:
            out[job.key] = t.device
        moved += nbytes(t)
    return moved, out


def settle(homes: Iterable[Homes], offloaded: bool) -> None:
    """After moves touching CUDA: wait for the copies, and hand freed blocks back after an
    offload (so another process on the device can use them)."""
    if any(d.type == "cuda" for h in homes for d in h.values()):
        torch.cuda.synchronize()
        if offloaded:
            torch.cuda.empty_cache()


def parts_of(node: Any) -> list[Any]:
    """The modules and optimizers among a node's attributes (each once, in attribute order)."""
    seen: set[int] = set()
    parts = []
    for value in vars(node).values():
        if isinstance(value, nn.Module | torch.optim.Optimizer) and id(value) not in seen:
            seen.add(id(value))
            parts.append(value)
    return parts


@dataclass
class _Entry:
    holders: dict[int, bool] = field(default_factory=dict)
    """Node id -> whether that node wants the part on its device."""
    homes: Homes | None = None
    """Where the moved tensors were, while the part is off its device (None: it is on it)."""
    host: HostBuffer = field(default_factory=HostBuffer)
    """Where the part's tensors wait on the host: one allocation, reused at every offload."""


_entries: weakref.WeakKeyDictionary[Any, _Entry] = weakref.WeakKeyDictionary()


def _entries_of(node: Any) -> Iterator[tuple[Any, _Entry]]:
    """Each part of a node with its entry (made on first sight)."""
    for part in parts_of(node):
        yield part, _entries.setdefault(part, _Entry())


def offload_node(node: Any) -> int:
    """Offload a node's parts that no other resident node holds; bytes moved. Idempotent: a
    part already off its device (``homes`` set) does not move again."""
    if not node.is_set_up:
        return 0
    moved, all_homes = 0, []
    for part, entry in _entries_of(node):
        entry.holders[id(node)] = False
        if entry.homes is None and not any(entry.holders.values()):
            n, entry.homes = move(part, _HOST, copy=ALWAYS_COPY, host=entry.host)
            moved += n
            all_homes.append(entry.homes)
    settle(all_homes, offloaded=True)
    return moved


def reload_node(node: Any) -> int:
    """Bring a node's parts back to their devices; bytes moved. Idempotent."""
    if not node.is_set_up:
        return 0
    moved, all_homes = 0, []
    # modules first: an optimizer's state goes back beside its parameters
    pairs = sorted(_entries_of(node), key=lambda pe: isinstance(pe[0], torch.optim.Optimizer))
    for part, entry in pairs:
        entry.holders[id(node)] = True
        if entry.homes is not None:
            n, _ = move(part, homes=entry.homes, copy=ALWAYS_COPY)
            moved += n
            all_homes.append(entry.homes)
            entry.homes = None
    settle(all_homes, offloaded=False)
    return moved


def claim_node(node: Any) -> None:
    """Mark a node as needing its parts, moving nothing (:meth:`Node.claim`): a part it
    shares stays on the device when its other holders are offloaded before its reload."""
    if node.is_set_up:
        for _, entry in _entries_of(node):
            entry.holders[id(node)] = True


class Offload:
    """Mixin of model nodes: :meth:`offload` / :meth:`reload` move the modules and optimizers
    that ``build()`` set (:func:`parts_of`); see the module docstring."""

    def offload(self) -> int:
        moved = offload_node(self)
        super().offload()  # type: ignore[misc]  # (mixins after it drop what they hold)
        return moved

    def reload(self) -> int:
        return reload_node(self)

    def claim(self) -> None:
        claim_node(self)
