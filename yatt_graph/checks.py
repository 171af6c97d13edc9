"""The checks behind ``Graph.validate``: each returns every problem it finds, none stops at the first.

Every message starts with the edge it is about (``src.port -> dst.port``; ``? -> dst.port`` for
an input that nothing feeds), then says what is wrong and how to fix it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import networkx as nx

from yatt_graph.errors import (
    CycleError,
    GraphError,
    GraphLookupError,
    MissingInputError,
    PortTypeError,
    ShapeError,
)
from yatt_graph.types import PortSpec, TensorSpec, compatible

if TYPE_CHECKING:
    from yatt_graph.graph import Graph, Handle

__all__ = [
    "connection_problem",
    "find_cycles",
    "find_missing_inputs",
    "find_shape_conflicts",
    "unused_outputs",
]


def _kind(why: str) -> str:
    """The word for what ``types.compatible`` found: dtype, shape or type."""
    if why.startswith("dtype"):
        return "dtype"
    if why.startswith(("rank", "dimension")):
        return "shape"
    return "type"


def connection_problem(
    graph: Graph, src: Handle, dst_name: str, port: str, delay: int
) -> GraphError | None:
    """Why ``src`` cannot feed ``dst_name.port``, or None when it can."""
    edge = f"{src.node}.{src.port} -> {dst_name}.{port}"
    if src.node not in graph.nodes:
        return GraphLookupError(
            f"{edge}: unknown node: node {src.node!r} is not in graph {graph.name!r}. "
            "Fix: declare it in this graph (inside its `with` block) before using its outputs"
        )
    if dst_name not in graph.nodes:
        return GraphLookupError(
            f"{edge}: unknown node: node {dst_name!r} is not in graph {graph.name!r}; add it first"
        )
    dst_node = graph.nodes[dst_name]
    if port not in dst_node.inputs:
        return GraphLookupError(
            f"{edge}: unknown port: node {dst_name!r} has no input {port!r}; its inputs are "
            f"{sorted(dst_node.inputs)}. Fix: use one of those names"
        )
    src_port = graph.nodes[src.node].outputs.get(src.port)
    if src_port is None:
        return GraphLookupError(
            f"{edge}: unknown port: node {src.node!r} has no output {src.port!r}; its outputs are "
            f"{sorted(graph.nodes[src.node].outputs)}"
        )
    dst_port = dst_node.inputs[port]
    why = compatible(src_port.spec, dst_port.spec)
    if why:
        return PortTypeError(
            f"{src.node}.{src.port} ({src_port.spec}) -> {dst_name}.{port} ({dst_port.spec}): "
            f"{_kind(why)} mismatch: {why}. Fix: make {src.node!r} produce {dst_port.spec}, "
            "or convert the value with a node in between"
        )
    for other in graph.inputs_of(dst_name):
        if other.dst_port == port:
            return PortTypeError(
                f"{edge}: input {dst_name}.{port} is already fed by {other.src}.{other.src_port}; "
                f"an input takes one edge, so {src.node}.{src.port} cannot feed it too"
            )
    if delay and dst_port.required:
        return MissingInputError(
            f"delayed edge {edge}: the input is empty at step 0, so {dst_name}.{port} must be "
            "optional (Port(spec, required=False))"
        )
    return None


def find_cycles(graph: Graph) -> list[CycleError]:
    """One cycle of non-delayed edges per strongly connected part of the step DAG."""
    step = graph.step_dag()
    index = {name: i for i, name in enumerate(graph.nodes)}
    problems = []
    parts = [sorted(p, key=index.__getitem__) for p in nx.strongly_connected_components(step)]
    for part in sorted(parts, key=lambda p: index[p[0]]):
        if len(part) == 1 and not step.has_edge(part[0], part[0]):
            continue
        cycle = nx.find_cycle(step.subgraph(part), source=part[0])
        names = [u for u, *_ in cycle] + [cycle[0][0]]
        edges = ", ".join(
            f"{e.src}.{e.src_port} -> {e.dst}.{e.dst_port}"
            for u, v, k in cycle
            for e in [step.get_edge_data(u, v, k)["edge"]]
        )
        problems.append(
            CycleError(
                f"{edges}: cycle without a delay: {' -> '.join(names)}. Fix: remove one edge, "
                "or mark the feedback edge as delayed: g.connect(handle, node, port, delay=1)",
                names,
            )
        )
    return problems


def _candidates(graph: Graph, name: str, spec: PortSpec) -> list[str]:
    """Outputs of other nodes that could feed an input of this spec (for the fix)."""
    found = []
    for other, node in graph.nodes.items():
        if other == name:
            continue
        for port, out in node.outputs.items():
            if compatible(out.spec, spec) is None:
                found.append(f"{other}.{port}")
    return found[:3]


def find_missing_inputs(graph: Graph, skip: set[tuple[str, str]]) -> list[MissingInputError]:
    """Required inputs that no edge feeds (``skip``: inputs whose edge was refused already)."""
    problems = []
    for name, node in graph.nodes.items():
        fed = {e.dst_port for e in graph.inputs_of(name)}
        for port, spec in node.inputs.items():
            if not spec.required or port in fed or (name, port) in skip:
                continue
            options = _candidates(graph, name, spec.spec)
            hint = f", e.g. {name}({port}={options[0]})" if options else ""
            problems.append(
                MissingInputError(
                    f"? -> {name}.{port}: missing required input: node {name!r}: required input "
                    f"{port!r} ({spec.spec}) is not connected. Fix: pass a handle for it{hint}, "
                    "or make it optional"
                )
            )
    return problems


def find_shape_conflicts(graph: Graph) -> list[ShapeError]:
    """Union-find over (node, symbol) with concrete sizes: a symbol may bind one int only."""
    parent: dict[tuple[str, str], tuple[str, str]] = {}
    size: dict[tuple[str, str], tuple[int, str]] = {}
    problems: list[ShapeError] = []

    def find(x: tuple[str, str]) -> tuple[str, str]:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def bind(sym: tuple[str, str], value: int, where: str) -> None:
        root = find(sym)
        if root in size and size[root][0] != value:
            problems.append(
                ShapeError(
                    f"{where}: shape mismatch: dimension {sym[1]} of node {sym[0]!r} is {value} "
                    f"here but {size[root][0]} at {size[root][1]}. Fix: make the shapes agree"
                )
            )
            return
        size.setdefault(root, (value, where))

    def union(a: tuple[str, str], b: tuple[str, str], where: str) -> None:
        ra, rb = find(a), find(b)
        if ra == rb:
            return
        parent[ra] = rb
        if ra not in size:
            return
        if rb in size and size[rb][0] != size[ra][0]:
            problems.append(
                ShapeError(
                    f"{where}: shape mismatch: it joins dimension {a[1]} of node {a[0]!r} "
                    f"({size[ra][0]}, set at {size[ra][1]}) with dimension {b[1]} of node "
                    f"{b[0]!r} ({size[rb][0]}, set at {size[rb][1]}). Fix: make the shapes agree"
                )
            )
            return
        size.setdefault(rb, size[ra])

    for e in graph.edges:
        s = graph.nodes[e.src].outputs[e.src_port].spec
        d = graph.nodes[e.dst].inputs[e.dst_port].spec
        if not (isinstance(s, TensorSpec) and isinstance(d, TensorSpec)):
            continue
        where = f"{e.src}.{e.src_port} -> {e.dst}.{e.dst_port}"
        for a, b in zip(s.shape, d.shape):
            if a == "*" or b == "*":
                continue
            if isinstance(a, str) and isinstance(b, str):
                union((e.src, a), (e.dst, b), where)
            elif isinstance(a, str):
                bind((e.src, a), b, where)  # type: ignore[arg-type]
            elif isinstance(b, str):
                bind((e.dst, b), a, where)
    return problems


def unused_outputs(graph: Graph) -> list[str]:
    """A message for each output that feeds nothing, is no graph output and was not discarded."""
    consumed = {(e.src, e.src_port) for e in graph.edges}
    consumed |= {(h.node, h.port) for h in graph.graph_outputs.values()}
    consumed |= {(h.node, h.port) for h in graph.discarded}
    messages = []
    for name, node in graph.nodes.items():
        for port, spec in node.outputs.items():
            if (name, port) not in consumed:
                messages.append(
                    f"graph {graph.name!r}: output {name}.{port} ({spec.spec}) is consumed by "
                    f"nothing; connect it, mark it with g.output('{port}', handle), or "
                    "g.discard(handle)"
                )
    return messages
