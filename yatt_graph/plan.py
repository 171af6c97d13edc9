"""Plan: a graph partitioned into subgraphs, one per controller, with the channels between them.

Placement, in order of precedence:

1. ``placement={"node": 1}`` given to :meth:`Graph.plan`, or a node's own ``placement``
   attribute. An int is a controller index; a string is a group name, and groups are
   given controllers in the order they first appear in the graph.
2. A node without a hint joins the controller of the producer it takes most inputs
   from (data stays local), or else that of its first consumer.
3. With no hints at all, the topological order is cut into ``controllers`` contiguous
   runs of nearly equal length, which keeps each channel pointing forward.
"""

from __future__ import annotations

from typing import Any

import msgspec

from yatt_graph.graph import Edge, Graph, _Shown

__all__ = ["Channel", "Plan", "Subgraph"]


class Subgraph(msgspec.Struct, frozen=True):
    """The nodes one controller owns, in topological order."""

    controller: int
    nodes: list[str]
    group: str = ""
    """The placement group name, where the hints gave one."""


class Channel(msgspec.Struct, frozen=True):
    """An edge whose two ends live on different controllers: data goes controller to controller."""

    edge: Edge
    src_controller: int
    dst_controller: int


class Plan(_Shown):
    """A graph plus an assignment of each node to a controller."""

    def __init__(
        self, graph: Graph, controllers: int, assignment: dict[str, int], groups: dict[int, str]
    ):
        self.graph = graph
        self.controllers = controllers
        self.assignment = assignment
        self.groups = groups

    @classmethod
    def build(
        cls, graph: Graph, controllers: int = 1, placement: dict[str, int | str] | None = None
    ) -> Plan:
        if not isinstance(controllers, int) or controllers < 1:
            raise ValueError(f"plan: controllers must be an int >= 1, got {controllers!r}")
        if controllers > max(len(graph.nodes), 1):
            raise ValueError(
                f"plan: {controllers} controllers for {len(graph.nodes)} nodes in graph "
                f"{graph.name!r}; use at most one controller per node"
            )
        placement = dict(placement or {})
        unknown = sorted(set(placement) - set(graph.nodes))
        if unknown:
            raise ValueError(
                f"plan: placement names unknown node(s) {unknown}; nodes are {sorted(graph.nodes)}"
            )
        order = graph.topological_order()
        hints = {n: placement.get(n, graph.nodes[n].placement) for n in order}
        hints = {n: h for n, h in hints.items() if h is not None}
        assignment: dict[str, int] = {}
        groups: dict[int, str] = {}
        group_ids: dict[str, int] = {}
        used = {h for h in hints.values() if isinstance(h, int)}
        free = [c for c in range(controllers) if c not in used]
        for name in order:
            hint = hints.get(name)
            if isinstance(hint, bool) or not isinstance(hint, int | str | None):
                raise ValueError(
                    f"plan: placement of {name!r} must be an int or a group name, got {hint!r}"
                )
            if isinstance(hint, int):
                if not 0 <= hint < controllers:
                    raise ValueError(
                        f"plan: node {name!r} is placed on controller {hint}, but the plan has "
                        f"controllers 0..{controllers - 1}; raise controllers or change the hint"
                    )
                assignment[name] = hint
            elif isinstance(hint, str):
                if hint not in group_ids:
                    if not free:
                        raise ValueError(
                            f"plan: group {hint!r} (node {name!r}) needs a controller of its own, but "
                            f"all {controllers} are taken by groups {sorted(group_ids)} and index hints; "
                            "raise controllers or merge groups"
                        )
                    group_ids[hint] = free.pop(0)
                    groups[group_ids[hint]] = hint
                assignment[name] = group_ids[hint]
        if not hints and controllers > 1:
            for i, name in enumerate(order):
                assignment[name] = i * controllers // len(order)
        else:
            _follow_neighbours(graph, order, assignment)
        _pin_rank_groups(graph, assignment)
        return cls(graph, controllers, assignment, groups)

    # --- views ------------------------------------------------------------------------------
    @property
    def subgraphs(self) -> list[Subgraph]:
        order = self.graph.topological_order()
        return [
            Subgraph(c, [n for n in order if self.assignment[n] == c], self.groups.get(c, ""))
            for c in range(self.controllers)
        ]

    @property
    def channels(self) -> list[Channel]:
        return [
            Channel(e, self.assignment[e.src], self.assignment[e.dst])
            for e in self.graph.edges
            if self.assignment[e.src] != self.assignment[e.dst]
        ]

    def controller_of(self, node: str) -> int:
        return self.assignment[node]

    # --- serialization and pictures --------------------------------------------------------------
    def spec(self) -> Any:
        from yatt_graph.serialize import plan_spec

        return plan_spec(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> Plan:
        from yatt_graph.serialize import plan_from_json

        return plan_from_json(data)

    def _drawn(self) -> tuple[Graph, Plan]:
        return self.graph, self

    def __repr__(self) -> str:
        return f"<Plan {self.graph.name!r}: {self.controllers} controllers, {len(self.channels)} channels>"


def _pin_rank_groups(graph: Graph, assignment: dict[str, int]) -> None:
    """Put each node that joins another's rank group (:attr:`Node.rank_with`) on that node's
    controller, where the group's processes are, whatever its own hint said."""
    for name, node in graph.nodes.items():
        leader = node.rank_with
        if leader is None:
            continue
        if leader not in graph.nodes:
            raise ValueError(
                f"plan: node {name!r} joins the rank group of {leader!r}, which graph "
                f"{graph.name!r} does not hold; nodes are {sorted(graph.nodes)}"
            )
        assignment[name] = assignment[leader]


def _follow_neighbours(graph: Graph, order: list[str], assignment: dict[str, int]) -> None:
    """Place unhinted nodes with the producer they read most from, else their first consumer."""
    for name in order:
        if name in assignment:
            continue
        counts: dict[int, int] = {}
        for e in graph.inputs_of(name):
            if e.src in assignment and not e.delay:
                counts[assignment[e.src]] = counts.get(assignment[e.src], 0) + 1
        if counts:
            assignment[name] = max(sorted(counts), key=counts.__getitem__)
    for name in reversed(order):
        if name in assignment:
            continue
        consumers = [e.dst for e in graph.outputs_of(name) if e.dst in assignment]
        assignment[name] = assignment[consumers[0]] if consumers else 0
