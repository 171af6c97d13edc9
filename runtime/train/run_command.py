"""``yatt-graph run`` from its parsed flags: every check before the first step, then the run.

Order: flags and numbers (:func:`check_flags`), the run folder (writable, locked, not holding
another run unless ``--resume`` or ``--overwrite``), the export path, the graph, the resumed
checkpoint (good, of this graph, not past ``--steps``); then training under
:func:`runtime.train.signals.sigterm_as_interrupt`, and the export, which, when it fails,
leaves the policy in a checkpoint and says how to export it. The executors are made by the
caller (``runtime.cli``), so that this package stays free of the ZeroMQ runtime.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from runtime.train.checkpoint import checkpoint_step, checkpoints, find_checkpoint, save_checkpoint
from runtime.train.export import export_policy, policy_node
from runtime.train.identity import graph_identity
from runtime.train.metrics import read_metrics
from runtime.train.run_flags import check_flags, same_folder
from runtime.train.run_folder import (
    RunLock,
    check_folder,
    check_new_path,
    move_aside,
    prepare_run_folder,
    record_run,
    run_folder_of,
)
from runtime.train.signals import sigterm_as_interrupt, stopped_by
from yatt_graph import UsageError

__all__ = ["print_summary", "resume_point", "run_command", "run_summary"]


def run_command(args: Any, setup: Any) -> int:
    """``yatt-graph run``: check every flag and path, take the run folder, build the graph
    (``setup.build() -> (options, graph)``), train on ``setup.executor_factory(graph, options,
    devices, distributed)()``, export. Returns the exit code."""

    devices, distributed = check_flags(args)  # before the graph (and its models) is built
    if args.resume and not Path(args.resume).is_dir():
        what = "is a file" if Path(args.resume).exists() else "does not exist"
        raise UsageError(
            f"--resume {args.resume}: {what}; it takes a run folder or one of its "
            "checkpoints/step_N folders"
        )
    out = (
        Path(args.out) if args.out else (run_folder_of(Path(args.resume)) if args.resume else None)
    )
    if out is not None:
        check_folder(out, "--out" if args.out else "--resume")
        if (out / "checkpoints").exists():
            check_folder(out / "checkpoints", "--out: its checkpoint folder")
    lock = RunLock(out).acquire() if out is not None else None
    try:
        with sigterm_as_interrupt():
            return _run_in_folder(args, out, devices, distributed, setup)
    finally:
        if lock is not None:
            lock.release()


def _run_in_folder(args: Any, out: Path | None, devices: Any, distributed: bool, setup: Any) -> int:
    from runtime.train.faults import train_with_restarts

    resuming_here = bool(args.resume) and out is not None and same_folder(str(out), args.resume)
    if out is not None:
        note = prepare_run_folder(out, resuming_here=resuming_here, overwrite=args.overwrite)
        if note:
            print(f"yatt-graph run: {note}", file=sys.stderr)
    export = Path(args.export) if args.export else None
    if export is not None:
        check_new_path(export, "--export")
    options, graph = setup.build()
    for line in setup.notes(options):
        print(f"yatt-graph run: {line}", file=sys.stderr)
    for line in setup.memory_lines(options, graph):
        print(f"yatt-graph run: memory plan: {line}", file=sys.stderr)
    if export is not None:
        policy_node(graph)
    if args.show_graph:
        print(graph.to_text(), "\n", flush=True)
    if out is not None:  # what `yatt-graph report` shows of the run, even if it stops early
        record_run(out, setup.settings(options, devices, distributed), graph)
    resume = resume_point(args, graph, out if resuming_here else None)
    start = (checkpoint_step(resume) or 0) if resume is not None else 0
    earlier_s = 0.0  # the wall time of the steps before ``start``, for the summary
    if resume is not None and out is not None:
        earlier_s = _continue_record(out, run_folder_of(Path(args.resume)), start)
    meta = {"graph_ref": args.graph, "graph_options": options}

    make_executor = setup.executor_factory(graph, options, devices, distributed)

    device_lines: list[str] = []
    final: dict[str, Any] = {}

    def on_done(ex: Any) -> None:
        if export is not None:
            final.update(step=ex.next_step, state=ex.state_dict())
        fanouts = getattr(ex, "fanouts", None)
        summary = fanouts.summary() if fanouts is not None else {}
        nodes = summary.get("nodes", {})
        if summary.get("devices"):
            shares = ", ".join(
                f"{name} {100 * d['utilization']:.0f}%" for name, d in summary["devices"].items()
            )
            split = ", ".join(sorted(n for n, f in nodes.items() if f["kind"] == "slots"))
            device_lines.append(f"devices (nodes {split} split across them): {shares} busy")
        for name, f in nodes.items():
            if f["kind"] == "replicas":
                parts = ", ".join(
                    f"{label} {d['pieces']} pieces / {d['busy_s']:.1f} s"
                    for label, d in f["by_worker"].items()
                )
                device_lines.append(f"replicas of {name}: {parts}")

    started = time.perf_counter()
    try:
        rows, restarts = train_with_restarts(
            make_executor,
            args.steps,
            out,
            checkpoint_every=args.checkpoint_every,
            resume=resume,
            progress=not args.quiet,
            glance_every=args.glance_every,
            samples_every=args.samples_every,
            wandb=args.wandb,
            restart=args.restart,
            max_restarts=args.max_restarts,
            on_done=on_done,
            meta=meta,
        )
    except KeyboardInterrupt as exc:
        return _interrupted(exc, out)
    if restarts:
        print(f"the run completed after {restarts} restart(s); see {out / 'events.jsonl'}")
    code = 0
    if export is not None:
        code = _export(graph, export, out, final, {**meta, "graph": graph_identity(graph)})
    wall_s = time.perf_counter() - started
    if out is not None and start > 0:  # the summary covers the run from step 0, not this part
        rows, wall_s = read_metrics(out), wall_s + earlier_s
    print_summary(args, rows, device_lines, out, wall_s=wall_s, resumed_at=start)
    return code


def _continue_record(out: Path, source: Path, start: int) -> float:
    """Before a run resumed at step ``start`` (from the run folder ``source``) goes on in
    ``out``: where ``out`` is another folder (``--resume A --out B``) holding no rows yet, the
    metric rows of steps 0 to ``start - 1`` are carried over, so that it records the whole run;
    the summary of the earlier part goes (the run writes one of the whole at its end). Returns
    the earlier steps' wall time: that summary's, where it ended at ``start``, else the sum of
    their ``time/step``."""
    earlier = _read_summary(source)
    (out / "summary.json").unlink(missing_ok=True)
    rows = read_metrics(source) if (source / "metrics.jsonl").is_file() else []
    rows = [r for r in rows if r["step"] < start]
    if not same_folder(str(out), str(source)) and not (out / "metrics.jsonl").is_file():
        (out / "metrics.jsonl").write_text(
            "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), encoding="utf-8"
        )
    if earlier.get("last_step") == start - 1 and isinstance(earlier.get("wall_s"), int | float):
        return float(earlier["wall_s"])
    return sum(_number(r.get("time/step")) for r in rows)


def _read_summary(folder: Path) -> dict[str, Any]:
    try:
        summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _number(value: Any) -> float:
    """A metric's value as a float; 0 for one a row does not hold (None: not finite)."""
    return float(value) if isinstance(value, int | float) else 0.0


def resume_point(args: Any, graph: Any, here: Path | None) -> Path | None:
    """The checkpoint ``--resume`` continues from, checked before any step runs: good, of this
    graph, not past ``--steps``. Resuming into its own folder moves later checkpoints aside."""
    if not args.resume:
        return None
    path, meta = find_checkpoint(args.resume, graph_identity(graph))
    if meta["step"] >= args.steps:  # (equal: nothing to run, and the run's summary stays)
        where = "is below" if meta["step"] > args.steps else "is already"
        raise UsageError(
            f"--steps {args.steps} {where} the step of {path} ({meta['step']}); --steps "
            "counts the restored steps too: pass --steps above it to train on"
        )
    later = [p for p in checkpoints(here) if checkpoint_step(p) > meta["step"]] if here else []
    if later:
        moved = move_aside(here, [f"checkpoints/{p.name}" for p in later])
        print(
            f"yatt-graph run: moved checkpoints after step {meta['step']} into {moved}",
            file=sys.stderr,
        )
    return path


def _interrupted(exc: KeyboardInterrupt, out: Path | None) -> int:
    """One line for Ctrl-C or SIGTERM, saying where the run stopped and what was kept."""
    step = getattr(exc, "step", None)
    what, code = stopped_by(exc)
    where = f" after step {step}" if step is not None else ""
    kept = f"; metrics and trace are in {out}" if out is not None else ""
    checkpoint = getattr(exc, "checkpoint", None)
    if checkpoint is not None:
        kept += f"; checkpoint {checkpoint} (continue with --resume {out})"
    print(f"yatt-graph run: stopped by {what}{where}{kept}", file=sys.stderr)
    return code


def run_summary(
    rows: list[dict], window: int, wall_s: float, resumed_at: int = 0
) -> dict[str, Any]:
    """What the closing JSON line says of the run's ``rows`` (from step 0, restored steps
    too): steps, wall time, samples/s, the mean reward of the first and the last ``window``
    steps (None without a reward), the last val/reward, and ``resumed_at``, the step this
    part of a resumed run started at (absent for a run from step 0)."""
    rewards = [r["scores/mean"] for r in rows if isinstance(r.get("scores/mean"), int | float)]
    samples = sum(_number(r.get("samples_per_s")) * _number(r.get("time/step")) for r in rows)
    summary: dict[str, Any] = {
        "steps": len(rows),
        "last_step": rows[-1]["step"] if rows else None,
        "wall_s": round(wall_s, 3),
        "samples_per_s": round(samples / wall_s, 3) if wall_s > 0 else 0.0,
        "reward_first": None,
        "reward_last": None,
        "window": 0,
    }
    if resumed_at:
        summary["resumed_at"] = resumed_at
    if rewards:
        window = max(1, min(window, len(rewards) // 2))
        summary["window"] = window
        summary["reward_first"] = round(sum(rewards[:window]) / window, 6)
        summary["reward_last"] = round(sum(rewards[-window:]) / window, 6)
    val = [r["val/reward"] for r in rows if isinstance(r.get("val/reward"), int | float)]
    if val:
        summary["val_reward_last"] = round(val[-1], 6)
    return summary


def print_summary(
    args: Any,
    rows: list[dict],
    device_lines: list[str],
    out: Any,
    wall_s: float = 0.0,
    resumed_at: int = 0,
) -> None:
    """The closing lines of the run's ``rows`` (from step 0; ``wall_s`` its time, the earlier
    part's steps counted by their ``time/step`` when it was resumed at step ``resumed_at``):
    reward, utilization, devices, skipped samples, where the files are, and last a one-line
    JSON summary (:func:`run_summary`; also ``OUT/summary.json``)."""
    summary = run_summary(rows, args.window, wall_s, resumed_at)
    part = f" (resumed at step {resumed_at})" if resumed_at else ""
    print(
        f"{summary['steps']} steps{part} in {summary['wall_s']:.1f} s: "
        f"{summary['samples_per_s']:.1f} samples/s"
    )
    if summary["reward_first"] is not None:
        window, first, last = summary["window"], summary["reward_first"], summary["reward_last"]
        print(f"mean reward: first {window} steps {first:.3f} -> last {window} steps {last:.3f}")
    if "val_reward_last" in summary:
        print(f"validation reward (greedy), last pass: {summary['val_reward_last']:.3f}")
    util_keys = sorted({k for r in rows for k in r if k.startswith("util/")})
    if util_keys:
        busy = {k: sum(_number(r.get(k)) for r in rows) / len(rows) for k in util_keys}
        shares = [
            f"{k.removeprefix('util/').replace('_', ' ')} {100 * b:.0f}%" for k, b in busy.items()
        ]
        print("utilization (busy share of each step): " + ", ".join(shares))
    for line in device_lines:
        print(line)
    skipped = rows[-1].get("skipped_samples_total") if rows else None
    if skipped:
        print(f"skipped samples: {int(skipped)} of {int(rows[-1]['samples_total'])} (bad scores)")
    if out is not None:
        print(f"metrics: {out / 'metrics.jsonl'}  trace: {out / 'trace.json'}")
        (out / "summary.json").write_text(json.dumps(summary, sort_keys=True) + "\n")
    print(json.dumps(summary, sort_keys=True), flush=True)


def _export(graph: Any, export: Path, out: Path | None, final: dict[str, Any], meta: dict) -> int:
    """Export the policy; when that fails, keep it in a checkpoint and say how to export it."""
    try:
        name = export_policy(graph, export, final["state"])
    except Exception as exc:  # the training is done: whatever went wrong, keep the policy
        newest = checkpoints(out)[-1] if out is not None and checkpoints(out) else None
        if newest is None or checkpoint_step(newest) != final["step"]:
            home = out or export.with_name(f"{export.name}.rescue-{time.strftime('%Y%m%d-%H%M%S')}")
            newest = save_checkpoint(home, final["step"], final["state"], meta=meta)
        print(
            f"yatt-graph run: --export {export} failed ({type(exc).__name__}: {exc}); the trained "
            f"policy is in {newest}: export it with `yatt-graph export {newest} PATH`",
            file=sys.stderr,
        )
        return 1
    print(f"exported the policy of node {name!r} to {export}")
    return 0
