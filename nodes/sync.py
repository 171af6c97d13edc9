"""Weight sync, the consumer's side: load an update node's published weights, once a version.

An update node publishes its weights as a :class:`~yatt_graph.WeightUpdate` (a msgspec Struct
of the graph core): ``weights`` (``dict[str, Tensor]``), ``version`` (1, 2, ... per publish; a
consumer skips anything not newer than what it has) and ``complete`` (False when only some keys
were sent: load it with ``strict=False``). Being a Struct of ``yatt_graph``, it crosses
controllers whole, through the runtime's one data-plane codec (no pickle), and the runtime
knows it for a weight update. :func:`apply_weights` loads one into a module;
:class:`WeightInput` is a consumer node's side (the rollout's, the critic's): load a payload
once, and only when it is newer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nodes.models.policy_base import load_checked
from yatt_graph import WeightUpdate

__all__ = ["WeightInput", "WeightUpdate", "apply_weights", "decode_weights"]


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
    """What a node with a ``weights`` input holds (``self.weights_in = WeightInput()``): which
    payload to load, once and only when newer. ``newer(weights, name)`` is the decoded update
    to load, or None when there is nothing new (no payload, the same object as last time, or a
    version not newer than ``version``); node ``name`` loads it and then calls ``loaded``."""

    def __init__(self) -> None:
        self.version = 0
        """The newest version loaded (0: the built weights, or a plain state dict)."""
        self._last: Any = None

    def newer(self, weights: Any, name: str) -> WeightUpdate | None:
        if weights is None or weights is self._last:
            return None
        try:
            update = decode_weights(weights)
        except (TypeError, ValueError) as err:
            raise ValueError(f"node {name!r}: input 'weights': {err}") from err
        if update.version and update.version <= self.version:
            return None
        return update

    def loaded(self, weights: Any, update: WeightUpdate) -> None:
        # A versioned payload is told apart by its version: holding it would keep a copy of
        # the weights alive (on the GPU, beside the ones loaded). Only an unversioned state
        # dict needs its identity kept, so that it is not loaded again.
        self._last = weights if not update.version else None
        self.version = max(self.version, update.version)

    def release(self) -> None:
        """Let go of the last unversioned payload when the node's state leaves the device:
        its tensors are its producer's, and holding them would keep their device memory
        alive after the producer's offload. (The same payload, sent again, is loaded again.)"""
        self._last = None

    def forget(self, version: int = 0) -> None:
        """After a restore: ``version`` is loaded, and the next payload is read anew."""
        self.version, self._last = version, None
