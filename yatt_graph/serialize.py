"""Graphs and plans to JSON and back, with msgspec.

A node is stored as a reference to its class (or to the decorated function) plus the
constructor arguments that rebuild it, so that a controller process can rebuild the
nodes it owns from the plan alone. Constructor arguments may be JSON values, msgspec
Structs, or module-level functions and classes (stored as ``{"__ref__": "module:name"}``).

A graph's identity (:func:`graph_identity`), recorded in each checkpoint so that a resume by
another graph is refused: its name, its wiring (:meth:`yatt_graph.Graph.wiring_digest`) and,
per node, its class and configuration as the graph file would hold it (:func:`node_spec`);
:func:`identity_differences` names what differs.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import msgspec

from yatt_graph.graph import Edge, Graph, Handle
from yatt_graph.node import BatchPolicy, Node, Port
from yatt_graph.refs import import_ref, ref_of

__all__ = [
    "GraphSpec",
    "NodeSpec",
    "PlanSpec",
    "encode",
    "graph_identity",
    "graph_spec",
    "identity_differences",
    "plan_spec",
]


class NodeSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    ref: str
    kind: str
    config: dict[str, Any]
    inputs: dict[str, Port]
    outputs: dict[str, Port]
    batch_policy: BatchPolicy = BatchPolicy()
    placement: int | str | None = None


class GraphSpec(msgspec.Struct, frozen=True):
    name: str
    nodes: list[NodeSpec]
    edges: list[Edge]
    outputs: dict[str, Handle] = {}
    discarded: list[Handle] = []


class PlanSpec(msgspec.Struct, frozen=True):
    graph: GraphSpec
    controllers: int
    assignment: dict[str, int]
    groups: dict[str, str] = {}
    """Controller index (as a JSON key) -> placement group name."""


_encoder = msgspec.json.Encoder(order="deterministic")


def encode(spec: msgspec.Struct) -> bytes:
    return _encoder.encode(spec)


def _encode_value(value: Any, where: str) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_encode_value(v, where) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"{where}: dict keys must be strings to be written to JSON")
        return {k: _encode_value(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, msgspec.Struct):
        return {"__struct__": ref_of(type(value)), "value": msgspec.to_builtins(value)}
    if callable(value) and "<" not in getattr(value, "__qualname__", "<"):
        return {"__ref__": ref_of(value)}
    raise TypeError(
        f"{where}: a {type(value).__name__} cannot be written to a graph file; pass JSON values, "
        "a msgspec Struct, or a module-level function/class instead (e.g. a path to weights "
        "rather than a loaded model)"
    )


def _decode_value(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode_value(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__ref__"}:
            return import_ref(value["__ref__"])
        if set(value) == {"__struct__", "value"}:
            return msgspec.convert(value["value"], import_ref(value["__struct__"]))
        return {k: _decode_value(v) for k, v in value.items()}
    return value


def node_spec(node: Node) -> NodeSpec:
    where = f"node {node.name!r} config"
    return NodeSpec(
        name=node.name,
        ref=node.ref,
        kind=node.kind,
        config=_encode_value(node.config(), where),
        inputs=node.inputs,
        outputs=node.outputs,
        batch_policy=node.batch_policy,
        placement=node.placement,
    )


def build_node(spec: NodeSpec) -> Node:
    """Rebuild a node from its spec (imports its module)."""
    target = import_ref(spec.ref)
    config = _decode_value(spec.config)
    if isinstance(target, Node):  # a decorated function: copy it, set name and params
        node = copy.copy(target)
        node.name = spec.name
        node.params = config.get("params", {})
    elif isinstance(target, type) and issubclass(target, Node):
        node = target(**config)
    else:
        raise TypeError(f"node {spec.name!r}: reference {spec.ref!r} is not a Node class or node")
    node.batch_policy, node.placement = spec.batch_policy, spec.placement
    return node


def graph_spec(graph: Graph) -> GraphSpec:
    return GraphSpec(
        name=graph.name,
        nodes=[node_spec(n) for n in graph.nodes.values()],
        edges=graph.edges,
        outputs=dict(graph.graph_outputs),
        discarded=list(graph.discarded),
    )


def graph_from_spec(spec: GraphSpec) -> Graph:
    graph = Graph(spec.name)
    for ns in spec.nodes:
        node = build_node(ns)
        graph.nodes[node.name] = node
        graph.dag.add_node(node.name)
    for e in spec.edges:
        src_spec = graph.nodes[e.src].outputs[e.src_port].spec
        graph.connect(Handle(e.src, e.src_port, src_spec), e.dst, e.dst_port, delay=e.delay)
    for name, handle in spec.outputs.items():
        graph.output(name, handle)
    graph.discard(*spec.discarded)
    return graph


def graph_from_json(data: bytes | str) -> Graph:
    return graph_from_spec(msgspec.json.decode(data, type=GraphSpec))


def plan_spec(plan: Any) -> PlanSpec:
    groups = {str(c): name for c, name in plan.groups.items()}
    return PlanSpec(plan.graph.spec(), plan.controllers, dict(plan.assignment), groups)


def plan_from_json(data: bytes | str) -> Any:
    from yatt_graph.plan import Plan

    spec = msgspec.json.decode(data, type=PlanSpec)
    groups = {int(c): name for c, name in spec.groups.items()}
    return Plan(graph_from_spec(spec.graph), spec.controllers, spec.assignment, groups)


def graph_identity(graph: Any) -> dict[str, Any]:
    """``{"name", "wiring", "nodes": {name: {"class", "config"}}}``, all JSON values."""
    nodes = {}
    for name, node in graph.nodes.items():
        try:
            spec = node_spec(node)
            config = json.loads(json.dumps(spec.config))
            for key in node.execution_options:  # how it runs, not what it is
                config.pop(key, None)  # (e.g. an update's ranks: a resume may change them)
            nodes[name] = {"class": spec.ref, "config": config}
        except (TypeError, ValueError):  # a configuration no graph file can hold
            nodes[name] = {"class": getattr(node, "ref", type(node).__name__), "config": None}
    return {"name": graph.name, "wiring": graph.wiring_digest(), "nodes": nodes}


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 40 else text[:37] + "..."


def identity_differences(recorded: Any, current: dict[str, Any]) -> list[str]:
    """What differs between a recorded identity and the current one, one phrase per item;
    empty when they are the same. A malformed record is one difference, never an exception."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("nodes"), dict):
        return ["the checkpoint's graph record is not readable"]
    diffs = []
    if recorded.get("name") != current["name"]:
        diffs.append(f"graph {recorded.get('name')!r} (checkpoint) vs {current['name']!r} (now)")
    rec_nodes, cur_nodes = recorded["nodes"], current["nodes"]
    gone, added = sorted(set(rec_nodes) - set(cur_nodes)), sorted(set(cur_nodes) - set(rec_nodes))
    if gone:
        diffs.append(f"node(s) {gone} only in the checkpoint")
    if added:
        diffs.append(f"node(s) {added} only in this graph")
    for name in sorted(set(rec_nodes) & set(cur_nodes)):
        old, new = rec_nodes[name], cur_nodes[name]
        if not isinstance(old, dict):
            diffs.append(f"node {name!r}: unreadable record")
            continue
        if old.get("class") != new["class"]:
            diffs.append(f"node {name!r}: class {old.get('class')} vs {new['class']}")
            continue
        a, b = _flat(old.get("config")), _flat(new["config"])
        changed = [
            f"{key} {_short(a.get(key))} vs {_short(b.get(key))}"
            for key in sorted(set(a) | set(b))
            if a.get(key) != b.get(key)
        ]
        if changed:
            diffs.append(f"node {name!r} option(s) " + ", ".join(changed))
    if not diffs and recorded.get("wiring") != current["wiring"]:
        diffs.append("the edges or outputs differ")
    return diffs
