"""Placement: which devices serve which node, chosen per graph.

Two modes (DESIGN.md, "Plan"):

* ``colocated``: every node is served by every device; the roles time-share the devices.
  Changing a device from one node to another costs a *switch* (offload one model, reload
  another), modelled by ``switch_cost_s`` and/or measured by the scheduler's ``on_switch``
  hook. With ``barrier=True`` (the default, as in a hybrid engine whose model is sharded over
  the whole group) the group changes role together, once the current role has no work left.
* ``partial``: rollout-side nodes (``kind`` in ``rollout_kinds``) on one device group and
  the rest (reward, reference, critic, update) on another, running asynchronously: the
  reward group scores samples as they stream out of the rollout group.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import msgspec

__all__ = [
    "MOVABLE_KINDS",
    "ROLLOUT_KINDS",
    "SIDES",
    "PartialCut",
    "Placement",
    "balance_sides",
    "colocated",
    "controller_assignment",
    "partial",
    "place",
    "runs_ahead",
    "side_loads",
]

ROLLOUT_KINDS = frozenset({"data", "encoder", "rollout"})
"""Node kinds that run with the rollout under ``partial`` placement by default."""

MOVABLE_KINDS = frozenset({"reward", "reference", "critic"})
"""Inference nodes that may run on either side of a ``partial`` cut (:func:`balance_sides`)."""

SIDES = ("rollout", "train")
"""The two sides of a ``partial`` cut."""


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
            f"{n_devices}; use colocated placement, or more CPU slots (DevicePool.cpu(n))"
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


def runs_ahead(graph: Any) -> list[str]:
    """The nodes that read no delayed edge (new weights), directly or through their inputs,
    in topological order: the next step's can run while this step still trains (on-policy:
    the data and the vision encoder)."""
    delayed = {e.dst for e in graph.edges if e.delay}
    behind: set[str] = set()
    order = graph.topological_order()
    for name in order:
        inputs = (e.src for e in graph.edges if e.dst == name and not e.delay)
        if name in delayed or any(src in behind for src in inputs):
            behind.add(name)
    return [n for n in order if n not in behind]


def balance_sides(
    graph: Any,
    sides: Mapping[str, str],
    busy_s: Mapping[str, float],
    pins: Collection[str] = (),
) -> dict[str, str]:
    """The ``partial`` cut with inference nodes (:data:`MOVABLE_KINDS`, not in ``pins``) moved
    to the other side while that lowers the busier side's measured time (``busy_s``: seconds a
    step per node), the move that lowers it most first; a pure function."""
    sides = dict(sides)
    load = side_loads(sides, busy_s)
    while True:
        hi = max(SIDES, key=load.__getitem__)
        lo = SIDES[1 - SIDES.index(hi)]
        best, best_max = None, load[hi]
        for name, side in sides.items():
            if side != hi or name in pins or graph.nodes[name].kind not in MOVABLE_KINDS:
                continue
            t = busy_s.get(name, 0.0)
            after = max(load[hi] - t, load[lo] + t)
            if after < best_max - 1e-9:
                best, best_max = name, after
        if best is None:
            return sides
        sides[best] = lo
        load[hi] -= busy_s.get(best, 0.0)
        load[lo] += busy_s.get(best, 0.0)


def side_loads(sides: Mapping[str, str], busy_s: Mapping[str, float]) -> dict[str, float]:
    """Each side's seconds a step: the sum of its nodes' ``busy_s``."""
    return {s: sum(busy_s.get(n, 0.0) for n, side in sides.items() if side == s) for s in SIDES}


class PartialCut:
    """The sides of a ``partial`` run: by kind and ``pins`` at first (:func:`partial_sides`),
    then, once the first steps are measured (:meth:`replan`), balanced (:func:`balance_sides`).
    """

    min_gain = 0.1
    """A new cut must make the busier side at least this much faster."""

    def __init__(self, graph: Any, pins: Mapping[str, str] | None = None):
        self.graph, self.pins = graph, dict(pins or {})
        self.sides = partial_sides(graph, self.pins)

    def replan(self, rows: Sequence[Mapping[str, Any]]) -> str | None:
        """From the first steps' metric rows (``time/<node>``): move inference nodes to the
        less busy side when that makes the busier one ``min_gain`` faster; what moved, or
        None."""
        measured = rows[2:] or rows  # the first steps are slower (warm-up)
        busy = {
            name: statistics.median(r.get(f"time/{name}", 0.0) for r in measured)
            for name in self.graph.nodes
        }
        new = balance_sides(self.graph, self.sides, busy, pins=set(self.pins))
        before, after = side_loads(self.sides, busy), side_loads(new, busy)
        if max(after.values()) > (1 - self.min_gain) * max(before.values()):
            return None
        moved = sorted(n for n in new if new[n] != self.sides[n])
        self.sides = new
        ms = "; ".join(
            f"{s} side {1000 * before[s]:.0f} -> {1000 * after[s]:.0f} ms" for s in SIDES
        )
        where = ", ".join(f"{n} to the {new[n]} side" for n in moved)
        return f"partial placement: moved {where} (measured busy time a step: {ms})"


def partial_sides(graph: Any, pins: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each node's side of a ``partial`` cut: by kind (:data:`ROLLOUT_KINDS` with the
    rollout), except the nodes ``pins`` puts on a side."""
    pins = dict(pins or {})
    unknown = sorted(set(pins) - set(graph.nodes))
    bad = sorted({s for s in pins.values() if s not in SIDES})
    if unknown or bad:
        raise ValueError(
            f"pins name node(s) {unknown} not in the graph ({', '.join(sorted(graph.nodes))})"
            if unknown
            else f"pins name side(s) {bad}; the sides are {' and '.join(SIDES)}"
        )
    return {
        name: pins.get(name, "rollout" if node.kind in ROLLOUT_KINDS else "train")
        for name, node in graph.nodes.items()
    }


def controller_assignment(
    graph: Any,
    controllers: int,
    mode: str = "colocated",
    sides: Mapping[str, str] | None = None,
) -> dict[str, int] | None:
    """Placement hints for a plan (``graph.plan(controllers, placement=...)``), per mode.

    * ``colocated``: the nodes that run ahead (:func:`runs_ahead`: data, vision) on
      controller 0 and the rest on the others (contiguous runs of the topological order).
      Within a step the rest waits on each other and on the new weights, so a cut there only
      adds transfers (and copies of a model the roles would share in one process); the nodes
      ahead overlap with the training of the step before. None (the plan's default split)
      when nothing or everything runs ahead.
    * ``partial``: the rollout side on the first half of the controllers and the training
      side on the others, each side cut into contiguous runs of its topological order. The
      sides: ``sides`` (node -> "rollout" or "train"), else :func:`partial_sides` (the
      rollout-side kinds, :data:`ROLLOUT_KINDS`, with the rollout; reward, reference, critic,
      advantage and update with the training). With ``--max-staleness`` >= 1 the rollout
      side may run ahead of the update.
    """
    if mode == "colocated":
        ahead = runs_ahead(graph)
        if controllers < 2 or not ahead or len(ahead) == len(graph.nodes):
            return None
        rest = [n for n in graph.topological_order() if n not in set(ahead)]
        hints = dict.fromkeys(ahead, 0)
        for i, name in enumerate(rest):
            hints[name] = 1 + i * (controllers - 1) // len(rest)
        return hints
    sides = dict(sides) if sides is not None else partial_sides(graph)
    if set(sides.values()) != set(SIDES):
        raise ValueError(
            f"partial placement puts every node on one side ({', '.join(set(sides.values()))}); "
            "each side needs a node: pin one to the other side or use colocated placement"
        )
    if controllers < 2:
        raise ValueError("partial placement needs 2 controllers or more (one per side)")
    r = math.ceil(controllers / 2)
    members = {"rollout": list(range(r)), "train": list(range(r, controllers))}
    order = graph.topological_order()
    assignment: dict[str, int] = {}
    for side, ids in members.items():
        names = [n for n in order if sides[n] == side]
        for i, name in enumerate(names):
            assignment[name] = ids[i * len(ids) // len(names)]
    return assignment
