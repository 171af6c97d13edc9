"""The training loop shared by ``yatt-graph run``, notebooks and tests.

It runs an executor (``run()``, so that a ZeroMQ run keeps steps in flight between
checkpoints), writes a metrics row per step, checkpoints every K steps (and at
the end), records node spans for a Chrome trace, and shows a progress bar with steps,
samples/s, reward and KL.

A run folder holds one run: ``train()`` continues it from the executor's step, dropping
the metric rows and trace spans of that step and later (a resumed run repeats none), and
each checkpoint records the graph's identity (:mod:`runtime.train.identity`), so resuming
with another graph or other options is refused. A SIGTERM under
:func:`runtime.train.signals.sigterm_as_interrupt` stops a run after the steps in progress
(``run(stop=...)``), with a checkpoint when ``checkpoint_every`` is set.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from runtime.engine.calls import Executor
from runtime.train import signals
from runtime.train.checkpoint import checkpoints, load_checkpoint, save_checkpoint
from runtime.train.identity import graph_identity
from runtime.train.metrics import CURVES, MetricsWriter, curve_key, summarize, truncate_metrics
from runtime.train.samples import ROLLOUT, SampleWriter, sample_rows
from runtime.train.signals import Terminated
from runtime.train.trace import Tracer

__all__ = ["train", "utilization"]


def _progress_fields(row: dict[str, Any], samples_per_s: float) -> dict[str, str]:
    fields = {"samples/s": f"{samples_per_s:.1f}"}
    for label, names in CURVES.items():
        key = curve_key(row, names)
        if key is not None:
            fields[label] = f"{row[key]:.3f}"
    return fields


def scheduling(result: Any) -> dict[str, float]:
    """``staleness/<dst.port>`` (versions behind the newest: 0 on-policy, -1 when the input
    read None) and the executor's ``sched/*`` figures (threads and cores per controller, the
    adaptive partitioner's changes)."""
    row = {
        f"staleness/{key}": -1 if age is None else age
        for key, age in getattr(result, "staleness", {}).items()
    }
    for key, value in getattr(result, "sched", {}).items():
        row[key if key.startswith("sched/") else f"sched/{key}"] = value
    return row


def utilization(result: Any, step_seconds: float) -> dict[str, float]:
    """Per controller, the share of the step's wall time its nodes were running."""
    busy: dict[int, float] = {}
    for node, seconds in result.node_seconds.items():
        controller = result.node_controller.get(node, 0)
        busy[controller] = busy.get(controller, 0.0) + seconds
    if step_seconds <= 0:
        return {}
    return {f"util/controller_{c}": min(1.0, b / step_seconds) for c, b in sorted(busy.items())}


GLANCE_ROWS = 3
"""Responses a glance shows."""


def glance(step: int, outputs: dict[str, Any], rows: int = GLANCE_ROWS) -> list[str]:
    """A few of a step's responses with their prompts and rewards, for people: the first of
    each of the first ``rows`` prompts (none where the graph does not output its samples,
    :func:`runtime.train.samples.sample_rows`)."""
    cols = sample_rows(step, outputs)
    if not cols or not cols["sample"]:
        return []
    first: dict[int, int] = {}  # prompt -> its first response
    for i, prompt in enumerate(cols["prompt_index"]):
        first.setdefault(prompt, i)
    shown = list(first.values())[:rows]
    lines = [f"step {step}: {len(shown)} of {len(cols['sample'])} responses"]
    for i in shown:
        prompt, text = _short(cols["prompt"][i]), _short(cols["response"][i])
        lines.append(f"  {prompt} -> {text} (reward {cols['reward'][i]:.3g})")
    return lines


def _short(value: str, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 4] + "...'"


def train(
    executor: Executor,
    steps: int,
    out_dir: str | Path | None = None,
    *,
    checkpoint_every: int = 0,
    resume: str | Path | None = None,
    progress: bool = True,
    meta: dict[str, Any] | None = None,
    glance_every: int = 0,
    samples_every: int = 0,
    wandb: str | None = None,
) -> list[dict[str, Any]]:
    """Run until ``steps`` steps are done in all (a resumed run counts the steps it restored).

    ``glance_every``: with the progress bar, every this many steps print a few of the step's
    responses with their prompts and rewards, where the graph outputs ``texts``, ``prompts``
    and ``scores`` (the ready graphs do); 0: never. ``samples_every``: every this many steps
    write those samples to ``OUT/samples/`` (:mod:`runtime.train.samples`); 0: never.
    ``wandb``: a W&B project to log the scalars and the kept samples to, beside ``OUT``
    (:mod:`runtime.train.wandb_log`; offline without a key); None: none.

    ``meta`` joins each checkpoint's ``meta.json`` (``yatt-graph run`` records the graph
    reference and options there, for ``yatt-graph export``). Returns the metric rows of the
    steps run here. A SIGTERM raises :class:`Terminated` with ``step`` and ``checkpoint`` set.
    """
    identity = graph_identity(executor.graph)
    if resume is not None:
        path, state = load_checkpoint(resume, identity)
        executor.load_state_dict(state)
        print(f"resumed from {path} at step {executor.next_step}", file=sys.stderr)
    out = Path(out_dir) if out_dir is not None else None
    tracer = Tracer()
    if out is not None:
        truncate_metrics(out, executor.next_step)
        if executor.next_step > 0:
            tracer.keep_earlier(out / "trace.json", executor.next_step)
    writer = MetricsWriter(out) if out is not None else None
    kept = SampleWriter(out, samples_every) if out is not None else None
    board = None
    if wandb is not None and out is not None:
        from runtime.train.wandb_log import WandbLog

        board = WandbLog(out, wandb, config=meta)
    record_meta = {**(meta or {}), "graph": identity}
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
        row.update(scheduling(result))
        if rows and row.get("sched/rebalances", 0) != rows[-1].get("sched/rebalances", 0):
            tracer.instant(
                "rebalance", time.time(), step=result.step,
                **{k: v for k, v in row.items() if k.startswith("sched/")},
            )  # fmt: skip
        rows.append(row)
        for node, start in result.node_start.items():
            controller = result.node_controller.get(node, 0)
            tracer.span(node, start, result.node_seconds[node], controller, step=result.step)
        for what, start, seconds, moved, controller in result.switches:
            tracer.span(what, start, seconds, controller, step=result.step, bytes=moved)
        if result.outputs.get("trajectories"):  # a multi-turn rollout's turns
            controller = result.node_controller.get(ROLLOUT, 0)
            tracer.turns(result.outputs["trajectories"], controller, result.step)
        if writer is not None:
            writer.write(row)
        if board is not None:
            board.scalars(row)
        if kept is not None:
            path = kept.write(
                result.step, result.outputs,
                staleness=result.staleness, controllers=result.node_controller,
                replicas=result.replicas,
            )  # fmt: skip
            if board is not None and path is not None:
                kept.flush()  # the table is the file's rows (a wait only with --wandb)
                if path.is_file():  # (not written once the folder is full)
                    board.samples(result.step, path)
        bar.set_postfix(_progress_fields(row, row["samples_per_s"]), refresh=False)
        bar.update(1)
        if progress and glance_every > 0 and (result.step + 1) % glance_every == 0:
            lines = glance(result.step, result.outputs)
            if lines:
                bar.write("\n".join(lines), file=sys.stderr)

    saving = out is not None and checkpoint_every > 0

    def save() -> Path:
        return save_checkpoint(out, executor.next_step, executor.state_dict(), meta=record_meta)

    try:
        left = remaining
        # A SIGTERM waits for a step boundary (run() finishes the steps in flight and returns),
        # so the state a checkpoint takes is whole, in one process or on controllers.
        with signals.at_step_boundary(lambda: signals.node_call_in_progress(executor)):
            while left > 0:
                # Whole stretches between checkpoints go to run(), which keeps steps in flight
                # (ZmqExecutor pipelines them); a checkpoint needs the executor between steps.
                n = left
                if saving:
                    n = min(n, checkpoint_every - executor.next_step % checkpoint_every)
                before = executor.next_step
                executor.run(n, on_step=record, stop=signals.pending)
                signals.check()
                left -= executor.next_step - before
                if saving and executor.next_step % checkpoint_every == 0:
                    save()
                    last[0] = time.perf_counter()
    except Terminated as exc:
        exc.step, exc.checkpoint = executor.next_step, None
        newest = checkpoints(out)[-1] if saving and checkpoints(out) else None
        if saving and not getattr(executor, "closed", False):
            newest = save()  # the state after the last whole step
        exc.checkpoint = newest
        raise
    finally:
        bar.close()
        if writer is not None:
            writer.close()
        if kept is not None:
            kept.close()
        if board is not None:
            board.close()
        if out is not None:
            tracer.save(out / "trace.json")
    if (
        out is not None
        and remaining
        and checkpoint_every > 0
        and executor.next_step % checkpoint_every
    ):
        save()
    return rows
