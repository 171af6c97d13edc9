"""Pictures of graphs and plans: a text listing, Mermaid, and SVG/PNG drawn with matplotlib.

The SVG keeps text as text (``svg.fonttype = none``) so that node names can be found
in it and stay sharp in notebooks. Layout: columns are topological generations; in a
plan, each controller gets a horizontal band of its own, drawn as a labelled box.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

import networkx as nx

if TYPE_CHECKING:
    from yatt_graph.graph import Graph
    from yatt_graph.plan import Plan

__all__ = ["KIND_COLORS", "draw", "layout", "to_mermaid", "to_text"]

#: Fill colour of each node kind in pictures.
KIND_COLORS = {
    "data": "#e8e8e8",
    "encoder": "#cfe2ff",
    "rollout": "#ffd8a8",
    "reward": "#d3f9d8",
    "reference": "#e5dbff",
    "critic": "#fff3bf",
    "advantage": "#c3fae8",
    "update": "#ffc9c9",
    "sync": "#f1f3f5",
    "function": "#ffffff",
}
_COLUMN = 3.5  # horizontal distance between generations
_BAND_COLORS = [
    "#4c6ef5",
    "#f76707",
    "#37b24d",
    "#ae3ec9",
    "#1098ad",
    "#f59f00",
    "#e03131",
    "#495057",
]


def _edge_label(graph: Graph, src: str, dst: str) -> str:
    """Port names and types of the edges from ``src`` to ``dst``; a bundle of many is shortened."""
    edges = [data["edge"] for data in graph.dag.get_edge_data(src, dst).values()]
    later = " (next step)" if any(e.delay for e in edges) else ""
    if len(edges) > 2:  # e.g. the four prompt/response tensors: names only, types in the listing
        return f"{edges[0].src_port}, {edges[1].src_port} +{len(edges) - 2} more{later}"
    lines = []
    for e in edges:
        spec = graph.nodes[e.src].outputs[e.src_port].spec
        name = e.src_port if e.src_port == e.dst_port else f"{e.src_port}→{e.dst_port}"
        lines.append(f"{name}: {spec}" + (" (next step)" if e.delay else ""))
    return "\n".join(lines)


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


def layout(graph: Graph, plan: Plan | None = None) -> dict[str, tuple[float, float]]:
    """Node positions: x is the topological generation, y stacks the nodes of a generation.

    In a plan whose controllers own disjoint runs of generations, the same layout is kept
    and each controller is a box around its run; otherwise each controller gets a band.
    """
    generations = list(nx.topological_generations(graph.step_dag()))
    column = {n: i for i, gen in enumerate(generations) for n in gen}
    if plan is not None:
        spans = sorted(
            (min(column[n] for n in sub.nodes), max(column[n] for n in sub.nodes))
            for sub in plan.subgraphs
            if sub.nodes
        )
        if all(a[1] < b[0] for a, b in zip(spans, spans[1:])):
            plan = None
    order = {n: i for i, n in enumerate(graph.nodes)}
    bands = range(plan.controllers) if plan else [0]
    pos: dict[str, tuple[float, float]] = {}
    y_top = 0.0
    for band in bands:
        members = [n for n in graph.nodes if (plan.assignment[n] if plan else 0) == band]
        if not members:
            continue
        per_col: dict[int, list[str]] = {}
        for n in sorted(members, key=order.__getitem__):
            per_col.setdefault(column[n], []).append(n)
        height = max(len(v) for v in per_col.values())
        for col, names in per_col.items():
            offset = (height - len(names)) / 2
            for i, n in enumerate(names):
                pos[n] = (col * _COLUMN, -(y_top + offset + i) * 1.6)
        y_top += height + 0.6
    return pos


def draw(
    graph: Graph, plan: Plan | None = None, *, path: str | None = None, fmt: str | None = None
) -> bytes:
    """Draw to SVG or PNG bytes; ``fmt`` defaults to the suffix of ``path``, else SVG."""
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

    fmt = (fmt or (Path(path).suffix.lstrip(".") if path else "svg")).lower()
    if fmt not in ("svg", "png"):
        raise ValueError(f"draw: format must be svg or png, got {fmt!r}")
    pos = layout(graph, plan)
    xs = [p[0] for p in pos.values()] or [0.0]
    ys = [p[1] for p in pos.values()] or [0.0]
    box_w, box_h = 2.0, 0.8
    extent = list(ys)
    with rc_context({"svg.fonttype": "none", "font.family": "DejaVu Sans"}):
        fig = Figure()
        FigureCanvasAgg(fig)
        ax = fig.add_axes((0, 0, 1, 1))
        ax.set_axis_off()
        if plan:
            for sub in plan.subgraphs:
                if not sub.nodes:
                    continue
                color = _BAND_COLORS[sub.controller % len(_BAND_COLORS)]
                bx = [pos[n][0] for n in sub.nodes]
                by = [pos[n][1] for n in sub.nodes]
                ax.add_patch(
                    Rectangle(
                        (min(bx) - box_w / 2 - 0.3, min(by) - box_h / 2 - 0.3),
                        max(bx) - min(bx) + box_w + 0.6,
                        max(by) - min(by) + box_h + 0.75,
                        facecolor=color,
                        alpha=0.08,
                        edgecolor=color,
                        linewidth=1.5,
                        linestyle="--",
                    )
                )
                title = f"controller {sub.controller}" + (f" ({sub.group})" if sub.group else "")
                ax.text(
                    min(bx) - box_w / 2 - 0.2,
                    max(by) + box_h / 2 + 0.2,
                    title,
                    color=color,
                    fontsize=9,
                    fontweight="bold",
                    va="bottom",
                )
        arcs_below = arcs_above = 0
        pairs = sorted(
            {(u, v) for u, v in graph.dag.edges()}, key=lambda p: (pos[p[0]][0], pos[p[1]][0])
        )
        for src, dst in pairs:
            delayed = all(d["edge"].delay for d in graph.dag.get_edge_data(src, dst).values())
            (x0, y0), (x1, y1) = pos[src], pos[dst]
            dx = x1 - x0
            rad, start, end = 0.0, (x0 + box_w / 2, y0), (x1 - box_w / 2, y1)
            if dx <= 0:  # feedback (delayed) edge: arc above, from the top of one box to the other
                arcs_above += 1
                start, end = (x0, y0 + box_h / 2), (x1, y1 + box_h / 2)
                rad = (0.9 + 0.45 * arcs_above) * 2 / max(abs(dx), 1e-6)
            elif dx > _COLUMN * 1.5 and abs(y1 - y0) < 0.1:  # skips a column in a row: arc below
                arcs_below += 1
                start, end = (x0, y0 - box_h / 2), (x1, y1 - box_h / 2)
                rad = (0.7 + 0.45 * arcs_below) * 2 / dx
            ax.add_patch(
                FancyArrowPatch(
                    start,
                    end,
                    connectionstyle=f"arc3,rad={rad}",
                    arrowstyle="-|>",
                    mutation_scale=12,
                    color="#555",
                    linestyle="--" if delayed else "-",
                    linewidth=1.0,
                )
            )
            # The midpoint of matplotlib's arc3 quadratic curve.
            (sx, sy), (ex, ey) = start, end
            mx = (sx + ex) / 2 + 0.5 * rad * (ey - sy)
            my = (sy + ey) / 2 - 0.5 * rad * (ex - sx)
            extent.append(my)
            ax.text(
                mx,
                my + (0.08 if not rad else 0.0),
                _edge_label(graph, src, dst),
                fontsize=6.5,
                ha="center",
                va="bottom" if not rad else "center",
                color="#333",
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85},
            )
        for name, (x, y) in pos.items():
            node = graph.nodes[name]
            ax.add_patch(
                FancyBboxPatch(
                    (x - box_w / 2, y - box_h / 2),
                    box_w,
                    box_h,
                    boxstyle="round,pad=0.05,rounding_size=0.15",
                    facecolor=KIND_COLORS.get(node.kind, "#ffffff"),
                    edgecolor="#333",
                    linewidth=1.2,
                )
            )
            ax.text(x, y + 0.1, name, ha="center", va="center", fontsize=9, fontweight="bold")
            ax.text(
                x,
                y - 0.2,
                f"{node.kind} · {node.label}",
                ha="center",
                va="center",
                fontsize=6.5,
                color="#444",
            )
        top, bottom = max(extent) + 1.3, min(extent) - 1.0
        ax.text(min(xs) - 1.4, top - 0.1, graph.name, fontsize=11, fontweight="bold", va="top")
        left, right = min(xs) - 1.5, max(xs) + 1.5
        ax.set_xlim(left, right)
        ax.set_ylim(bottom, top)
        fig.set_size_inches(max((right - left) * 0.95, 4), max((top - bottom) * 0.95, 2.5))
        buf = io.BytesIO()
        fig.savefig(buf, format=fmt, dpi=110 if fmt == "png" else None)
    data = buf.getvalue()
    if path:
        Path(path).write_bytes(data)
    return data
