"""Benchmark: streaming a rollout's finished samples to a reward on another controller.

    .venv/bin/python -m bench.stream [--steps 12] [--prompts 64]

Two controllers (one core each, ``num_threads=1``): controller 0 runs a decode loop over
``--prompts`` rows of ragged lengths (lognormal, median 96 tokens, capped at 384; real
matmuls, :class:`bench.graphs.Generate`), controller 1 a generative reward that reads each
response and decodes a 24-token critique (:class:`bench.graphs.Judge`). In this one run,
alternating in blocks of 3 steps after 2 warm-up steps each:

* *whole*: the rollout returns its batch at the end; the reward then scores it in one call;
* *streamed*: the rollout yields the rows that finished every 16 tokens; controller 1 scores
  each piece as it arrives (runtime/streams.py), while controller 0 is still generating.

Reported: the median wall time of a step (``run()`` one step at a time, so steps do not
overlap each other), the median node times, and the ratio. Both give the same scores (the
reward is per sample); that is checked here too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench._util import load_average, machine, table
from bench.graphs import build_graph
from runtime.driver import ZmqExecutor


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12, help="timed steps per setting")
    p.add_argument("--prompts", type=int, default=64, help="rows per step")
    args = p.parse_args(argv)
    load_start = load_average()
    options = {
        "generate": {"prompts": args.prompts, "median_len": 96, "max_len": 384, "chunk": 16},
        "judge": {"critique": 24},
    }
    kinds = {"whole": "stream_whole", "streamed": "stream"}
    runs: dict[str, dict[str, list[float]]] = {
        k: {"wall": [], "gen": [], "judge": []} for k in kinds
    }
    scores: dict[str, list[torch.Tensor]] = {k: [] for k in kinds}
    executors: dict[str, ZmqExecutor] = {}
    try:
        for label, kind in kinds.items():
            executors[label] = ZmqExecutor(build_graph(kind, **options).plan(2))
            executors[label].run(2)  # warm-up
        for _ in range(max(1, args.steps // 3)):
            for label, ex in executors.items():
                for _ in range(3):
                    t0 = time.perf_counter()
                    r = ex.step()
                    runs[label]["wall"].append(time.perf_counter() - t0)
                    runs[label]["gen"].append(r.node_seconds["generate"])
                    runs[label]["judge"].append(r.node_seconds["judge"])
                    scores[label].append(r.outputs["score"])
    finally:
        for ex in executors.values():
            ex.close()
    same = all(
        torch.allclose(a, b, atol=1e-5)
        for a, b in zip(scores["whole"], scores["streamed"], strict=True)
    )
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in runs.items()}
    base = med["whole"]["wall"]
    rows = [
        [
            label,
            f"{m['wall'] * 1e3:.0f} ms",
            f"{m['gen'] * 1e3:.0f} ms",
            f"{m['judge'] * 1e3:.0f} ms",
            f"{base / m['wall']:.2f}x",
        ]
        for label, m in med.items()
    ]
    print(f"machine: {machine()}")
    print(f"load average: {load_start} (start), {load_average()} (end)")
    print(
        f"{args.prompts} prompts, lengths lognormal(median 96, sigma 0.7) capped at 384, D=512, "
        f"critique 24 tokens; 2 controllers; {len(runs['whole']['wall'])} steps each; "
        f"same scores: {same}\n"
    )
    print(
        table(
            ["setting", "step wall time", "rollout node", "reward node (sum of calls)", "speed-up"],
            rows,
        )
    )
    return med


if __name__ == "__main__":
    main()
