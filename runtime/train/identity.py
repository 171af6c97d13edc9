"""A graph's identity, recorded in each checkpoint so that a resume by another graph is refused.

The identity is the graph's name, its wiring (:meth:`yatt_graph.Graph.wiring_digest`: edges
and outputs) and, per node, its class and its configuration as the graph file would hold it
(:func:`yatt_graph.serialize.node_spec`). :func:`identity_differences` names what differs:
nodes added or removed, a class changed, each option that changed.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["graph_identity", "identity_differences"]


def graph_identity(graph: Any) -> dict[str, Any]:
    """``{"name", "wiring", "nodes": {name: {"class", "config"}}}``, all JSON values."""
    from yatt_graph.serialize import node_spec

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
