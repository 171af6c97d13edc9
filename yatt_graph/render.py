"""Pictures of graphs and plans: a text listing (torch.fx style) and Mermaid text; the drawn
pictures (SVG/PNG with matplotlib) are in ``yatt_graph.drawing`` and exported here too."""

from __future__ import annotations

from typing import TYPE_CHECKING

from yatt_graph.drawing import KIND_COLORS, Picture, draw, edge_labels, layout, picture

if TYPE_CHECKING:
    from yatt_graph.graph import Graph
    from yatt_graph.plan import Plan

__all__ = [
    "KIND_COLORS",
    "Picture",
    "draw",
    "edge_labels",
    "layout",
    "picture",
    "to_mermaid",
    "to_text",
]


def to_text(graph: Graph, plan: Plan | None = None) -> str:
    """A readable listing, one line a node (torch.fx style), then the graph outputs."""
    head = f"graph {graph.name} ({len(graph.nodes)} nodes, {graph.dag.number_of_edges()} edges"
    head += f", {plan.controllers} controllers)" if plan else ")"
    lines = [head]
    for name in graph.topological_order():
        node = graph.nodes[name]
        args = []
        for port in node.inputs:
            src = next((e for e in graph.inputs_of(name) if e.dst_port == port), None)
            shown = f"%{src.src}.{src.src_port}" + ("@prev" if src.delay else "") if src else "None"
            args.append(f"{port}={shown}")
        where = f"  [controller {plan.assignment[name]}]" if plan else ""
        outs = ", ".join(f"{k}: {p.spec}" for k, p in node.outputs.items())
        lines.append(f"  %{name} = {node.kind}:{node.label}({', '.join(args)}) -> ({outs}){where}")
    for out, h in graph.graph_outputs.items():
        lines.append(f"  output {out} = %{h.node}.{h.port}")
    if plan:
        for ch in plan.channels:
            e = ch.edge
            lines.append(
                f"  channel {e.src}.{e.src_port} -> {e.dst}.{e.dst_port}: "
                f"controller {ch.src_controller} -> {ch.dst_controller}"
            )
    return "\n".join(lines)


def _mermaid_id(name: str) -> str:
    return f"n_{name}"


def to_mermaid(graph: Graph, plan: Plan | None = None) -> str:
    """Mermaid flowchart text; in a plan, one subgraph per controller."""
    lines = ["flowchart LR"]

    def node_line(name: str) -> str:
        node = graph.nodes[name]
        return f'{_mermaid_id(name)}["{name}<br/><i>{node.kind}</i>"]:::{node.kind}'

    if plan:
        for sub in plan.subgraphs:
            title = f"controller {sub.controller}" + (f" ({sub.group})" if sub.group else "")
            lines.append(f'  subgraph c{sub.controller}["{title}"]')
            lines.extend(f"    {node_line(n)}" for n in sub.nodes)
            lines.append("  end")
    else:
        lines.extend(f"  {node_line(n)}" for n in graph.nodes)
    for e in graph.edges:
        spec = graph.nodes[e.src].outputs[e.src_port].spec
        arrow = "-.->" if e.delay else "-->"
        lines.append(f'  {_mermaid_id(e.src)} {arrow}|"{e.src_port}: {spec}"| {_mermaid_id(e.dst)}')
    for kind, color in KIND_COLORS.items():
        lines.append(f"  classDef {kind} fill:{color},stroke:#333")
    return "\n".join(lines)
