"""``yatt-graph plot DIR``: the reward and KL curves of a run as a PNG."""

from __future__ import annotations

from pathlib import Path

from runtime.train.metrics import CURVES, curve_key, read_metrics

__all__ = ["plot_run"]

_TITLES = {"reward": "reward", "kl": "KL to reference"}


def _panels(rows: list[dict]) -> list[tuple[str, str]]:
    """(title, metrics key) of each panel the rows have a curve for (:data:`CURVES`)."""
    keys = {k for r in rows for k in r}
    panels = []
    for curve, names in CURVES.items():
        key = curve_key(keys, names)
        if key is not None:
            panels.append((_TITLES[curve], key))
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
            f"{out_dir}/metrics.jsonl has none of the reward/KL keys {[k for ks in CURVES.values() for k in ks]}"
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
