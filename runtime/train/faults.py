"""Running through faults: restart a run from its last checkpoint, and account for every sample.

:func:`train_with_restarts` is what ``yatt-graph run --restart on-failure`` uses: it runs
:func:`runtime.train.loop.train` on an executor made by ``make_executor()``; when a controller
dies or goes silent (:class:`runtime.zmq.driver.ControllerError`) it closes that executor (no
process is left behind), makes a fresh one, restores the newest good checkpoint (or starts
again from the beginning when there is none), drops the metric rows of the steps that will
run again, and carries on, up to ``max_restarts`` times. Node errors and node timeouts are
not retried: the same input would fail the same way.

:class:`Accounting` wraps an executor so that each metric row counts samples:
``samples`` / ``samples_total`` (the length of the ``scores`` output), and, where the graph
outputs ``bad_samples`` (a bool[B] mask, e.g. ``RuleReward(emit_bad_mask=True)``),
``skipped_samples`` / ``skipped_samples_total``; where the update reports
``skipped_nonfinite``, ``skipped_steps_total``. The totals live in checkpoints, so a
restarted run ends with the totals of an uninterrupted one: no sample counted twice or lost.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.engine.calls import Executor, OnStep, StepResult, Stop
from runtime.train.checkpoint import CheckpointError, find_checkpoint, load_checkpoint
from runtime.train.identity import graph_identity
from runtime.train.loop import train
from runtime.train.metrics import truncate_metrics

__all__ = ["Accounting", "train_with_restarts"]


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

        def counted(result: Any) -> None:
            self._account(result)
            if on_step is not None:
                on_step(result)

        return self.executor.run(steps, on_step=counted, stop=stop)

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
"""Steps a run measures before ``make_executor.replan`` may move nodes to a better cut."""


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
    **options: Any,
) -> tuple[list[dict[str, Any]], int]:
    """``train()`` that survives dead controllers; returns (metric rows of this run, restarts).

    ``restart``: ``"never"`` (a dead controller stops the run with its error) or
    ``"on-failure"``. Each restart is printed and appended to ``OUT/events.jsonl``.
    ``make_executor.replan(rows)``, where the factory has it, is asked once after
    :data:`REPLAN_AFTER` steps (their metric rows): a reason to change the plan (the factory
    then makes executors with the new one; the run moves over with its state, and the
    reason is printed and appended to ``OUT/events.jsonl``), or None.
    ``on_done(executor)`` runs after the last step, before the executor is closed.
    ``options`` (``checkpoint_every``, ``progress``, ``meta``, ``glance_every``,
    ``samples_every``, ``wandb``) go to :func:`runtime.train.loop.train`. A restart resumes
    only from a checkpoint of this graph (see :func:`runtime.train.loop.train`).
    """
    from runtime.errors import ControllerError, HandshakeError
    from yatt_graph import NodeExecutionError

    if restart not in ("never", "on-failure"):
        raise ValueError(f"restart must be 'never' or 'on-failure', got {restart!r}")
    out = Path(out_dir) if out_dir is not None else None
    source = Path(resume) if resume is not None else None
    kept: list[dict[str, Any]] = []
    restarts = 0
    replan = getattr(make_executor, "replan", None)
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
        except (ControllerError, NodeExecutionError) as exc:
            if isinstance(exc, NodeExecutionError):  # in-process: a replica or rank it ran on
                cause = exc.__cause__
                if not (isinstance(cause, ControllerError) or getattr(cause, "process_fault", 0)):
                    raise
                exc = ControllerError(str(exc), -1, [exc.node])
            if isinstance(exc, HandshakeError) or restart != "on-failure":
                raise
            if restarts >= max_restarts:
                raise ControllerError(
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
