"""Graphs and plans drawn with matplotlib, to SVG or PNG.

Left to right by topological generation (delayed edges left out), one arrow per connected
node pair labelled with its port names, labels moved along their arrow until they cover no
node and no other label. Edges that skip columns pass through the gaps between the nodes of
the columns they cross; delayed (feedback) edges go dashed around the outside. In a plan, each
controller is a labelled box. The SVG keeps text as text (``svg.fonttype = none``) so node
names can be found in it and stay sharp in notebooks.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import networkx as nx
import numpy as np
from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle
from matplotlib.path import Path as MplPath
from matplotlib.text import Text
from matplotlib.transforms import Bbox

if TYPE_CHECKING:
    from yatt_graph.graph import Edge, Graph
    from yatt_graph.plan import Plan

__all__ = ["KIND_COLORS", "Picture", "draw", "edge_labels", "layered_layout", "layout", "picture"]

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
_COLUMN = 4.2  # horizontal distance between generations
_ROW = 2.0  # vertical distance between the rows of a column
_BAND_GAP = 0.7  # extra rows between two controllers' bands
_INCH = 0.8  # inches per data unit
_LABEL_WIDTH = 26  # characters of port names on one line of an edge label
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


def edge_labels(graph: Graph) -> dict[tuple[str, str], str]:
    """One label per connected node pair: the port names on it, a few to a line.

    ``a→b`` where the output and the input are named differently; ``(next step)`` marks a
    delayed edge. The types are in the text listing (``print(graph)``).
    """
    pairs: dict[tuple[str, str], list[Edge]] = {}
    for e in graph.edges:
        pairs.setdefault((e.src, e.dst), []).append(e)
    labels = {}
    for pair, edges in pairs.items():
        all_delayed = all(e.delay for e in edges)
        names = []
        for e in edges:
            name = e.src_port if e.src_port == e.dst_port else f"{e.src_port}→{e.dst_port}"
            names.append(name + (" (next step)" if e.delay and not all_delayed else ""))
        lines = [""]
        for name in names:
            if lines[-1] and len(lines[-1]) + len(name) > _LABEL_WIDTH:
                lines[-1] += ","
                lines.append("")
            lines[-1] += (", " if lines[-1] else "") + name
        labels[pair] = "\n".join(lines + (["(next step)"] if all_delayed else []))
    return labels


def _bands(graph: Graph, plan: Plan | None, column: dict[str, int]) -> dict[str, int]:
    """The horizontal band of each node: its controller, unless the controllers own disjoint
    runs of columns (then one band, and a box around each controller's run)."""
    if plan is None:
        return dict.fromkeys(graph.nodes, 0)
    spans = sorted(
        (min(column[n] for n in sub.nodes), max(column[n] for n in sub.nodes))
        for sub in plan.subgraphs
        if sub.nodes
    )
    if all(a[1] < b[0] for a, b in zip(spans, spans[1:])):
        return dict.fromkeys(graph.nodes, 0)
    return dict(plan.assignment)


def layout(graph: Graph, plan: Plan | None = None) -> dict[str, tuple[float, float]]:
    """Node positions, left to right: x is the topological generation (delayed edges left
    out), y the node's row (:func:`layered_layout`); in a plan, each controller gets a band
    of rows of its own unless the controllers own disjoint runs of generations."""
    step = graph.step_dag()
    column = {n: i for i, gen in enumerate(nx.topological_generations(step)) for n in gen}
    return layered_layout(step, list(graph.nodes), _bands(graph, plan, column))


def layered_layout(
    step: nx.DiGraph, order: list[str], band: dict[str, int] | None = None
) -> dict[str, tuple[float, float]]:
    """Positions of the nodes of an acyclic ``step`` graph (the graph of one step, without
    delayed edges), in data units: x is the topological generation, y the row. Rows start in
    ``order`` and are sorted by the mean row of each node's neighbours (a few sweeps each way,
    which removes most crossings); ``band`` puts nodes in horizontal bands (all in one by
    default). A run's report draws its recorded graph with it, having no graph object."""
    generations = list(nx.topological_generations(step))
    column = {n: i for i, gen in enumerate(generations) for n in gen}
    band = band or dict.fromkeys(order, 0)
    index = {n: i for i, n in enumerate(order)}
    cells: dict[tuple[int, int], list[str]] = {}
    for n in sorted(order, key=index.__getitem__):
        cells.setdefault((band[n], column[n]), []).append(n)

    def place() -> dict[str, tuple[float, float]]:
        pos, top = {}, 0.0
        for b in sorted({k[0] for k in cells}):
            height = max(len(v) for k, v in cells.items() if k[0] == b)
            for (cb, col), names in cells.items():
                if cb == b:
                    offset = (height - len(names)) / 2
                    for i, n in enumerate(names):
                        pos[n] = (col * _COLUMN, -(top + offset + i) * _ROW)
            top += height + _BAND_GAP
        return pos

    for sweep in range(6):
        pos = place()
        neighbours = step.predecessors if sweep % 2 == 0 else step.successors
        for names in cells.values():
            ys = {n: [pos[m][1] for m in neighbours(n)] for n in names}
            names.sort(key=lambda n: -sum(ys[n]) / len(ys[n]) if ys[n] else -pos[n][1])
    return place()


@dataclass
class Picture:
    """A drawn graph, kept open so that tests (and callers) can inspect what was drawn."""

    figure: Figure
    positions: dict[str, tuple[float, float]]
    """Each node's centre, in data units."""
    labels: dict[tuple[str, str], Text] = field(default_factory=dict)
    """The label of each drawn edge, one per connected node pair."""
    boxes: dict[str, FancyBboxPatch] = field(default_factory=dict)
    """Each node's box."""


def _bezier_through(points: list[tuple[float, float]]) -> MplPath:
    """A smooth path through ``points`` (left to right), horizontal at each of them."""
    verts, codes = [points[0]], [MplPath.MOVETO]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        mid = (x1 - x0) / 2
        verts += [(x0 + mid, y0), (x1 - mid, y1), (x1, y1)]
        codes += [MplPath.CURVE4] * 3
    return MplPath(verts, codes)


def _around(x0: float, x1: float, y0: float, y1: float, lane: float) -> MplPath:
    """A feedback path: out of one box's top (or bottom), along ``lane``, into the other's."""
    r = 0.35 if lane > y0 else -0.35
    sx = 1 if x1 > x0 else -1
    return MplPath(
        [(x0, y0), (x0, lane - r), (x0, lane), (x0 + sx * abs(r), lane), (x1 - sx * abs(r), lane)]
        + [(x1, lane), (x1, lane - r), (x1, y1)],
        [MplPath.MOVETO, MplPath.LINETO, MplPath.CURVE3, MplPath.CURVE3, MplPath.LINETO]
        + [MplPath.CURVE3, MplPath.CURVE3, MplPath.LINETO],
    )


def _route(pos, column, src, dst, start, end, used) -> MplPath:
    """A forward edge: straight to the next column, or through the gaps between the nodes of
    every column it crosses (the gap nearest to the straight line, offset when shared)."""
    points = [start]
    by_column: dict[int, list[float]] = {}
    for n, c in column.items():
        by_column.setdefault(c, []).append(pos[n][1])
    for c in range(column[src] + 1, column[dst]):
        ys = sorted(by_column[c])
        gaps = [ys[0] - _ROW / 2] + [(a + b) / 2 for a, b in zip(ys, ys[1:])] + [ys[-1] + _ROW / 2]
        x = c * _COLUMN
        t = (x - start[0]) / (end[0] - start[0])
        y_line = start[1] + t * (end[1] - start[1])
        gap = min(gaps, key=lambda g: abs(g - y_line))
        k = used.get((c, gap), 0)
        used[(c, gap)] = k + 1
        points.append((x, gap + (k - (k % 2) * 2 * k) * 0.12))
    return _bezier_through([*points, end])


def _ends(graph: Graph, pos, pairs, box_h) -> dict[tuple[str, str], tuple[float, float]]:
    """Where each forward pair leaves its source and enters its destination: spread down the
    right side (out) and the left side (in) of the boxes, in the order of the other ends."""
    out: dict[str, list[tuple[str, str]]] = {}
    inn: dict[str, list[tuple[str, str]]] = {}
    for p in pairs:
        out.setdefault(p[0], []).append(p)
        inn.setdefault(p[1], []).append(p)
    y_out, y_in = {}, {}
    for groups, other, into in ((out, 1, y_out), (inn, 0, y_in)):
        for name, ps in groups.items():
            ps.sort(key=lambda p: -pos[p[other]][1])
            span = box_h * 0.7
            for i, p in enumerate(ps):
                frac = 0.5 if len(ps) == 1 else i / (len(ps) - 1)
                into[p] = pos[name][1] + span / 2 - frac * span
    return {p: (y_out[p], y_in[p]) for p in pairs}


def _overlap(a: Bbox, b: Bbox) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def _place_label(text: Text, path: MplPath, taken: list[Bbox], renderer) -> None:
    """Move ``text`` along ``path`` to the first spot where it covers no box and no other
    label (the least-covered spot if there is none)."""
    line = np.concatenate(path.to_polygons(closed_only=False))
    steps = np.hypot(*np.diff(line, axis=0).T)
    length = np.concatenate([[0.0], np.cumsum(steps)])
    best = None
    for t in (0.5, 0.4, 0.6, 0.3, 0.7, 0.2, 0.8, 0.35, 0.65, 0.25, 0.75, 0.15, 0.85, 0.1, 0.9):
        at = t * length[-1]
        x, y = np.interp(at, length, line[:, 0]), np.interp(at, length, line[:, 1])
        text.set_position((x, y))
        box = text.get_window_extent(renderer).expanded(1.08, 1.15)
        cover = sum(_overlap(box, other) for other in taken)
        if best is None or cover < best[0]:
            best = (cover, (x, y), box)
        if cover == 0:
            break
    assert best is not None
    text.set_position(best[1])
    taken.append(best[2])


def picture(graph: Graph, plan: Plan | None = None) -> Picture:
    """Draw the graph (or its plan) on a matplotlib figure: columns left to right, one arrow
    per connected node pair with its port names, delayed edges dashed around the outside."""
    pos = layout(graph, plan)
    column = {n: round(x / _COLUMN) for n, (x, _) in pos.items()}
    box_w, box_h = 2.0, 0.8
    labels = edge_labels(graph)
    delayed = {p for p in labels if all(e.delay for e in _pair_edges(graph, p))}
    forward = [p for p in labels if p not in delayed]
    ys = [y for _, y in pos.values()] or [0.0]
    xs = [x for x, _ in pos.values()] or [0.0]
    lanes = {p: _lane_side(pos, column, p) for p in delayed}
    n_up = sum(1 for side in lanes.values() if side > 0)
    n_down = len(lanes) - n_up
    # room for the edges that pass above or below a column's nodes, then for the feedback lanes
    top = max(ys) + _ROW / 2 + 0.6 + 0.55 * n_up + (0.5 if plan else 0.0)
    bottom = min(ys) - _ROW / 2 - 0.6 - 0.55 * n_down - (0.3 if plan else 0.0)
    left, right = min(xs) - 1.5, max(xs) + 1.5
    fig = Figure(figsize=(max((right - left) * _INCH, 4), max((top - bottom + 0.5) * _INCH, 2.5)))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_axis_off()
    ax.set_xlim(left, right)
    ax.set_ylim(bottom, top + 0.5)
    result = Picture(fig, pos)
    if plan:
        _controller_boxes(ax, plan, pos, box_w, box_h)
    for name, (x, y) in pos.items():
        node = graph.nodes[name]
        result.boxes[name] = ax.add_patch(
            FancyBboxPatch(
                (x - box_w / 2, y - box_h / 2),
                box_w,
                box_h,
                boxstyle="round,pad=0.05,rounding_size=0.15",
                facecolor=KIND_COLORS.get(node.kind, "#ffffff"),
                edgecolor="#333",
                linewidth=1.2,
                zorder=3,
            )
        )
        ax.text(x, y + 0.1, name, ha="center", va="center", fontsize=9, fontweight="bold", zorder=4)
        kind = f"{node.kind} · {node.label}"
        ax.text(x, y - 0.2, kind, ha="center", va="center", fontsize=6.5, color="#444", zorder=4)
    ax.text(left + 0.1, top + 0.4, graph.name, fontsize=11, fontweight="bold", va="top")
    renderer = fig.canvas.get_renderer()
    taken = [b.get_window_extent(renderer) for b in result.boxes.values()]
    ends, used = _ends(graph, pos, forward, box_h), {}
    paths = {}
    for src, dst in forward:
        (x0, _), (x1, _) = pos[src], pos[dst]
        y_out, y_in = ends[(src, dst)]
        start, end = (x0 + box_w / 2, y_out), (x1 - box_w / 2, y_in)
        paths[(src, dst)] = _route(pos, column, src, dst, start, end, used)
    counts = {1: 0, -1: 0}
    for p in sorted(delayed, key=lambda p: abs(pos[p[0]][0] - pos[p[1]][0])):
        side = lanes[p]
        counts[side] += 1
        edge_y = max(ys) + box_h / 2 if side > 0 else min(ys) - box_h / 2
        lane = edge_y + side * (_ROW / 2 + 0.55 * counts[side] + (0.3 if plan else 0.0))
        (x0, y0), (x1, y1) = pos[p[0]], pos[p[1]]
        paths[p] = _around(x0 + 0.3, x1 - 0.3, y0 + side * box_h / 2, y1 + side * box_h / 2, lane)
    for pair, path in paths.items():
        ax.add_patch(
            FancyArrowPatch(
                path=path,
                arrowstyle="-|>",
                mutation_scale=11,
                color="#555",
                linestyle="--" if pair in delayed else "-",
                linewidth=1.0,
                zorder=2,
            )
        )
    for pair in sorted(paths, key=lambda p: (pos[p[0]][0], -pos[p[0]][1])):
        text = ax.text(
            0,
            0,
            labels[pair],
            fontsize=6.5,
            ha="center",
            va="center",
            color="#333",
            linespacing=1.1,
            zorder=5,
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "#bbb", "lw": 0.4},
        )
        _place_label(text, paths[pair], taken, renderer)
        result.labels[pair] = text
    return result


def _pair_edges(graph: Graph, pair: tuple[str, str]) -> list[Edge]:
    return [d["edge"] for d in graph.dag.get_edge_data(*pair).values()]


def _lane_side(pos, column, pair) -> int:
    """Route a feedback edge above (1) or below (-1): the side with fewer boxes to cross."""
    above = below = 0
    for end in pair:
        for n, c in column.items():
            if c == column[end] and n != end:
                above += pos[n][1] > pos[end][1]
                below += pos[n][1] < pos[end][1]
    return 1 if above <= below else -1


def _controller_boxes(ax, plan: Plan, pos, box_w: float, box_h: float) -> None:
    for sub in plan.subgraphs:
        if not sub.nodes:
            continue
        color = _BAND_COLORS[sub.controller % len(_BAND_COLORS)]
        bx = [pos[n][0] for n in sub.nodes]
        by = [pos[n][1] for n in sub.nodes]
        x0, y0 = min(bx) - box_w / 2 - 0.3, min(by) - box_h / 2 - 0.3
        w, h = max(bx) - min(bx) + box_w + 0.6, max(by) - min(by) + box_h + 0.75
        ax.add_patch(
            Rectangle((x0, y0), w, h, facecolor=color, alpha=0.08, edgecolor=color, lw=1.5, ls="--")
        )
        title = f"controller {sub.controller}" + (f" ({sub.group})" if sub.group else "")
        ax.text(
            x0 + 0.1, y0 + h - 0.05, title, color=color, fontsize=9, fontweight="bold", va="top"
        )


def draw(
    graph: Graph, plan: Plan | None = None, *, path: str | None = None, fmt: str | None = None
) -> bytes:
    """Draw to SVG or PNG bytes; ``fmt`` defaults to the suffix of ``path``, else SVG."""
    fmt = (fmt or (Path(path).suffix.lstrip(".") if path else "svg")).lower()
    if fmt not in ("svg", "png"):
        raise ValueError(f"draw: format must be svg or png, got {fmt!r}")
    with rc_context({"svg.fonttype": "none", "font.family": "DejaVu Sans"}):
        fig = picture(graph, plan).figure
        buf = io.BytesIO()
        fig.savefig(buf, format=fmt, dpi=110 if fmt == "png" else None)
    data = buf.getvalue()
    if path:
        Path(path).write_bytes(data)
    return data
