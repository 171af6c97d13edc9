"""The training loop shared by ``yatt-graph run``, notebooks and tests.

It runs an executor (``run()``, so that a ZeroMQ run keeps steps in flight between
checkpoints), writes a metrics row per step, checkpoints every K steps (and at
the end), records node spans for a Chrome trace, and shows a progress bar with steps,
samples/s, reward and KL.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from runtime.train.checkpoint import load_checkpoint, save_checkpoint
from runtime.train.metrics import CURVES, MetricsWriter, curve_key, summarize
from runtime.train.trace import Tracer

__all__ = ["train", "utilization"]


def _progress_fields(row: dict[str, Any], samples_per_s: float) -> dict[str, str]:
    fields = {"samples/s": f"{samples_per_s:.1f}"}
    for label, names in CURVES.items():
        key = curve_key(row, names)
        if key is not None:
            fields[label] = f"{row[key]:.3f}"
    return fields


def utilization(result: Any, step_seconds: float) -> dict[str, float]:
    """Per controller, the share of the step's wall time its nodes were running."""
    busy: dict[int, float] = {}
    for node, seconds in result.node_seconds.items():
        controller = result.node_controller.get(node, 0)
        busy[controller] = busy.get(controller, 0.0) + seconds
    if step_seconds <= 0:
        return {}
    return {f"util/controller_{c}": min(1.0, b / step_seconds) for c, b in sorted(busy.items())}


def train(
    executor: Any,
    steps: int,
    out_dir: str | Path | None = None,
    *,
    checkpoint_every: int = 0,
    resume: str | Path | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run until ``steps`` steps are done in all (a resumed run counts the steps it restored).

    Returns the metric rows of the steps run here.
    """
    if resume is not None:
        path, state = load_checkpoint(resume)
        executor.load_state_dict(state)
        print(f"resumed from {path} at step {executor.next_step}", file=sys.stderr)
    out = Path(out_dir) if out_dir is not None else None
    writer = MetricsWriter(out) if out is not None else None
    tracer = Tracer()
    rows: list[dict[str, Any]] = []
    remaining = max(0, steps - executor.next_step)
    from tqdm import tqdm

    bar = tqdm(
        total=steps,
        initial=executor.next_step,
        desc=executor.graph.name,
        unit="step",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    last = [time.perf_counter()]

    def record(result: Any) -> None:
        now = time.perf_counter()
        seconds, last[0] = now - last[0], now  # since the step before it came in
        row = summarize(result.step, result.outputs, result.node_seconds, seconds)
        scores = result.outputs.get("scores")
        samples = len(scores) if scores is not None and hasattr(scores, "__len__") else 0
        row["samples_per_s"] = samples / seconds if seconds > 0 else 0.0
        row.update(utilization(result, seconds))
        rows.append(row)
        for node, start in result.node_start.items():
            controller = result.node_controller.get(node, 0)
            tracer.span(node, start, result.node_seconds[node], controller, step=result.step)
        if writer is not None:
            writer.write(row)
        bar.set_postfix(_progress_fields(row, row["samples_per_s"]), refresh=False)
        bar.update(1)

    saving = out is not None and checkpoint_every > 0
    try:
        left = remaining
        while left > 0:
            # Whole stretches between checkpoints go to run(), which keeps steps in flight
            # (ZmqExecutor pipelines them); a checkpoint needs the executor between steps.
            n = left
            if saving:
                n = min(n, checkpoint_every - executor.next_step % checkpoint_every)
            executor.run(n, on_step=record)
            left -= n
            if saving and executor.next_step % checkpoint_every == 0:
                save_checkpoint(out, executor.next_step, executor.state_dict())
                last[0] = time.perf_counter()
    finally:
        bar.close()
        if writer is not None:
            writer.close()
        if out is not None:
            tracer.save(out / "trace.json")
    if (
        out is not None
        and remaining
        and checkpoint_every > 0
        and executor.next_step % checkpoint_every
    ):
        save_checkpoint(out, executor.next_step, executor.state_dict())
    return rows
