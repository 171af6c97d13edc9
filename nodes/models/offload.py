"""A model node's state off its device and back, when roles take turns on the device.

Under colocated placement the roles of a step (rollout, reference, critic, reward, update)
share a GPU and take turns. When an executor offloads a node (:meth:`Node.offload`), its
modules' parameters, gradients and buffers and its optimizers' state tensors move to host
memory (pinned when CUDA is there, copied with ``non_blocking`` and then synchronized), and
the freed blocks go back to the driver (``torch.cuda.empty_cache()``) so the next role, in this
process or another, can use them; :meth:`Node.reload` brings them back to where they were.
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

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "ALWAYS_COPY",
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
    """``t`` on ``device``: pinned host memory for a CUDA tensor going to the CPU."""
    if device.type == "cpu":
        if t.device.type == "cpu":
            return t.clone() if copy else t
        out = torch.empty(t.size(), dtype=t.dtype, device=_HOST, pin_memory=True)
        return out.copy_(t, non_blocking=True)
    if t.device == device and not copy:
        return t
    return t.to(device, non_blocking=True)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


Homes = dict[Any, torch.device]
"""Where each moved tensor was (by parameter id, (module id, buffer name) or (param id, state
key)): what :func:`move` with ``homes`` puts back."""


def move(
    part: Any, device: torch.device | str | None = None, *, homes: Homes | None = None,
    copy: bool = False,
) -> tuple[int, Homes]:  # fmt: skip
    """Move a module's parameters, gradients and buffers, or an optimizer's state tensors,
    in place: to ``device`` (those not there yet, or all with ``copy``), or, given ``homes``
    (what an earlier call returned), each back to where it was (an optimizer's state: beside
    its parameter, so move the modules first). Returns the bytes moved and
    the homes of what moved. Call :func:`settle` after a batch of moves."""
    target = None if device is None else torch.device(device)
    moved, out = 0, {}

    def where(key: Any, t: Tensor) -> torch.device | None:
        if homes is not None:
            return homes.get(key)
        assert target is not None
        return target if copy or t.device != target else None

    if isinstance(part, nn.Module):
        done: dict[int, Tensor] = {}  # a tensor shared by two modules moves once
        for m in part.modules():
            for p in m._parameters.values():
                if p is None or id(p) in done:
                    continue
                done[id(p)] = p
                dest = where(id(p), p.data)
                if dest is None:
                    continue
                out[id(p)] = p.data.device
                p.data = _to(p.data, dest, copy)
                moved += _nbytes(p.data)
                if p.grad is not None:
                    p.grad = _to(p.grad, dest, copy)
                    moved += _nbytes(p.grad)
            for name, b in m._buffers.items():
                if b is None:
                    continue
                if id(b) in done:
                    m._buffers[name] = done[id(b)]
                    continue
                dest = where((id(m), name), b)
                if dest is None:
                    done[id(b)] = b
                    continue
                out[(id(m), name)] = b.device
                m._buffers[name] = done[id(b)] = _to(b, dest, copy)
                moved += _nbytes(b)
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
                if dest is None:
                    continue
                out[(id(p), key)] = value.device
                state[key] = _to(value, dest, copy)
                moved += _nbytes(value)
    else:
        raise TypeError(f"move: expected an nn.Module or an Optimizer, got {type(part).__name__}")
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
            n, entry.homes = move(part, _HOST, copy=ALWAYS_COPY)
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
        return offload_node(self)

    def reload(self) -> int:
        return reload_node(self)

    def claim(self) -> None:
        claim_node(self)
