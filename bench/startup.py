"""Start-up: the driver's peak RSS and the time from ``yatt-graph run`` to the first step.

Each configuration runs the CLI as a subprocess (so a baseline tree with other module paths
runs the same way) and watches it from outside: the driver's peak RSS is ``VmHWM`` of its
own process in ``/proc`` (polled until it exits; controllers are other processes and are not
counted), and the first step is the moment the run folder's ``metrics.jsonl`` gets its
first row (rows are flushed one a step).

    .venv/bin/python -m bench.startup                      # this tree, mm_ppo and mm_grpo
    .venv/bin/python -m bench.startup --tree /tmp/base     # a baseline worktree (git worktree add)

Each configuration runs ``--repeats`` times; the table shows the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._util import machine, table

__all__ = ["measure", "main"]

_POLL_S = 0.02


def _peak_rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def measure(tree: Path, graph: str, controllers: int, steps: int, timeout_s: float) -> dict:
    """One run: seconds to the first metrics row, seconds to exit, the driver's peak RSS (MiB)."""
    exe = Path(sys.executable).with_name("yatt-graph")
    with tempfile.TemporaryDirectory(prefix="yatt-startup-") as out:
        cmd = [str(exe), "run", f"graphs/{graph}.py", "--steps", str(steps), "--out", out]
        if controllers > 1:
            cmd += ["--controllers", str(controllers)]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        metrics = Path(out) / "metrics.jsonl"
        start = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        first = peak = None
        while proc.poll() is None:
            if time.perf_counter() - start > timeout_s:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"{' '.join(cmd)} ran past {timeout_s} s in {tree}")
            peak = _peak_rss_mib(proc.pid) or peak
            if first is None and metrics.is_file() and metrics.read_text().strip():
                first = time.perf_counter() - start
            time.sleep(_POLL_S)
        total = time.perf_counter() - start
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        if proc.returncode != 0:
            tail = err.strip().splitlines()[-3:]
            raise RuntimeError(f"{' '.join(cmd)} failed in {tree} (rc {proc.returncode}): {tail}")
        if first is None and metrics.is_file() and metrics.read_text().strip():
            first = total  # the rows came in the last poll interval
    return {"first_step_s": first, "total_s": total, "driver_rss_mib": peak}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--graphs", nargs="+", default=["mm_ppo", "mm_grpo"])
    parser.add_argument("--controllers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    print(machine())
    print(f"tree: {args.tree}")
    rows = []
    for graph in args.graphs:
        for controllers in args.controllers:
            where = "in-process" if controllers == 1 else f"--controllers {controllers}"
            try:
                runs = [
                    measure(args.tree, graph, controllers, args.steps, args.timeout)
                    for _ in range(args.repeats)
                ]
            except RuntimeError as err:  # report the others; this one says why it has none
                print(f"{graph} {where}: {err}", file=sys.stderr)
                rows.append([graph, where, "failed", "failed", "failed"])
                continue

            def med(key: str, runs: list[dict] = runs) -> str:
                values = [r[key] for r in runs if r[key] is not None]
                return f"{statistics.median(values):.2f}" if values else "-"

            rows.append([graph, where, med("first_step_s"), med("total_s"), med("driver_rss_mib")])
            print(" | ".join(rows[-1]), flush=True)
    print(table(["graph", "run", "first step (s)", "exit (s)", "driver peak RSS (MiB)"], rows))


if __name__ == "__main__":
    main()
