"""The training loop shared by ``yatt-graph run``, notebooks and tests, with its restarts and
its SIGTERM handling.

:func:`train` runs an executor (``run()``, so that a ZeroMQ run keeps steps in flight between
checkpoints), writes a metrics row per step, checkpoints every K steps (and at the end),
records node spans for a Chrome trace, and shows a progress bar with steps, samples/s, reward
and KL. A run folder holds one run: ``train()`` continues it from the executor's step,
dropping the metric rows and trace spans of that step and later (a resumed run repeats none),
and each checkpoint records the graph's identity (:func:`yatt_graph.serialize.graph_identity`),
so resuming with another graph or other options is refused.

:func:`train_with_restarts` is what ``yatt-graph run --restart on-failure`` uses: when a
process dies or goes silent (a controller, a replica or a training rank:
:class:`runtime.errors.ProcessFault`) it closes that
executor (no process is left behind), makes a fresh one, restores the newest good checkpoint
(or starts again from the beginning when there is none), drops the metric rows of the steps
that will run again, and carries on, up to ``max_restarts`` times. Node errors and node
timeouts are not retried: the same input would fail the same way. :class:`Accounting` wraps
an executor so that each metric row counts samples (``samples``, ``skipped_samples`` where the
graph outputs ``bad_samples``, ``skipped_steps_total`` where the update reports
``skipped_nonfinite``), with totals kept in checkpoints: a restarted run ends with the totals
of an uninterrupted one.

SIGTERM (``timeout``, systemd, Slurm) is handled like Ctrl-C: under
:func:`sigterm_as_interrupt` it raises :class:`Terminated` (a ``KeyboardInterrupt``) in the
main thread, so every path that handles Ctrl-C runs. Inside :func:`at_step_boundary` the first
one waits for the end of the step in progress (so that a checkpoint holds a whole step) and
says on stderr what that step waits on; a second stops at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from runtime.train.checkpoint import (
    CheckpointError,
    checkpoints,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from runtime.train.metrics import CURVES, MetricsWriter, curve_key, summarize, truncate_metrics
from runtime.train.samples import ROLLOUT, SampleWriter, sample_rows
from runtime.train.trace import Tracer
from yatt_graph.serialize import graph_identity

if TYPE_CHECKING:  # (the engine loads torch: the CLI reads this module before it decides threads)
    from runtime.engine.calls import Executor, OnStep, StepResult, Stop

__all__ = [
    "Accounting",
    "Terminated",
    "at_step_boundary",
    "node_call_in_progress",
    "raise_pending_sigterm",
    "sigterm_pending",
    "sigterm_as_interrupt",
    "stopped_by",
    "train",
    "train_with_restarts",
    "utilization",
]


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
    if out is not None:
        truncate_metrics(out, executor.next_step)
    tracer = Tracer(out / "trace.json" if out is not None else None, executor.next_step)
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
        tracer.flush()
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
        if progress:
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
        with at_step_boundary(lambda: node_call_in_progress(executor)):
            while left > 0:
                # Whole stretches between checkpoints go to run(), which keeps steps in flight
                # (ZmqExecutor pipelines them); a checkpoint needs the executor between steps.
                n = left
                if saving:
                    n = min(n, checkpoint_every - executor.next_step % checkpoint_every)
                before = executor.next_step
                executor.run(n, on_step=record, stop=sigterm_pending)
                raise_pending_sigterm()
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
        tracer.close()
    if (
        out is not None
        and remaining
        and checkpoint_every > 0
        and executor.next_step % checkpoint_every
    ):
        save()
    return rows


class Accounting:
    """An executor that adds sample counts to each step's outputs (see the module docstring)."""

    def __init__(self, executor: Executor, sched: dict[str, float] | None = None):
        """``sched``: ``sched/*`` figures of the whole run (its thread policy), joined to every
        step's own."""
        self.executor = executor
        self.sched = dict(sched or {})
        self.totals = {"samples": 0, "skipped_samples": 0, "skipped_steps": 0}

    def __getattr__(self, name: str) -> Any:  # graph, plan, next_step, close, ...
        return getattr(self.executor, name)

    def step(self) -> Any:
        return self._account(self.executor.step())

    def run(self, steps: int = 1, on_step: OnStep = None, stop: Stop = None) -> list[StepResult]:
        """The executor's ``run`` (pipelined where it is), each result counted as it arrives."""
        kept: list[StepResult] = []

        def counted(result: Any) -> None:
            self._account(result)
            (on_step or kept.append)(result)

        self.executor.run(steps, on_step=counted, stop=stop)
        return kept

    def _account(self, result: Any) -> Any:
        outputs = result.outputs
        scores = outputs.get("scores")
        samples = len(scores) if scores is not None and hasattr(scores, "__len__") else 0
        self.totals["samples"] += samples
        extra: dict[str, Any] = {"samples": samples, "samples_total": self.totals["samples"]}
        bad = outputs.get("bad_samples")
        if bad is not None and hasattr(bad, "sum"):
            skipped = int(bad.sum())
            self.totals["skipped_samples"] += skipped
            extra["skipped_samples"] = skipped
            extra["skipped_samples_total"] = self.totals["skipped_samples"]
        metrics = outputs.get("metrics")
        if isinstance(metrics, dict) and "skipped_nonfinite" in metrics:
            self.totals["skipped_steps"] += int(bool(metrics["skipped_nonfinite"]))
            extra["skipped_steps_total"] = self.totals["skipped_steps"]
        result.outputs = {**outputs, **extra}
        if self.sched:
            result.sched = {**self.sched, **result.sched}
        return result

    def state_dict(self) -> dict[str, Any]:
        state = self.executor.state_dict()
        state["accounting"] = dict(self.totals)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.executor.load_state_dict(state)
        self.totals.update(state.get("accounting") or {})


def _event(out: Path | None, **fields: Any) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    with (out / "events.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps({"time": time.time(), **fields}, sort_keys=True) + "\n")


def _has_checkpoint_of(out: Path, graph: Any) -> bool:
    """A good checkpoint of this graph in ``out`` (never one of another run's graph)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the load that follows warns about skipped ones
            find_checkpoint(out, graph_identity(graph))
    except CheckpointError:
        return False
    return True


REPLAN_AFTER = 6
"""Steps a run measures before ``replan`` may move nodes to a better cut."""


def _moved(executor: Any, make_executor: Callable[[], Any], why: str, out: Path | None) -> Any:
    """The run on a new executor (``make_executor()``, its plan changed) from where
    ``executor`` stands: its state, taken between steps, goes over whole."""
    state = executor.state_dict()
    executor.close()
    print(f"yatt-graph run: {why}", file=sys.stderr, flush=True)
    _event(out, event="replan", step=state["step"], why=why)
    moved = make_executor()
    try:
        moved.load_state_dict(state)
    except BaseException:
        moved.close()
        raise
    return moved


def train_with_restarts(
    make_executor: Callable[[], Any],
    steps: int,
    out_dir: str | Path | None = None,
    *,
    resume: str | Path | None = None,
    restart: str = "never",
    max_restarts: int = 3,
    on_done: Callable[[Any], None] | None = None,
    replan: Callable[[list[dict[str, Any]]], str | None] | None = None,
    **options: Any,
) -> tuple[list[dict[str, Any]], int]:
    """``train()`` that survives dead controllers; returns (metric rows of this run, restarts).

    ``restart``: ``"never"`` (a dead controller stops the run with its error) or
    ``"on-failure"``. Each restart is printed and appended to ``OUT/events.jsonl``.
    ``replan(rows)``, where given, is asked once after
    :data:`REPLAN_AFTER` steps (their metric rows): a reason to change the plan (the factory
    then makes executors with the new one; the run moves over with its state, and the
    reason is printed and appended to ``OUT/events.jsonl``), or None.
    ``on_done(executor)`` runs after the last step, before the executor is closed.
    ``options`` (``checkpoint_every``, ``progress``, ``meta``, ``glance_every``,
    ``samples_every``, ``wandb``) go to :func:`runtime.train.loop.train`. A restart resumes
    only from a checkpoint of this graph (see :func:`runtime.train.loop.train`).
    """
    from runtime.errors import HandshakeError, ProcessFault
    from yatt_graph import NodeExecutionError

    if restart not in ("never", "on-failure"):
        raise ValueError(f"restart must be 'never' or 'on-failure', got {restart!r}")
    out = Path(out_dir) if out_dir is not None else None
    source = Path(resume) if resume is not None else None
    kept: list[dict[str, Any]] = []
    restarts = 0
    while True:
        executor = make_executor()
        start = 0
        try:
            if source is not None:
                path, state = load_checkpoint(source, graph_identity(executor.graph))
                executor.load_state_dict(state)
                start = executor.next_step
                print(f"resumed from {path} at step {start}", file=sys.stderr)
            if restarts and out is not None:
                kept = truncate_metrics(out, start)
            elif restarts:
                kept = [r for r in kept if r["step"] < start]

            segment = steps
            if replan is not None:  # a few steps measured first, the rest on a better cut
                segment = min(steps, executor.next_step + REPLAN_AFTER)
            rows = train(executor, segment, out, **options)
            if segment < steps:
                why, replan = replan(rows), None
                if why:
                    executor = _moved(executor, make_executor, why, out)
                rows += train(executor, steps, out, **options)
            if on_done is not None:
                on_done(executor)
            return kept + rows, restarts
        except (ProcessFault, NodeExecutionError) as exc:
            if isinstance(exc, NodeExecutionError):  # in-process: a replica or rank it ran on
                if not isinstance(exc.__cause__, ProcessFault):
                    raise
                exc = type(exc.__cause__)(str(exc), -1, [exc.node])
            if isinstance(exc, HandshakeError) or restart != "on-failure":
                raise
            if restarts >= max_restarts:
                raise type(exc)(
                    f"{exc}\n(gave up after {restarts} restart(s): --max-restarts {max_restarts})",
                    exc.controller,
                    exc.nodes,
                ) from exc
            restarts += 1
            if out is not None and _has_checkpoint_of(out, executor.graph):
                source = out
            where = (
                f"the newest good checkpoint in {source}" if source else "step 0 (no checkpoint)"
            )
            print(
                f"yatt-graph run: {exc}\nrestarting the run ({restarts} of at most {max_restarts}) "
                f"from {where}",
                file=sys.stderr,
                flush=True,
            )
            _event(
                out,
                event="restart",
                restart=restarts,
                controller=exc.controller,
                nodes=exc.nodes,
                error=str(exc).split("\n")[0],
                from_checkpoint=str(source) if source else None,
            )
        finally:
            close = getattr(executor, "close", None)
            if close is not None:
                close()


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM (from ``timeout``, systemd, Slurm, ``kill``)."""


def stopped_by(exc: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped a run, ``SIGTERM`` or ``Ctrl-C``, and the exit code it ends with."""
    return ("SIGTERM", 143) if isinstance(exc, Terminated) else ("Ctrl-C", 130)


_state: dict[str, Any] = {"active": False, "defer": False, "pending": False, "waiting": None}


def _handler(signum: int, frame: Any) -> None:
    if _state["defer"] and not _state["pending"]:
        _state["pending"] = True
        _say_stopping(frame)
        return
    _state["pending"] = False
    raise Terminated(signum)


def _say_stopping(frame: FrameType | None) -> None:
    """One line on stderr: the run stops after the step in progress, and what that step is
    waiting on (``waiting()`` of :func:`at_step_boundary`, and the line the main thread is at)."""
    what = None
    try:
        what = _state["waiting"]() if _state["waiting"] is not None else None
    except Exception:  # (a description that fails must not lose the signal)
        what = None
    line = "yatt-graph run: SIGTERM: stopping after the step in progress"
    if what:
        line += f", which is waiting on {what}"
        at = _code_line(frame)
        if at:
            line += f" (at {at})"
    line += "; a second SIGTERM stops at once"
    with contextlib.suppress(OSError, ValueError):  # stderr closed: stop as asked all the same
        print(line, file=sys.stderr, flush=True)


_LIBRARY_PATHS = tuple(
    os.path.realpath(p) + os.sep
    for p in {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if p
)


def _code_line(frame: FrameType | None) -> str | None:
    """``file:line in function`` of the innermost frame of ``frame``'s stack that is not in
    Python's library or an installed package: the user's or this project's code it is in."""
    while frame is not None:
        path = os.path.realpath(frame.f_code.co_filename)
        if not path.startswith(_LIBRARY_PATHS) and not path.startswith("<"):
            name = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def node_call_in_progress(executor: Any) -> str | None:
    """What an in-process executor's step is waiting on: ``node 'x' (Class), step N, for S s``
    (its engine's call in progress), or None (between calls, or an executor whose calls run
    in other processes)."""
    engine = getattr(executor, "engine", None)
    running = getattr(engine, "running", None)
    if running is None:
        return None
    node = getattr(executor, "graph", None)
    node = node.nodes.get(running.node) if node is not None else None
    kind = f" ({type(node).__name__})" if node is not None else ""
    seconds = time.monotonic() - running.started
    return f"node {running.node!r}{kind}, step {running.step}, for {seconds:.0f} s"


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into :class:`Terminated` while the block runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread() or _state["active"]:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _handler)
    _state.update(active=True, pending=False)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _state.update(active=False, defer=False, pending=False, waiting=None)


@contextmanager
def at_step_boundary(waiting: Callable[[], str | None] | None = None) -> Iterator[None]:
    """Within the block, a first SIGTERM waits for :func:`raise_pending_sigterm` (called after each step),
    and says so naming ``waiting()``: what the step in progress waits on (None: nothing
    known, e.g. :func:`node_call_in_progress`)."""
    if not _state["active"]:
        yield
        return
    _state.update(defer=True, waiting=waiting)
    try:
        yield
    except BaseException:
        _state.update(defer=False, pending=False, waiting=None)
        raise
    _state.update(defer=False, waiting=None)
    raise_pending_sigterm()  # a SIGTERM that came after the last step


def sigterm_pending() -> bool:
    """Whether a SIGTERM is waiting for the step boundary (executors' ``run(stop=...)``)."""
    return bool(_state["pending"])


def raise_pending_sigterm() -> None:
    """Raise the SIGTERM that arrived during the step that just ended, if one did."""
    if _state["pending"]:
        _state["pending"] = False
        raise Terminated(signal.SIGTERM)
