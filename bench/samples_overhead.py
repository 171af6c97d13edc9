"""What keeping the samples costs a step (runtime/train/samples.py): the demo's graph with
``--samples-every 0`` (off), ``10`` (the default) and ``1`` (every step: the worst case),
side by side in one run (figures in docs/PERFORMANCE.md, "Small costs").

    .venv/bin/python -m bench.samples_overhead --steps 150 --rounds 3

Two measurements:

1. **End to end**: each setting is one ``yatt-graph run graphs/mm_ppo.py`` (a subprocess,
   seed 0), the settings interleaved round by round so that load spreads over all of them;
   the median ``time/step`` after ``--warmup`` steps (the training loop's wall time between
   steps, which holds the samples writer's work); each setting's ratio to
   ``--samples-every 0`` of the same round, the median and range over rounds. The
   ``sample_stats`` node (the per-sample advantage, KL and logprob gap) runs at every
   setting; its median time is reported beside.
2. **The writer alone**, in this process (one torch thread): the same graph on a
   LocalExecutor, every step written (images included), timing apart the part on the
   training thread (``SampleWriter.write``: columns, checks, image hashes) and the part on
   the writer's own thread (thumbnails and Parquet files, which overlap the next step in a
   run). Each as a share of the end-to-end step of ``--samples-every 0`` at every N steps,
   ``time / (N * step)``: figures that run-to-run noise (more than 2 % on a shared machine)
   cannot hide.

The target: at most 2 % slower at the default ``--samples-every 10``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._util import load_average, machine, table
from bench.e2e import WORKLOADS, run_cli

SETTINGS = (0, 10, 1)
"""``--samples-every`` values: off, the default, every step."""


def end_to_end(steps: int, warmup: int, rounds: int) -> dict[int, dict[str, list[float]]]:
    """Setting -> per round: step seconds and sample_stats seconds (medians over steps)."""
    got: dict[int, dict[str, list[float]]] = {n: {"step_s": [], "stats_s": []} for n in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="yatt-samples-") as tmp:
        for _ in range(rounds):
            for every in SETTINGS:
                flags = ["--samples-every", str(every)]
                rows = run_cli(WORKLOADS["a"], flags, steps, Path(tmp) / "run")[warmup:]
                got[every]["step_s"].append(statistics.median(r["time/step"] for r in rows))
                stats = [r.get("time/sample_stats", 0.0) for r in rows]
                got[every]["stats_s"].append(statistics.median(stats))
    return got


def writer_alone(steps: int, warmup: int) -> dict[str, Any]:
    """The demo graph in this process on one torch thread: the median write seconds (every
    step written) and the bytes written a step."""
    import torch

    from runtime.engine.engine import LocalExecutor
    from runtime.train.samples import SampleWriter
    from yatt_graph.refs import load_graph

    torch.set_num_threads(1)
    executor = LocalExecutor(load_graph("graphs.mm_ppo"))
    caller_s, files_s = [], []
    with tempfile.TemporaryDirectory(prefix="yatt-writer-") as tmp:
        writer = SampleWriter(Path(tmp), every=1)
        for i in range(warmup + steps):
            result = executor.step()
            t0 = time.perf_counter()
            writer.write(
                result.step, result.outputs,
                staleness=result.staleness, controllers=result.node_controller,
            )  # fmt: skip
            t1 = time.perf_counter()
            writer.flush()  # here at once, so its thread's work is timed alone
            if i >= warmup:
                caller_s.append(t1 - t0)
                files_s.append(time.perf_counter() - t1)
        writer.close()
        size = sum(p.stat().st_size for p in (Path(tmp) / "samples").rglob("*") if p.is_file())
    executor.close()
    return {
        "caller_s": statistics.median(caller_s),
        "files_s": statistics.median(files_s),
        "bytes_per_step": size / (warmup + steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="steps of each run")
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of each median")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--writer-steps", type=int, default=60)
    args = parser.parse_args()

    print(f"machine: {machine()}")
    print(f"load average at start: {load_average()}")
    started = time.time()
    runs = end_to_end(args.steps, args.warmup, args.rounds)
    off = runs[0]["step_s"]
    rows = []
    for every in SETTINGS:
        r = runs[every]
        label = {0: "0 (off)", 10: "10 (default)", 1: "1 (every step)"}[every]
        ratios = [a / b for a, b in zip(r["step_s"], off)]  # against the same round's
        step, stats = statistics.median(r["step_s"]), statistics.median(r["stats_s"])
        rows.append(
            [label, f"{step * 1e3:.1f} ms", f"{statistics.median(ratios):.3f}x",
             f"{min(ratios):.3f}-{max(ratios):.3f}x",
             f"{stats * 1e3:.2f} ms ({stats / step * 100:.1f} %)"]
        )  # fmt: skip
    print(
        f"\nEnd to end: graphs/mm_ppo.py (the demo), {args.steps} steps a run, median time/step "
        f"after {args.warmup}, {args.rounds} rounds "
        f"({time.time() - started:.0f} s; load average now {load_average()})"
    )
    header = ["--samples-every", "step (median)", "vs off (median)", "vs off (range)",
              "sample_stats node (share of step)"]  # fmt: skip
    print(table(header, rows))

    alone = writer_alone(args.writer_steps, 5)
    step, caller, files = statistics.median(off), alone["caller_s"], alone["files_s"]
    rows = [
        [f"every {n}", f"{caller / (n * step) * 100:.2f} %", f"{(caller + files) / (n * step) * 100:.2f} %"]
        for n in (1, 10)
    ]  # fmt: skip
    print(
        f"\nThe writer alone (in-process, {args.writer_steps} steps, medians): {caller * 1e3:.2f} ms "
        f"on the training thread (columns, checks, image hashes), {files * 1e3:.2f} ms on its "
        f"own (thumbnails, Parquet), {alone['bytes_per_step'] / 1e3:.1f} kB a kept step; "
        f"against the end-to-end step of --samples-every 0, {step * 1e3:.1f} ms (load average "
        f"now {load_average()})"
    )
    print(table(["samples kept", "training thread / step", "all the writer's work / step"], rows))


if __name__ == "__main__":
    main()
