"""``yatt-graph report RUN``: one self-contained HTML page about a run folder, readable offline.

It reads what a run writes (:mod:`runtime.train.run_folder`): ``metrics.jsonl`` (the curves,
node times), ``trace.json`` (node time and each controller's busy share over the run),
``graph.json`` (the graph, drawn with :func:`yatt_graph.drawing.layered_layout`),
``samples/*.parquet`` (the sample browser, the best and worst samples of a step; the
thumbnails their ``image`` column names, from ``samples/_images/``, inline once each; read by
:mod:`runtime.train.report_samples`),
``settings.json``, ``summary.json`` and ``events.jsonl``. Each part that is missing or cut
short (a run in progress, a crashed one, a folder from before a file existed) becomes a note
on the page. The page is ``report_page/page.html`` with its CSS, its script and the data (one
JSON object) put inline: no network, no CDN.
"""

from __future__ import annotations

import json
import re
import time
import warnings
from pathlib import Path
from typing import Any

from runtime.train.metrics import CURVES, curve_key, json_number, read_metrics
from runtime.train.report_samples import sample_browser
from runtime.train.trace import read_trace
from yatt_graph import UsageError

__all__ = ["REPORT_CURVES", "report_data", "write_report"]

#: The report's curves: (id, title, metric names in order of preference; see :func:`curve_key`).
REPORT_CURVES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("reward", "reward (mean of the step)", CURVES["reward"]),
    ("kl", "KL to the reference", CURVES["kl"]),
    ("length", "response length (tokens, mean)", ("response_lengths/mean", "length/mean")),
    ("throughput", "throughput (samples/s)", ("samples_per_s",)),
)

#: The validation curves (``--val-data``): the metric's last part -> (id, title); ``k`` is the
#: number of samples of ``val_samples``, read from the name (``val/pass@4``).
VALIDATION_CURVES: dict[str, tuple[str, str]] = {
    "reward": ("val-greedy", "validation reward (greedy)"),
    "greedy": ("val-greedy", "validation reward (greedy)"),
    "avg": ("val-avg", "validation avg@{k} (mean reward of {k} samples)"),
    "pass": ("val-pass", "validation pass@{k} (a row with a passing sample)"),
}
_VALIDATION_KEY = re.compile(r"^(?:.*/)?val/(reward|greedy|avg|pass)(?:@(\d+))?$")

_RUN_FILES = ("metrics.jsonl", "trace.json", "settings.json", "summary.json", "samples")
_UTIL_BINS = 120
_PAGE = Path(__file__).with_name("report_page")


def _metrics(run: Path, notes: list[str]) -> list[dict[str, Any]]:
    if not (run / "metrics.jsonl").is_file():
        notes.append("no metrics.jsonl: the run stopped before its first step ended")
        return []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            rows = read_metrics(run)
        except (ValueError, OSError) as exc:
            notes.append(f"metrics.jsonl could not be read ({exc}); no curves")
            return []
    notes.extend(str(w.message) for w in caught if issubclass(w.category, RuntimeWarning))
    return rows


def _curves(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = {k for r in rows for k in r}
    curves = []
    for ident, title, names in REPORT_CURVES:
        key = curve_key(keys, names)
        if key is not None:
            values = [json_number(r.get(key)) for r in rows]
            curves.append({"id": ident, "title": title, "key": key, "y": values})
    return {"steps": [r["step"] for r in rows], "curves": curves + _validation_curves(rows, keys)}


def _validation_curves(rows: list[dict[str, Any]], keys: set[str]) -> list[dict[str, Any]]:
    """The curves of validation passes: greedy reward, avg@k and pass@k. A pass runs every
    ``val_every`` steps, so the steps between two passes get the straight line joining them
    (the chart draws a line through defined values only); none before the first or after
    the last pass."""
    found = []
    for key in keys:
        match = _VALIDATION_KEY.match(key)
        if match and (match.group(1) in ("reward", "greedy")) == (match.group(2) is None):
            found.append((list(VALIDATION_CURVES).index(match.group(1)), key, match))
    curves = []
    for _, key, match in sorted(found):
        ident, title = VALIDATION_CURVES[match.group(1)]
        values = [json_number(r.get(key)) for r in rows]
        y = _joined([v if isinstance(v, int | float) else None for v in values])
        curves.append({"id": ident, "title": title.format(k=match.group(2)), "key": key, "y": y})
    return curves


def _joined(values: list[float | None]) -> list[float | None]:
    """``values`` with each gap between two defined values filled by the line joining them."""
    out = list(values)
    known = [i for i, v in enumerate(values) if v is not None]
    for a, b in zip(known, known[1:], strict=False):
        for i in range(a + 1, b):
            out[i] = values[a] + (values[b] - values[a]) * (i - a) / (b - a)
    return out


def _trace_events(run: Path, notes: list[str]) -> list[dict[str, Any]] | None:
    """The events of ``trace.json``; of one cut short (a writer still at it), those before
    the cut; None without one."""
    path = run / "trace.json"
    if not path.is_file():
        notes.append(
            "no trace.json: the run has not written a step's spans yet (or was killed before "
            "it did); node times come from metrics.jsonl, utilization from its util/* rows"
        )
        return None
    try:
        events, _, whole = read_trace(path)
    except (OSError, ValueError) as exc:
        notes.append(f"{exc}; node times come from metrics.jsonl, utilization from its util/* rows")
        return None
    if not whole:
        notes.append(
            f"trace.json is cut short (the run is writing it, or was killed); read its first "
            f"{len(events)} events"
        )
    return events


def _controller_names(events: list[dict[str, Any]]) -> dict[int, str]:
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e.get("pid", 0)] = str(
                (e.get("args") or {}).get("name", f"controller {e.get('pid')}")
            )
    return names


def _node_times(
    rows: list[dict[str, Any]], events: list[dict[str, Any]] | None, node_names: list[str]
) -> dict[str, Any]:
    """Per node: its time per step, mean, total, share of all node time, controllers."""
    per_step: dict[str, dict[int, float]] = {}
    controllers: dict[str, set[int]] = {}
    source = "trace.json"
    spans = [  # a call's parts (a rollout's turns) are inside its node's span
        e
        for e in events or []
        if e.get("ph") == "X" and isinstance(e.get("dur"), int | float) and e.get("cat") != "turn"
    ]
    if spans:
        for e in spans:
            step = (e.get("args") or {}).get("step")
            name = str(e.get("name"))
            per_step.setdefault(name, {})
            if isinstance(step, int):
                per_step[name][step] = per_step[name].get(step, 0.0) + e["dur"] / 1e6
            controllers.setdefault(name, set()).add(int(e.get("pid", 0)))
    else:
        source = "metrics.jsonl"
        for r in rows:
            for key, value in r.items():
                if (
                    key.startswith("time/")
                    and key != "time/step"
                    and isinstance(value, int | float)
                ):
                    per_step.setdefault(key[5:], {})[r["step"]] = float(value)
    total_all = sum(sum(v.values()) for v in per_step.values()) or 1.0
    order = {n: i for i, n in enumerate(node_names)}
    seen = {n: i for i, n in enumerate(per_step)}  # first traced first
    names = sorted(per_step, key=lambda n: (order.get(n, len(order)), seen[n]))
    table = []
    for name in names:
        times = per_step[name]
        total = sum(times.values())
        table.append(
            {
                "name": name,
                "steps": len(times),
                "mean_s": total / len(times) if times else 0.0,
                "total_s": total,
                "share": total / total_all,
                "controllers": sorted(controllers.get(name, ())),
            }
        )
    steps = sorted({s for v in per_step.values() for s in v})
    series = [{"name": n, "y": [per_step[n].get(s) for s in steps]} for n in names]
    return {"source": source, "table": table, "steps": steps, "series": series}


def _utilization(rows: list[dict[str, Any]], events: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Each controller's busy share over the run: from the trace's spans in time bins (the
    union of its spans, so overlapping calls count once), else per step from ``util/*``."""
    spans = [
        (int(e.get("pid", 0)), float(e["ts"]) / 1e6, (float(e["ts"]) + float(e["dur"])) / 1e6)
        for e in events or []
        if e.get("ph") == "X"
        and isinstance(e.get("ts"), int | float)
        and isinstance(e.get("dur"), int | float)
    ]
    if spans:
        names = _controller_names(events or [])
        t0, t1 = min(s[1] for s in spans), max(s[2] for s in spans)
        bins = max(1, min(_UTIL_BINS, len(spans)))
        width = (t1 - t0) / bins or 1.0
        series = []
        for pid in sorted({s[0] for s in spans}):
            busy = [0.0] * bins
            merged: list[list[float]] = []
            for _, a, b in sorted(s for s in spans if s[0] == pid):
                if merged and a <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            for a, b in merged:
                first, last = int((a - t0) / width), min(bins - 1, int((b - t0) / width))
                for i in range(max(0, first), last + 1):
                    lo, hi = t0 + i * width, t0 + (i + 1) * width
                    busy[i] += max(0.0, min(b, hi) - max(a, lo))
            series.append(
                {
                    "name": names.get(pid, f"controller {pid}"),
                    "y": [min(1.0, x / width) for x in busy],
                }
            )
        x = [round(t0 + (i + 0.5) * width - t0, 4) for i in range(bins)]
        return {"x": x, "xlabel": "seconds into the run", "series": series}
    keys = sorted({k for r in rows for k in r if k.startswith("util/")})
    series = [
        {
            "name": k.removeprefix("util/").replace("_", " "),
            "y": [json_number(r.get(k)) for r in rows],
        }
        for k in keys
    ]
    return {"x": [r["step"] for r in rows], "xlabel": "step", "series": series}


def _read_json(run: Path, name: str, notes: list[str], missing: str | None) -> Any:
    path = run / name
    if not path.is_file():
        if missing:
            notes.append(missing)
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        notes.append(f"{name} could not be read ({exc})")
        return None


def _graph(
    record: Any,
    events: list[dict[str, Any]] | None,
    node_table: list[dict[str, Any]],
    notes: list[str],
) -> dict[str, Any] | None:
    """The graph's nodes placed in layers, with their mean time and share, and its edges."""
    import networkx as nx

    from yatt_graph.drawing import KIND_COLORS, layered_layout

    times = {t["name"]: t for t in node_table}
    if isinstance(record, dict) and isinstance(record.get("nodes"), list):
        nodes = [(str(n["name"]), str(n.get("kind", ""))) for n in record["nodes"]]
        edges = [e for e in record.get("edges", []) if isinstance(e, dict)]
        name = record.get("name")
    else:
        order = [t["name"] for t in node_table]
        if not order:
            return None
        notes.append(
            "no graph.json (a run from before runs recorded their graph): the graph shows the "
            "nodes in the order they ran, without edges"
        )
        nodes, edges, name = [(n, "") for n in order], [], None
    step = nx.DiGraph()
    step.add_nodes_from(n for n, _ in nodes)
    step.add_edges_from((e["src"], e["dst"]) for e in edges if not e.get("delay"))
    if edges:
        pos = layered_layout(step, [n for n, _ in nodes])
    else:  # a row of the nodes as they ran
        pos = {n: (i * 4.2, 0.0) for i, (n, _) in enumerate(nodes)}
    pairs: dict[tuple[str, str], dict[str, Any]] = {}
    for e in edges:
        pair = pairs.setdefault(
            (e["src"], e["dst"]), {"src": e["src"], "dst": e["dst"], "delay": True, "ports": []}
        )
        pair["delay"] = pair["delay"] and bool(e.get("delay"))
        port = (
            e["src_port"] if e["src_port"] == e["dst_port"] else f"{e['src_port']}→{e['dst_port']}"
        )
        pair["ports"].append(port)
    return {
        "name": name,
        "nodes": [
            {
                "name": n,
                "kind": kind,
                "x": pos[n][0],
                "y": pos[n][1],
                "color": KIND_COLORS.get(kind, "#ffffff"),
                "mean_s": times.get(n, {}).get("mean_s"),
                "share": times.get(n, {}).get("share"),
                "controllers": times.get(n, {}).get("controllers", []),
            }
            for n, kind in nodes
        ],
        "edges": list(pairs.values()),
    }


def _status(run: Path, summary: Any) -> str:
    if isinstance(summary, dict) and summary.get("steps") is not None:
        resumed = summary.get("resumed_at")
        part = f" (resumed at step {resumed})" if resumed else ""
        return (
            f"finished: {summary['steps']} steps{part} in {summary.get('wall_s', 0):.1f} s, "
            f"{summary.get('samples_per_s', 0):.1f} samples/s"
        )
    from runtime.pids import pid_alive

    held = _read_json(run, ".lock", [], None)  # (empty between runs)
    pid = held.get("pid") if isinstance(held, dict) else None
    if isinstance(pid, int) and pid_alive(pid):
        return f"in progress (pid {pid} on {held.get('host', '?')})"
    return "stopped before its end (no summary.json): the page shows what it wrote"


def _events(run: Path) -> list[Any]:
    path = run / "events.jsonl"
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def check_run_folder(run: Path) -> None:
    """``run`` is a run folder; else a UsageError saying what it is and what to give."""
    if not run.exists():
        raise UsageError(f"report: {run} does not exist; give the --out folder of a yatt-graph run")
    if not run.is_dir():
        raise UsageError(f"report: {run} is a file; give the --out folder of a yatt-graph run")
    if not any((run / name).exists() for name in _RUN_FILES):
        raise UsageError(
            f"report: {run} is not a run folder (it has none of {', '.join(_RUN_FILES)}); give "
            "the --out folder of a yatt-graph run"
        )


def report_data(run: str | Path) -> dict[str, Any]:
    """Everything the page shows, as JSON values; each part missing or cut short is a note."""
    run = Path(run)
    check_run_folder(run)
    notes: list[str] = []
    rows = _metrics(run, notes)
    summary = _read_json(run, "summary.json", notes, None)
    settings = _read_json(
        run, "settings.json", notes,
        "no settings.json (a run from before runs recorded their settings): no settings shown",
    )  # fmt: skip
    record = _read_json(run, "graph.json", [], None)
    events = _trace_events(run, notes)
    names = (
        [str(n["name"]) for n in record["nodes"]]
        if isinstance(record, dict) and isinstance(record.get("nodes"), list)
        else []
    )
    nodes = _node_times(rows, events, names)
    return {
        "run": str(run.resolve()),
        "title": run.resolve().name,
        "written": time.strftime("%Y-%m-%d %H:%M:%S"),
        "status": _status(run, summary),
        "summary": summary,
        "notes": notes,
        "metrics": _curves(rows),
        "nodes": nodes,
        "utilization": _utilization(rows, events),
        "graph": _graph(record, events, nodes["table"], notes),
        "samples": sample_browser(run, notes),
        "settings": settings,
        "events": _events(run),
    }


def render(data: dict[str, Any]) -> str:
    """The page: its template with the CSS, the script and ``data`` put inline."""
    page = (_PAGE / "page.html").read_text(encoding="utf-8")
    style = (_PAGE / "page.css").read_text(encoding="utf-8")
    script = (_PAGE / "page.js").read_text(encoding="utf-8")
    # In a <script> element only "</" can end it early; "<\/" is the same JSON string.
    payload = json.dumps(data, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")
    title = data["title"].replace("&", "&amp;").replace("<", "&lt;")
    return (
        page.replace("/*STYLE*/", style)
        .replace("/*SCRIPT*/", script)
        .replace("/*DATA*/", payload)
        .replace("{{TITLE}}", title)
    )


def write_report(run: str | Path, path: str | Path | None = None) -> Path:
    """Write the page about ``run`` to ``path`` (default ``RUN/report.html``); returns it."""
    run = Path(run)
    check_run_folder(run)
    out = Path(path) if path is not None else run / "report.html"
    if out.is_dir():
        raise UsageError(
            f"report: -o {out} is a folder; name a file, such as {out / 'report.html'}"
        )
    html = render(report_data(run))
    try:
        out.write_text(html, encoding="utf-8")
    except OSError as exc:
        raise UsageError(
            f"report: -o {out}: cannot write there ({exc.strerror or exc}); choose a file in a "
            "folder you can write to"
        ) from None
    return out
