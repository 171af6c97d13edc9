"""Models shared by nodes of one executor in one process: one policy copy where several
nodes hold the same one.

Nodes with the same share key (share="policy" on Rollout and PPO/GRPO update, share="critic"
on Critic and PPOUpdate(critic_share="critic")) use ONE module when built by the same
executor in one process. Opt-in per executor: the executor calls each node's
bind_executor(max_staleness=..., shared=registry) before setup(), one registry (a dict) per
executor; sharing only with max_staleness == 0. Sharers must agree on spec/device/kind,
else the second builds its own copy (warning).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

__all__ = [
    "Sharing",
    "check_share_key",
    "fingerprint",
    "live_weights",
    "same_storage",
    "set_share",
]


@dataclass
class _Entry:
    fingerprint: str
    module: nn.Module
    users: list[str] = field(default_factory=list)


def check_share_key(key: Any, where: str) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise ValueError(f"{where}: share key {key!r} must be a non-empty str (or None)")
    return key


def fingerprint(kind: str, spec: Any, device: Any, **extra: Any) -> str:
    """What two sharers must agree on to use one module."""
    return json.dumps([kind, spec, str(device), extra], sort_keys=True, default=str)


_LIVE = "_yatt_live_weights"


def live_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own parameters and buffers by name (detached views, not copies): what an
    update publishes to the nodes that share the module. Made once and reused while the
    module's tensors stay where they are (an offload moves them: then it is made again), so a
    step pays no state dict and a sharer recognises it at once (:func:`same_storage`)."""
    cached = module.__dict__.get(_LIVE)
    if cached is not None:
        weights, probe, where = cached
        if probe.data_ptr() == where:
            return weights
    weights = {k: v.detach() for k, v in module.state_dict().items()}
    probe = next(iter(module.parameters()), None)
    if probe is not None:
        module.__dict__[_LIVE] = (weights, probe, probe.data_ptr())
    return weights


def same_storage(module: nn.Module, weights: Mapping[str, torch.Tensor]) -> bool:
    """Whether every tensor of ``weights`` is the module's own tensor of that name."""
    if not weights:
        return False
    if weights is live_weights(module):
        return True
    own = module.state_dict(keep_vars=True)
    for k, v in weights.items():
        mine = own.get(k)
        if mine is None or not isinstance(v, torch.Tensor):
            return False
        if mine.data_ptr() != v.data_ptr() or mine.shape != v.shape or mine.dtype != v.dtype:
            return False
    return True


def set_share(node: Any, key: str | None, arg: str = "share") -> Any:
    """Set a node's share key after construction, recorded in its config (rebuilds keep it)."""
    check_share_key(key, f"node {node.name!r}")
    return node.configure(**{arg: key})


class Sharing:
    """Mixin for nodes that may share a module: the executor hook and the registry calls."""

    _share_scope: dict[str, _Entry] | None = None
    _share_entries: dict[str, _Entry]

    def bind_executor(self, *, max_staleness: int, shared: dict[str, Any]) -> None:
        if self.__dict__.get("_built"):
            if max_staleness > 0 and any(
                len(e.users) > 1 for e in self.__dict__.get("_share_entries", {}).values()
            ):
                raise ValueError(
                    f"node {self.name!r} was built sharing a model with other nodes; "  # type: ignore[attr-defined]
                    f"max_staleness={max_staleness} needs separate copies: build the graph anew"
                )
            return
        self._share_scope = shared if max_staleness == 0 else None

    def _acquire(self, key: str | None, fp: str, build: Callable[[], nn.Module]) -> nn.Module:
        scope = self._share_scope
        if key is None or scope is None:
            return build()
        who: str = self.name  # type: ignore[attr-defined]
        entry = scope.get(key)
        if entry is None:
            entry = scope[key] = _Entry(fp, build(), [])
        elif entry.fingerprint != fp:
            log.warning(
                "node %r: share key %r is used by %s with another model (%s) than this node's "
                "(%s); this node builds its own copy",
                who, key, entry.users, entry.fingerprint, fp,
            )  # fmt: skip
            return build()
        entry.users.append(who)
        self.__dict__.setdefault("_share_entries", {})[key] = entry
        return entry.module

    def _shared_policy(self, key: str | None, spec: Any) -> nn.Module:
        """``build_policy(spec)`` on the node's device: one module for the nodes of ``key``."""
        from nodes.models.policy import build_policy

        device = self.device  # type: ignore[attr-defined]
        fp = fingerprint("policy", spec, device)
        return self._acquire(key, fp, lambda: build_policy(spec).to(device))

    def _release(self, key: str | None) -> None:
        entry = self.__dict__.get("_share_entries", {}).pop(key, None)
        if entry is not None:
            entry.users.remove(self.name)  # type: ignore[attr-defined]

    def _is_shared(self, key: str | None) -> bool:
        entry = self.__dict__.get("_share_entries", {}).get(key)
        return entry is not None and len(entry.users) > 1
