"""End to end: the ready graphs through ``yatt-graph run`` in every runtime configuration, side by
side in one run with the hand-written floor (figures in docs/PERFORMANCE.md, "End to end").

    .venv/bin/python -m bench.e2e --workloads a b --steps-a 60 --steps-b 16 --rounds 2

Workloads:
- (a) the demo as it is (``graphs/mm_ppo.py``; update-bound: 2-token answers);
- (b) generation-bound with a long tail: ``graphs/mm_grpo.py`` with ``max_new_tokens=64``
  (the random-init policy's responses run 1 to 64 tokens, a wide spread) and the tiny LLM
  judge (``--judge tiny``) as the reward.

Configurations (``CONFIGS``): in-process as a user runs it (threads measured at start) and
with one torch thread; 2 controllers colocated; partial; partial + async
(``--max-staleness 1``); rollout replicas; each multi-controller one with adaptive
partitioning on (the default) and some also off (``, static``: ``--no-adaptive``).

The baselines, in the same rounds: **the floor** (``bench/floor.py``: the same work as a
hand-written loop, no framework), run on every core with bounded-spinning OpenMP threads and
on one thread, the faster kept; and **the fastest in-process run** of the two in-process
configurations. The default in-process run is reported as a share of the floor's speed, and
every configuration as a multiple of the fastest in-process speed.

Each configuration is one ``yatt-graph run`` (a subprocess), the configurations interleaved
round by round so that load spreads over all of them. From each run's ``metrics.jsonl``: the
median ``time/step`` after ``--warmup`` steps (the per-step wall time the training loop
records; for pipelined runs the time between two finished steps), samples/s, the rollout
phase's median time, the mean reward over the first and last windows, and the busy share per
controller (``util/controller_i``; idle is the rest).

``--replica-check`` also measures generation alone: one Rollout call of workload (b)'s shape
(32 to 512 responses) on 1 copy (1 and 2 torch threads) against 2 copies (the node and a
replica process, one core each), tokens generated per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._util import load_average, machine, table

WORKLOADS = {
    "a": ["graphs/mm_ppo.py"],
    "b": ["graphs/mm_grpo.py", "--set", "max_new_tokens=64", "--set", "batch_size=8", "--judge", "tiny"],
}  # fmt: skip

SCRIPT = "script (engine, no CLI)"
"""The baseline of the CLI's own cost: the same graph and options driven from a script
(``LocalExecutor.step()`` in a loop, each step timed), as a notebook runs it."""

CONFIGS = {
    SCRIPT: [],
    "in-process": [],
    "in-process, 1 thread": ["--threads", "1"],
    "2 controllers, colocated": ["--controllers", "2"],
    "2 controllers, colocated, static": ["--controllers", "2", "--no-adaptive"],
    "partial": ["--controllers", "2", "--placement", "partial"],
    "partial + async K=1": ["--controllers", "2", "--placement", "partial", "--max-staleness", "1"],
    "partial + async K=1, static": [
        "--controllers", "2", "--placement", "partial", "--max-staleness", "1", "--no-adaptive",
    ],
    "rollout replicas=2": ["--replicas", "rollout=2"],
    "partial + async K=1 + replicas=2": [
        "--controllers", "2", "--placement", "partial", "--max-staleness", "1",
        "--replicas", "rollout=2",
    ],
}  # fmt: skip


OPENMP_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "YATT_OPENMP")
"""Left out of every run's environment unless a configuration sets them: the CLI decides."""


def run_cli(
    graph_args: list[str],
    flags: list[str],
    steps: int,
    out: Path,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One ``yatt-graph run`` (seed 0) with ``env`` over a clean environment; its metric rows."""
    cli = Path(sys.executable).with_name("yatt-graph")
    cmd = [str(cli), "run", *graph_args, *flags, "--steps", str(steps), "--seed", "0"]
    cmd += ["--quiet", "--out", str(out), "--overwrite", "--window", "4"]
    base = {k: v for k, v in os.environ.items() if k not in OPENMP_VARS}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=3600, env={**base, **(env or {})}
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


_SCRIPT = """
import json, sys, time
import torch
from runtime.cli import parse_run
from runtime.engine.engine import LocalExecutor
from runtime.run import graph_options, load
spec = parse_run(sys.argv[2:])  # after "run"
_, graph = load(spec.graph, graph_options(spec.graph, spec.engine.offload))
executor = LocalExecutor(graph)
rows = []
for step in range(spec.train.steps):
    start = time.perf_counter()
    result = executor.step()
    metrics = result.outputs.get("metrics") or {}
    scores = result.outputs.get("scores")
    row = {"step": step, "time/step": time.perf_counter() - start,
           "samples": float(len(scores)) if scores is not None else 0.0}
    if scores is not None:
        row["scores/mean"] = float(torch.as_tensor(scores).float().mean())
    rows.append(row)
print(json.dumps(rows))
"""


def run_script(graph_args: list[str], steps: int) -> list[dict[str, Any]]:
    """The workload's graph, built from the same flags, stepped by ``LocalExecutor`` from a
    script (seed 0, torch's own thread count); one row per step."""
    cmd = [sys.executable, "-c", _SCRIPT, "run", *graph_args, "--steps", str(steps), "--seed", "0"]
    base = {k: v for k, v in os.environ.items() if k not in OPENMP_VARS}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=base)
    if proc.returncode != 0:
        raise RuntimeError(f"the script failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def figures(rows: list[dict[str, Any]], warmup: int, window: int) -> dict[str, Any]:
    kept = rows[warmup:]
    step = statistics.median(r["time/step"] for r in kept)
    rollout = statistics.median(r.get("time/rollout", 0.0) for r in kept)
    samples = statistics.median(r.get("samples", 0.0) for r in kept)
    scores = [r.get("scores/mean", 0.0) for r in rows]
    utils = {
        k: statistics.mean(r[k] for r in kept if k in r) for k in kept[-1] if k.startswith("util/")
    }
    sched = {k: kept[-1][k] for k in kept[-1] if k.startswith("sched/")}
    return {
        "step_s": step,
        "rollout_s": rollout,
        "samples_per_s": samples / step if step else 0.0,
        "reward_first": statistics.mean(scores[:window]),
        "reward_last": statistics.mean(scores[-window:]),
        "util": utils,
        "sched": sched,
    }


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds."""
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k not in ("util", "sched")}
    out["util"] = {
        k: statistics.median(r["util"].get(k, 0.0) for r in runs) for k in runs[0]["util"]
    }
    out["sched"] = runs[-1]["sched"]
    out["rounds"] = [r["step_s"] for r in runs]  # each round's, for ratios paired by round
    return out


def run_floor(name: str, steps: int, warmup: int) -> dict[str, Any]:
    """The floor (bench/floor.py) of workload ``name``: on every core with bounded-spinning
    OpenMP threads and on one thread, the faster of the two."""
    from runtime.sched.devices import SPIN_COUNT

    base = {k: v for k, v in os.environ.items() if k not in OPENMP_VARS}
    best: dict[str, Any] | None = None
    for threads, env in ((len(os.sched_getaffinity(0)), {"GOMP_SPINCOUNT": str(SPIN_COUNT)}),
                         (1, {})):  # fmt: skip
        cmd = [sys.executable, "-m", "bench.floor", "--workload", name, "--steps", str(steps)]
        cmd += ["--warmup", str(warmup), "--threads", str(threads)]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=3600, env={**base, **env}
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        if best is None or got["step_s"] < best["step_s"]:
            best = got
    assert best is not None
    return {
        "step_s": best["step_s"],
        "rollout_s": best["rollout_s"],
        "samples_per_s": best["samples_per_s"],
        "reward_first": best["reward_first"],
        "reward_last": best["reward_last"],
        "util": {},
        "sched": {"threads": best["threads"]},
    }


def workload(name: str, steps: int, rounds: int, warmup: int, configs: list[str]) -> dict[str, Any]:
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in ["floor", *configs]}
    with tempfile.TemporaryDirectory(prefix="yatt-e2e-") as tmp:
        for r in range(rounds):
            t0 = time.perf_counter()
            results["floor"].append(run_floor(name, steps, warmup))
            print(
                f"  ({name}) floor: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True
            )
            for c in configs:
                t0 = time.perf_counter()
                rows = (
                    run_script(WORKLOADS[name], steps)
                    if c == SCRIPT
                    else run_cli(WORKLOADS[name], CONFIGS[c], steps, Path(tmp) / f"{name}-{r}")
                )
                results[c].append(figures(rows, warmup, window=max(2, steps // 4)))
                print(
                    f"  ({name}) {c}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True
                )
    return {c: _merge(v) for c, v in results.items()}


def _table(name: str, res: dict[str, Any]) -> str:
    local = [res[c]["step_s"] for c in res if c.startswith("in-process")]
    fastest = min(local) if local else None
    floor = res["floor"]["step_s"]
    base = res.get("in-process", {}).get("rounds")

    def paired(config: str) -> str:
        """Each round's step time over the in-process run's of the same round: runs of one
        round ran minutes apart at most, so these ratios see less of a noisy host's drift."""
        if not base or config == "in-process":
            return "-"
        return ", ".join(f"{s / b:.2f}x" for s, b in zip(res[config]["rounds"], base, strict=True))

    rows = []
    for c, f in res.items():
        util = ", ".join(
            f"{k.removeprefix('util/controller_')}: {100 * v:.0f}%" for k, v in f["util"].items()
        )
        speed = f"{fastest / f['step_s']:.2f}x" if fastest else "-"
        rows.append([
            c, f"{1000 * f['step_s']:.1f}", f"{floor / f['step_s']:.2f}x", speed,
            f"{f['samples_per_s']:.1f}", f"{1000 * f['rollout_s']:.0f}",
            f"{f['reward_first']:.3f} -> {f['reward_last']:.3f}", util, paired(c),
        ])  # fmt: skip
    head = ["configuration", "step ms", "speed vs floor", "speed vs fastest in-process"]
    head += ["samples/s", "rollout ms"]
    return f"workload ({name})\n" + table(
        [*head, "reward first -> last", "busy per controller", "step time vs in-process, by round"],
        rows,
    )


def replica_check(repeats: int = 3, sizes: tuple[int, ...] = (8, 16, 32, 64, 128)) -> str:
    """Generation alone, workload (b)'s shape (4 samples per prompt, up to 64 tokens) at
    several batch sizes: 1 copy (1 and 2 torch threads) against 2 copies (the node and a
    replica process, one core each); tokens generated per second."""
    import torch

    from nodes.rollout import Rollout
    from runtime.sched.fanout import Crew, Fanout, NodeThread
    from runtime.zmq.replicas import spawn_replica

    setups = (("1 copy, 1 thread", 1, 1), ("1 copy, 2 threads", 2, 1), ("2 copies", 1, 2))
    rate: dict[tuple[str, int], float] = {}
    for label, threads, copies in setups:
        node = Rollout(policy="tiny-prefix-vlm", n=4, max_new_tokens=64, seed=0)
        node.setup()
        reps: list[Any] = [NodeThread("local", threads=threads)]
        reps += [spawn_replica(node, i, copies) for i in range(1, copies)]
        rs = Fanout(node, Crew(reps), "replicas")
        try:
            for size in sizes:
                prompts = [f"What colour is shape {i}?" for i in range(size)]
                embeds = torch.randn(size, 32, generator=torch.Generator().manual_seed(0))
                inputs = {"prompts": prompts, "image_embeds": embeds, "weights": None}
                rs.call(inputs)  # warm up
                times, tokens = [], []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    out = rs.call(inputs)
                    times.append(time.perf_counter() - t0)
                    tokens.append(float(out["response_lengths"].sum()))
                rate[label, size] = statistics.median(tokens) / statistics.median(times)
        finally:
            rs.crew.close()
    rows = []
    for label, _, _ in setups:
        cells = [
            f"{rate[label, n]:.0f} ({rate[label, n] / rate[setups[0][0], n]:.2f}x)" for n in sizes
        ]
        rows.append([label, *cells])
    best = [max(rate[label, n] for label, _, copies in setups if copies == 1) for n in sizes]
    two = setups[-1][0]
    rows.append(
        [
            "2 copies vs the faster 1 copy",
            *(f"{rate[two, n] / b:.2f}x" for n, b in zip(sizes, best)),
        ]
    )
    head = ["copies", *(f"{4 * n} responses: tokens/s (vs 1 copy, 1 thread)" for n in sizes)]
    return "generation alone (4 samples per prompt, <= 64 tokens)\n" + table(head, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.e2e")
    p.add_argument("--workloads", nargs="+", default=["a", "b"], choices=sorted(WORKLOADS))
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--steps-a", type=int, default=60)
    p.add_argument("--steps-b", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--replica-check", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"machine: {machine()}; load before: {load_average()}")
    for w in args.workloads:
        steps = args.steps_a if w == "a" else args.steps_b
        res = workload(w, steps, args.rounds, args.warmup, args.configs)
        print(_table(w, res))
        print(json.dumps({w: res}, default=float))
    if args.replica_check:
        print(replica_check())
    print(f"load after: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
