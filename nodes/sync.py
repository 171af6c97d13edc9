"""Weight sync: publish the updated policy weights to a rollout node, with a version.

``WeightSync`` sits between the update node and the rollout node's ``weights`` input::

    in:  state    ANY  a state dict {name: tensor} (or a dict holding one under ``key``,
                       an ``nn.Module``, or an update node's :class:`WeightUpdate`)
    out: weights  ANY  a :class:`WeightUpdate`

A :class:`WeightUpdate` is a msgspec Struct: ``weights`` (``dict[str, Tensor]``), ``version``
(1, 2, ... per publish; a consumer skips anything not newer than what it has) and ``complete``
(False when only some keys were sent: load it with ``strict=False``). Being a Struct, it
crosses controllers whole, through the runtime's one data-plane codec (no pickle): the
receiver rebuilds it because every node that reads weights imports this module.
:func:`apply_weights` loads one into a module; :class:`WeightInput` is a consumer node's side
(the rollout's, the critic's): load a payload once, and only when it is newer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import torch

from nodes.models.policy_base import load_checked
from yatt_graph import ANY, Node, Port

__all__ = ["WeightInput", "WeightSync", "WeightUpdate", "apply_weights", "decode_weights"]


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


def _check_state(state: Mapping[str, Any], where: str) -> None:
    for k, v in state.items():
        if not isinstance(k, str):
            raise ValueError(f"{where}: state dict key {k!r} is not a string")
        if not isinstance(v, torch.Tensor):
            raise ValueError(
                f"{where}: state dict entry {k!r} is a {type(v).__name__}; only tensors can be "
                "synced (drop it, or keep non-tensor state out of the weights)"
            )


def decode_weights(weights: Any) -> WeightUpdate:
    """A :class:`WeightUpdate` from whatever reached a consumer's ``weights`` input: a
    WeightUpdate, or a plain state dict (version 0, complete)."""
    if isinstance(weights, WeightUpdate):
        return weights
    if isinstance(weights, Mapping):
        _check_state(weights, "decode_weights")
        return WeightUpdate(dict(weights), version=0, complete=True)
    raise TypeError(f"decode_weights: cannot read weights from a {type(weights).__name__}")


def apply_weights(
    module: torch.nn.Module, weights: Any, *, last_version: int | None = None
) -> int | None:
    """Load ``weights`` into ``module`` unless they are not newer than ``last_version``.

    Returns the version now loaded (``last_version`` when skipped). A complete update loads
    strictly; a partial one (``complete=False``) loads only its keys (:func:`load_checked`).
    """
    update = decode_weights(weights)
    if last_version is not None and update.version <= last_version:
        return last_version
    who = f"apply_weights: weights version {update.version}"
    load_checked(module, update.weights, strict=update.complete, who=who)
    return update.version


class WeightInput:
    """Mixin of a node with a ``weights`` input: which payload to load, once and only when newer.

    ``_newer_weights(weights)`` is the decoded update to load, or None when there is nothing
    new (no payload, the same object as last time, or a version not newer than
    ``weights_version``); the node loads it and then calls ``_loaded_weights``.
    """

    weights_version: int = 0
    """The newest version loaded (0: the built weights, or a plain state dict)."""
    _last_weights: Any = None

    def _newer_weights(self, weights: Any) -> WeightUpdate | None:
        if weights is None or weights is self._last_weights:
            return None
        try:
            update = decode_weights(weights)
        except (TypeError, ValueError) as err:
            raise ValueError(f"node {self.name!r}: input 'weights': {err}") from err  # type: ignore[attr-defined]
        if update.version and update.version <= self.weights_version:
            return None
        return update

    def _loaded_weights(self, weights: Any, update: WeightUpdate) -> None:
        # A versioned payload is told apart by its version: holding it would keep a copy of
        # the weights alive (on the GPU, beside the ones loaded). Only an unversioned state
        # dict needs its identity kept, so that it is not loaded again.
        self._last_weights = weights if not update.version else None
        self.weights_version = max(self.weights_version, update.version)

    def offload(self) -> int:
        """Let go of the last unversioned payload when the node's state leaves the device:
        its tensors are its producer's, and holding them would keep their device memory
        alive after the producer's offload. (The same payload, sent again, is loaded again.)"""
        self._last_weights = None
        return super().offload()  # type: ignore[misc]

    def _forget_weights(self, version: int = 0) -> None:
        """After a restore: ``version`` is loaded, and the next payload is read anew."""
        self.weights_version, self._last_weights = version, None


class WeightSync(Node):
    """Publishes updated policy weights, with a version, for a rollout node to load.

    Given an update node's :class:`WeightUpdate`, it keeps that update's version and its
    completeness (one version per published state, counted where the weights change); given
    a state dict or a module, it counts versions itself (checkpointed).

    Args:
        key: take the state dict from ``state[key]`` (e.g. ``"model"``) instead of ``state``.
        include: regexes (``re.search``); only keys matching one are sent (e.g. LoRA adapters,
            the trainable part). The update is then partial (``complete=False``).
        only_changed: send only tensors that differ from the last publish (keeps one copy of
            the last published weights); partial unless everything changed.
        dtype: cast floating tensors to this dtype before publishing (e.g. ``"bfloat16"`` to
            halve the bytes); None keeps each tensor's dtype.
        snapshot: copy the tensors at publish time, so that later in-place optimizer steps do not
            change an already published version. Turn off only when the consumer always loads
            before the next update (a consumer in this process then shares memory).
    """

    kind = "sync"
    inputs = {"state": Port(ANY, doc="the updated state dict (name -> tensor)")}
    outputs = {"weights": Port(ANY, doc="a WeightUpdate, with a version")}

    def __init__(
        self,
        *,
        key: str | None = None,
        include: Sequence[str] | None = None,
        only_changed: bool = False,
        dtype: str | None = None,
        snapshot: bool = True,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        if dtype is not None and not (
            isinstance(getattr(torch, dtype, None), torch.dtype)
            and getattr(torch, dtype).is_floating_point
        ):
            raise ValueError(f"node {self.name!r}: dtype {dtype!r} is not a floating torch dtype")
        self.key, self.only_changed, self.snapshot = key, only_changed, snapshot
        self.dtype = None if dtype is None else getattr(torch, dtype)
        self.include = [re.compile(p) for p in (include or [])]
        self.version = 0
        self._last: dict[str, torch.Tensor] = {}

    def _state_of(self, state: Any) -> Mapping[str, torch.Tensor]:
        if isinstance(state, torch.nn.Module):
            state = state.state_dict()
        elif isinstance(state, WeightUpdate):  # an update node's output
            state = state.weights
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
        given = state if isinstance(state, WeightUpdate) else None  # an update node's output
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
        complete = len(out) == len(full) and (given is None or given.complete)
        # One version per published state: an update's own, else this node's count.
        self.version = given.version if given is not None and given.version else self.version + 1
        return {"weights": WeightUpdate(out, self.version, complete)}

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
