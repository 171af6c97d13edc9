"""Device groups for the scheduler simulator: which devices serve which node.

* ``colocated``: every node is served by every device; the roles time-share the devices.
  Changing a device from one node to another costs a *switch* (offload one model, reload
  another), modelled by ``switch_cost_s`` and/or measured by the scheduler's ``on_switch``
  hook. With ``barrier=True`` (the default, as in a hybrid engine whose model is sharded over
  the whole group) the group changes role together, once the current role has no work left.
* ``partial``: rollout-side nodes (``kind`` in ``ROLLOUT_KINDS``) on one device group and
  the rest (reward, reference, critic, update) on another, running asynchronously: the
  reward group scores samples as they stream out of the rollout group.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import msgspec

from runtime.sched.placement import ROLLOUT_KINDS

__all__ = ["Placement", "colocated", "partial", "place"]


class Placement(msgspec.Struct, frozen=True):
    """Device groups and the group of each node."""

    mode: str
    """``"colocated"`` or ``"partial"``."""
    groups: dict[str, list[int]]
    """Group name -> indices into the device pool."""
    nodes: dict[str, str]
    """Node name -> group name."""
    switch_cost_s: float = 0.0
    """Seconds a device spends switching between two nodes (modelled offload + reload)."""
    barrier: bool = True
    """Whether a group with several nodes switches role all together (hybrid-engine style)."""

    def verify(self, n_devices: int | None = None) -> Placement:
        """Check the groups and nodes; raise ValueError saying what to fix."""
        if self.mode not in ("colocated", "partial"):
            raise ValueError(f"Placement.mode must be 'colocated' or 'partial', got {self.mode!r}")
        if self.switch_cost_s < 0:
            raise ValueError(f"Placement.switch_cost_s must be >= 0, got {self.switch_cost_s}")
        for group, devs in self.groups.items():
            if not devs:
                raise ValueError(f"Placement: group {group!r} has no devices")
            if n_devices is not None and any(not 0 <= d < n_devices for d in devs):
                raise ValueError(
                    f"Placement: group {group!r} names devices {devs} but the pool has "
                    f"{n_devices} (indices 0..{n_devices - 1})"
                )
        for node, group in self.nodes.items():
            if group not in self.groups:
                raise ValueError(
                    f"Placement: node {node!r} is in group {group!r}, which is not one of "
                    f"{sorted(self.groups)}"
                )
        return self

    def devices_of(self, node: str) -> list[int]:
        """The device indices serving ``node``."""
        try:
            return list(self.groups[self.nodes[node]])
        except KeyError:
            raise KeyError(
                f"Placement ({self.mode}) has no group for node {node!r}; placed nodes are "
                f"{sorted(self.nodes)}"
            ) from None

    def group_of(self, node: str) -> str:
        return self.nodes[node]

    def to_text(self) -> str:
        lines = [f"placement: {self.mode} (switch cost {self.switch_cost_s:g} s)"]
        for group, devs in self.groups.items():
            members = sorted(n for n, g in self.nodes.items() if g == group)
            lines.append(f"  {group}: devices {devs} <- {', '.join(members)}")
        return "\n".join(lines)


def colocated(
    nodes: Collection[str], n_devices: int, switch_cost_s: float = 0.0, barrier: bool = True
) -> Placement:
    """Every node on every device, time-sharing them."""
    if n_devices < 1:
        raise ValueError(f"colocated: n_devices must be >= 1, got {n_devices}")
    return Placement(
        "colocated",
        {"all": list(range(n_devices))},
        {n: "all" for n in nodes},
        switch_cost_s=switch_cost_s,
        barrier=barrier,
    ).verify(n_devices)


def partial(
    kinds: Mapping[str, str],
    n_devices: int,
    rollout_devices: int | None = None,
    rollout_kinds: Collection[str] = ROLLOUT_KINDS,
    switch_cost_s: float = 0.0,
) -> Placement:
    """Rollout-side nodes on the first ``rollout_devices`` devices, the rest on the others.

    ``kinds`` maps node name -> node kind. ``rollout_devices`` defaults to half the devices
    (rounded up), leaving at least one for the other group.
    """
    if n_devices < 2:
        raise ValueError(
            f"partial placement needs at least 2 devices (one per group), the pool has "
            f"{n_devices}; use colocated placement, or more CPU slots (SlotPool.cpu(n))"
        )
    r = math.ceil(n_devices / 2) if rollout_devices is None else rollout_devices
    if not 1 <= r < n_devices:
        raise ValueError(f"partial: rollout_devices must be between 1 and {n_devices - 1}, got {r}")
    groups = {"rollout": list(range(r)), "train": list(range(r, n_devices))}
    assign = {n: "rollout" if k in rollout_kinds else "train" for n, k in kinds.items()}
    if "rollout" not in assign.values() or "train" not in assign.values():
        raise ValueError(
            f"partial placement puts every node in one group ({sorted(set(assign.values()))}): "
            f"kinds were {dict(kinds)}; it needs nodes of kind {sorted(rollout_kinds)} and others"
        )
    return Placement("partial", groups, assign, switch_cost_s=switch_cost_s).verify(n_devices)


def place(
    graph: Any,
    n_devices: int,
    mode: str = "colocated",
    *,
    nodes: Collection[str] | None = None,
    **options: Any,
) -> Placement:
    """The placement of a graph's nodes (a ``yatt_graph.Graph`` or a ``{name: kind}`` map).

    ``nodes`` limits it to the nodes the scheduler runs on devices (default: all).
    ``options`` go to :func:`colocated` or :func:`partial`.
    """
    if isinstance(graph, Mapping):
        kinds = dict(graph)
    else:
        kinds = {name: n.kind for name, n in graph.nodes.items()}
    if nodes is not None:
        missing = sorted(set(nodes) - set(kinds))
        if missing:
            raise ValueError(f"place: nodes {missing} are not in the graph ({sorted(kinds)})")
        kinds = {n: kinds[n] for n in nodes}
    if mode == "colocated":
        return colocated(list(kinds), n_devices, **options)
    if mode == "partial":
        return partial(kinds, n_devices, **options)
    raise ValueError(f"place: mode must be 'colocated' or 'partial', got {mode!r}")
