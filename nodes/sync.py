"""Weight sync: publish the updated policy weights to a rollout node, with a version.

``WeightSync`` sits between the update node and the rollout node's ``weights`` input::

    in:  state    ANY  a state dict {name: tensor} (or a dict holding one under ``key``,
                       or an ``nn.Module``)
    out: weights  ANY  a :class:`WeightUpdate` (same process) or a :class:`WirePayload`
                       (``mode="wire"``, for a runtime that ships it to another process)

A :class:`WeightUpdate` is a msgspec Struct: ``weights`` (``dict[str, Tensor]``), ``version``
(1, 2, ... per publish; a consumer skips anything not newer than what it has) and ``complete``
(False when only some keys were sent: load it with ``strict=False``). Being a Struct, it
crosses controllers whole: the receiver's codec rebuilds it because every node that reads
weights imports this module. :func:`apply_weights` does all of that for a consumer.

A :class:`WirePayload` carries ``header`` (msgpack bytes) and ``buffers`` (raw tensor bytes, one
per tensor, zero-copy where possible): no pickle, the same tensor encoding as
:class:`nodes.batch.SampleBatch`. :func:`state_dict_to_wire` / :func:`state_dict_from_wire` are
the same encoding without the node.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import torch

from nodes.batch import WIRE_FORMAT, TensorMeta, _dtype_name, tensor_from_buffer, tensor_to_buffer
from yatt_graph import ANY, Node, Port

__all__ = [
    "StateHeader",
    "WeightSync",
    "WeightUpdate",
    "WirePayload",
    "apply_weights",
    "decode_weights",
    "state_dict_from_wire",
    "state_dict_to_wire",
]


class StateHeader(msgspec.Struct, array_like=True, frozen=True, tag="state"):
    """The msgpack header of a state dict on the wire."""

    version: int
    complete: bool
    tensors: list[TensorMeta]
    format: int = WIRE_FORMAT


class WeightUpdate(msgspec.Struct, frozen=True):
    """A published state dict with its version: a typed value, so that the data-plane codec
    carries ``version`` and ``complete`` exactly between controllers."""

    weights: dict[str, torch.Tensor]
    """name -> tensor, the keys that were sent."""
    version: int
    """1, 2, ... per publish; a consumer skips anything not newer than what it has."""
    complete: bool = True
    """False when only some keys were sent: the consumer loads them with ``strict=False``."""

    def __repr__(self) -> str:
        return (
            f"WeightUpdate(version={self.version}, complete={self.complete}, "
            f"{len(self.weights)} tensors)"
        )


class WirePayload:
    """A state dict encoded for another process: send ``header`` then each of ``buffers``."""

    __slots__ = ("buffers", "header", "version")

    def __init__(self, header: bytes, buffers: list[Any], version: int):
        self.header, self.buffers, self.version = header, buffers, version

    def __repr__(self) -> str:
        size = sum(memoryview(b).nbytes for b in self.buffers)
        return f"WirePayload(version={self.version}, {len(self.buffers)} buffers, {size} bytes)"


def _check_state(state: Mapping[str, Any], where: str) -> None:
    for k, v in state.items():
        if not isinstance(k, str):
            raise ValueError(f"{where}: state dict key {k!r} is not a string")
        if not isinstance(v, torch.Tensor):
            raise ValueError(
                f"{where}: state dict entry {k!r} is a {type(v).__name__}; only tensors can be "
                "synced (drop it, or keep non-tensor state out of the weights)"
            )


def state_dict_to_wire(
    state: Mapping[str, torch.Tensor], *, version: int = 0, complete: bool = True
) -> tuple[bytes, list[memoryview]]:
    """Encode a state dict as ``(header, buffers)``; any dtype and any shape (0-d included).

    Contiguous CPU tensors are not copied: the buffers are views of their memory, so a payload
    must be sent before those tensors change in place (:class:`WeightSync` snapshots by default).
    """
    _check_state(state, "state_dict_to_wire")
    buffers: list[memoryview] = []
    metas = []
    for name, t in state.items():
        buffers.append(tensor_to_buffer(t))
        metas.append(TensorMeta(name, _dtype_name(t.dtype), tuple(t.shape), len(buffers) - 1))
    return msgspec.msgpack.encode(StateHeader(version, complete, metas)), buffers


def state_dict_from_wire(
    header: bytes | memoryview, buffers: Sequence[Any], *, copy: bool = False
) -> WeightUpdate:
    """Decode what :func:`state_dict_to_wire` made (tensors share writable buffers unless
    ``copy``; read-only buffers are copied)."""
    try:
        head = msgspec.msgpack.decode(header, type=StateHeader)
    except msgspec.DecodeError as exc:
        raise ValueError(
            f"state_dict_from_wire: the header is not a state-dict header ({exc})"
        ) from exc
    if head.format != WIRE_FORMAT:
        raise ValueError(
            f"state_dict_from_wire: wire format {head.format} is not this version's {WIRE_FORMAT}"
        )
    if len(buffers) != len(head.tensors):
        raise ValueError(
            f"state_dict_from_wire: the header lists {len(head.tensors)} tensors but "
            f"{len(buffers)} buffers were given"
        )
    state = {
        m.name: tensor_from_buffer(
            buffers[m.buffer],
            m.dtype,
            m.shape,
            copy=copy,
            where=f"state_dict_from_wire: {m.name!r}",
        )
        for m in head.tensors
    }
    return WeightUpdate(state, head.version, head.complete)


def decode_weights(weights: Any) -> WeightUpdate:
    """A :class:`WeightUpdate` from whatever reached a consumer's ``weights`` input: a
    WeightUpdate, a :class:`WirePayload`, a ``(header, buffers)`` pair, or a plain state dict
    (version 0, complete)."""
    if isinstance(weights, WeightUpdate):
        return weights
    if isinstance(weights, WirePayload):
        return state_dict_from_wire(weights.header, weights.buffers)
    if isinstance(weights, tuple) and len(weights) == 2:
        return state_dict_from_wire(*weights)
    if isinstance(weights, Mapping):
        _check_state(weights, "decode_weights")
        return WeightUpdate(dict(weights), version=0, complete=True)
    raise TypeError(f"decode_weights: cannot read weights from a {type(weights).__name__}")


def apply_weights(
    module: torch.nn.Module, weights: Any, *, last_version: int | None = None
) -> int | None:
    """Load ``weights`` into ``module`` unless they are not newer than ``last_version``.

    Returns the version now loaded (``last_version`` when skipped). A complete update loads
    strictly; a partial one (``complete=False``) loads only its keys, and an unknown key is
    still an error.
    """
    update = decode_weights(weights)
    if last_version is not None and update.version <= last_version:
        return last_version
    missing, unexpected = module.load_state_dict(update.weights, strict=False)
    if unexpected or (update.complete and missing):
        raise ValueError(
            f"apply_weights: weights version {update.version} do not fit the module: unexpected "
            f"keys {sorted(unexpected)[:8]}, missing keys {sorted(missing)[:8] if update.complete else []}"
        )
    return update.version


class WeightSync(Node):
    """Publishes updated policy weights, with a version, for a rollout node to load.

    Args:
        mode: ``"local"`` (a :class:`WeightUpdate` for a consumer in this process) or ``"wire"``
            (a :class:`WirePayload` for another process; no pickle).
        key: take the state dict from ``state[key]`` (e.g. ``"model"``) instead of ``state``.
        include: regexes (``re.search``); only keys matching one are sent (e.g. LoRA adapters,
            the trainable part). The update is then partial (``complete=False``).
        only_changed: send only tensors that differ from the last publish (keeps one copy of
            the last published weights); partial unless everything changed.
        dtype: cast floating tensors to this dtype before publishing (e.g. ``"bfloat16"`` to
            halve the bytes); None keeps each tensor's dtype.
        snapshot: copy the tensors at publish time, so that later in-place optimizer steps do not
            change an already published version. Turn off only when the consumer always loads
            before the next update (and with ``mode="local"`` the consumer then shares memory).
    """

    kind = "sync"
    inputs = {"state": Port(ANY, doc="the updated state dict (name -> tensor)")}
    outputs = {"weights": Port(ANY, doc="WeightUpdate or WirePayload, with a version")}

    def __init__(
        self,
        mode: str = "local",
        *,
        key: str | None = None,
        include: Sequence[str] | None = None,
        only_changed: bool = False,
        dtype: str | None = None,
        snapshot: bool = True,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        if mode not in ("local", "wire"):
            raise ValueError(f"node {self.name!r}: mode must be 'local' or 'wire', got {mode!r}")
        if dtype is not None and not (
            isinstance(getattr(torch, dtype, None), torch.dtype)
            and getattr(torch, dtype).is_floating_point
        ):
            raise ValueError(f"node {self.name!r}: dtype {dtype!r} is not a floating torch dtype")
        self.mode, self.key, self.only_changed, self.snapshot = mode, key, only_changed, snapshot
        self.dtype = None if dtype is None else getattr(torch, dtype)
        self.include = [re.compile(p) for p in (include or [])]
        self.version = 0
        self._last: dict[str, torch.Tensor] = {}

    def _state_of(self, state: Any) -> Mapping[str, torch.Tensor]:
        if isinstance(state, torch.nn.Module):
            state = state.state_dict()
        if self.key is not None:
            if not isinstance(state, Mapping) or self.key not in state:
                keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
                raise ValueError(
                    f"node {self.name!r}: input 'state' has no key {self.key!r} ({keys})"
                )
            state = state[self.key]
        if not isinstance(state, Mapping):
            raise ValueError(
                f"node {self.name!r}: input 'state' must be a state dict (name -> tensor), got "
                f"{type(state).__name__}"
            )
        _check_state(state, f"node {self.name!r}: input 'state'")
        return state

    def forward(self, state: Any) -> dict[str, Any]:
        full = self._state_of(state)
        out: dict[str, torch.Tensor] = {}
        for k, t in full.items():
            if self.include and not any(p.search(k) for p in self.include):
                continue
            t = t.detach()
            if self.dtype is not None and t.is_floating_point():
                t = t.to(self.dtype)
            if self.only_changed and k in self._last and _same(self._last[k], t):
                continue
            out[k] = t.clone() if self.snapshot else t
        if self.only_changed:
            self._last.update({k: t.clone() for k, t in out.items()})
        complete = len(out) == len(full)
        self.version += 1
        if self.mode == "local":
            return {"weights": WeightUpdate(out, self.version, complete)}
        header, buffers = state_dict_to_wire(out, version=self.version, complete=complete)
        return {"weights": WirePayload(header, buffers, self.version)}

    def state_dict(self) -> dict[str, Any]:
        # The version survives a checkpoint, so that consumers never see it go backwards.
        return {"version": self.version}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.version = int(state.get("version", 0))
        self._last = {}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (NaN == NaN), same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a_bytes = a.contiguous().reshape(-1).view(torch.uint8)  # (numel * itemsize,)
    b_bytes = b.contiguous().reshape(-1).view(torch.uint8).to(a.device)  # (numel * itemsize,)
    return bool(torch.equal(a_bytes, b_bytes))
