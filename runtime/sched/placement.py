"""Placement: which controller runs which node, by the run's ``--placement`` mode.

* ``colocated``: the nodes that run ahead of the weights (data, vision) on controller 0 and
  the rest on the others; the roles of a step time-share the devices.
* ``partial``: the rollout side (``kind`` in :data:`ROLLOUT_KINDS`) on half the controllers
  and the training side (reward, reference, critic, advantage, update) on the others, each
  side running as soon as its inputs are ready; :class:`PartialCut` moves inference nodes
  across the cut once the first steps are measured.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from typing import Any

__all__ = [
    "MOVABLE_KINDS",
    "ROLLOUT_KINDS",
    "SIDES",
    "PartialCut",
    "balance_sides",
    "controller_assignment",
    "partial_sides",
    "runs_ahead",
    "side_loads",
]

ROLLOUT_KINDS = frozenset({"data", "encoder", "rollout"})
"""Node kinds that run with the rollout under ``partial`` placement by default."""

MOVABLE_KINDS = frozenset({"reward", "reference", "critic"})
"""Inference nodes that may run on either side of a ``partial`` cut (:func:`balance_sides`)."""

SIDES = ("rollout", "train")
"""The two sides of a ``partial`` cut."""


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
        less busy side when that makes the busier one ``min_gain`` faster (not one that joins
        another's rank group: it stays with it); what moved, or None."""
        measured = rows[2:] or rows  # the first steps are slower (warm-up)
        busy = {
            name: statistics.median(r.get(f"time/{name}", 0.0) for r in measured)
            for name in self.graph.nodes
        }
        grouped = {n for n, node in self.graph.nodes.items() if node.rank_with is not None}
        new = balance_sides(self.graph, self.sides, busy, pins=set(self.pins) | grouped)
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
