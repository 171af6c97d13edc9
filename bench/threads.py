"""The thread policy of ``yatt-graph run`` (runtime/sched/devices.py) against every fixed one:
on the machine as it is, and with two busy loops on its cores.

    .venv/bin/python -m bench.threads --workloads a b --steps-a 60 --steps-b 12

For each workload of bench/e2e.py, each setting is one in-process ``yatt-graph run`` (seed 0,
a subprocess), the settings interleaved: the default (threads and OpenMP wait policy measured
at start), one torch thread, and one thread per core with idle OpenMP threads sleeping
(``OMP_WAIT_POLICY=PASSIVE``), spinning a bounded time (``GOMP_SPINCOUNT``, what the default
picks on free cores) or spinning for ever (``ACTIVE``). The whole set runs twice: idle, then
with one busy loop per core started before it (``--no-load`` skips that). Figures: the median
``time/step`` after the warm-up steps, and each setting as a multiple of the fastest one of
its column. The target: the default at most 1.1x the fastest, idle and loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench._util import busy_loops, load_average, machine, table
from bench.e2e import WORKLOADS, figures, run_cli
from runtime.sched.devices import SPIN_COUNT


def settings(cores: int) -> dict[str, tuple[dict[str, str], list[str]]]:
    """Setting -> (environment, flags)."""
    n = ["--threads", str(cores)]
    return {
        "default (measured at start)": ({}, []),
        "1 thread": ({}, ["--threads", "1"]),
        f"{cores} threads, sleeping (PASSIVE)": ({"OMP_WAIT_POLICY": "PASSIVE"}, n),
        f"{cores} threads, bounded spin": ({"GOMP_SPINCOUNT": str(SPIN_COUNT)}, n),
        f"{cores} threads, spinning (ACTIVE)": ({"OMP_WAIT_POLICY": "ACTIVE"}, n),
    }


def measure(name: str, steps: int, warmup: int, rounds: int) -> dict[str, float]:
    """Setting -> median step seconds (the median over rounds)."""
    cores = len(os.sched_getaffinity(0))
    out: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="yatt-threads-") as tmp:
        for _ in range(rounds):
            for label, (env, flags) in settings(cores).items():
                rows = run_cli(WORKLOADS[name], flags, steps, Path(tmp) / "run", env=env)
                out.setdefault(label, []).append(figures(rows, warmup, 2)["step_s"])
    return {k: statistics.median(v) for k, v in out.items()}


def _table(name: str, columns: dict[str, dict[str, float]]) -> str:
    rows = []
    for label in next(iter(columns.values())):
        cells = []
        for col in columns.values():
            best = min(col.values())
            cells += [f"{1000 * col[label]:.1f}", f"{col[label] / best:.2f}x"]
        rows.append([label, *cells])
    head = ["setting"] + [f"{c} {h}" for c in columns for h in ("step ms", "of fastest")]
    return f"workload ({name})\n" + table(head, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.threads")
    p.add_argument("--workloads", nargs="+", default=["a", "b"], choices=sorted(WORKLOADS))
    p.add_argument("--steps-a", type=int, default=60)
    p.add_argument("--steps-b", type=int, default=12)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--no-load", action="store_true", help="measure on the idle machine only")
    args = p.parse_args(argv)
    print(f"machine: {machine()}; load before: {load_average()}", flush=True)
    results: dict[str, Any] = {}
    for w in args.workloads:
        steps = args.steps_a if w == "a" else args.steps_b
        columns = {"idle": measure(w, steps, args.warmup, args.rounds)}
        if not args.no_load:
            with busy_loops(len(os.sched_getaffinity(0))):
                columns["loaded"] = measure(w, steps, args.warmup, args.rounds)
        results[w] = columns
        print(_table(w, columns), flush=True)
    print(json.dumps(results))
    print(f"load after: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
