"""``yatt-graph plot DIR``: the reward and KL curves of a run as a PNG."""

from __future__ import annotations

from pathlib import Path

from runtime.metrics import read_metrics

__all__ = ["plot_run"]

# Each panel draws the first of its names that the run's metrics have, as a key or as the
# last part of one ("advantage/kl": the stats of the graph output "advantage"). approx_kl, the
# policy's change within one update, is not a KL to the reference and is not drawn as one.
_CURVES = [
    ("reward", ("scores/mean", "reward/mean")),
    ("KL to reference", ("kl", "kl_ref")),
]


def _panels(rows: list[dict]) -> list[tuple[str, str]]:
    """(title, metrics key) of each panel the rows have a curve for."""
    keys = sorted({k for r in rows for k in r})
    panels = []
    for title, names in _CURVES:
        for name in names:
            found = [name] if name in keys else [k for k in keys if k.endswith("/" + name)]
            if found:
                panels.append((title, found[0]))
                break
    return panels


def plot_run(out_dir: str | Path, path: str | Path | None = None, window: int = 5) -> Path:
    """Draw reward (with a moving average) and KL per step; returns the PNG's path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = read_metrics(out_dir)
    if not rows:
        raise ValueError(f"{out_dir}/metrics.jsonl has no rows to plot")
    panels = _panels(rows)
    if not panels:
        raise ValueError(
            f"{out_dir}/metrics.jsonl has none of the reward/KL keys {[k for _, ks in _CURVES for k in ks]}"
        )
    fig = Figure(figsize=(6.5, 2.6 * len(panels)))
    FigureCanvasAgg(fig)
    for i, (title, key) in enumerate(panels, 1):
        ax = fig.add_subplot(len(panels), 1, i)
        steps = [r["step"] for r in rows if r.get(key) is not None]
        values = [r[key] for r in rows if r.get(key) is not None]
        ax.plot(steps, values, color="#adb5bd", linewidth=1, label=key)
        if len(values) >= window:
            smooth = [
                sum(values[j - window + 1 : j + 1]) / window for j in range(window - 1, len(values))
            ]
            ax.plot(
                steps[window - 1 :], smooth, color="#1c7ed6", linewidth=2, label=f"mean of {window}"
            )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    out = Path(path) if path else Path(out_dir) / "curves.png"
    fig.savefig(out, dpi=110)
    return out
