"""Benchmark: streaming a rollout's finished samples to the nodes on another controller.

    .venv/bin/python -m bench.stream [--steps 12] [--prompts 64] [--ppo-batch 32]

Two controllers (one core each, ``num_threads=1``), each setting in this one run,
alternating in blocks of 3 steps after 2 warm-up steps each; ``step()`` one at a time, so
steps do not overlap each other. Reported: the median wall time of a step, the median node
times, and the speed-up.

1. *Synthetic*: controller 0 runs a decode loop over ``--prompts`` rows of ragged lengths
   (lognormal, median 96 tokens, capped at 384; real matmuls, :class:`bench.graphs.Generate`),
   controller 1 a generative reward that reads each response and decodes a 24-token
   critique (:class:`bench.graphs.Judge`).
   *whole*: the rollout returns its batch at the end, the reward scores it in one call;
   *streamed*: the rollout yields the rows that finished every 16 tokens, and controller 1
   scores each piece as it arrives (runtime/engine/streams.py) while controller 0 still decodes.
2. *mm_ppo*: ``graphs.mm_ppo`` (tiny models) under ``--placement partial``: data, vision
   and rollout on controller 0; reward, reference, critic, GAE and the update on controller
   1. Responses of up to 24 tokens; ``stream=false`` vs ``stream=true`` (the rollout hands
   out the responses that ended at each decode step, and the reward, reference and critic
   take them).

Both settings of a part compute the same thing (the synthetic scores are checked here; the
PPO graph differs only by float rounding of smaller calls).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench._util import load_average, machine, table
from bench.graphs import build_graph
from runtime.sched.placement import controller_assignment
from runtime.zmq.driver import ZmqExecutor
from yatt_graph import Graph
from yatt_graph.refs import load_graph


def compare(
    graphs: dict[str, Graph], steps: int, nodes: dict[str, str], plan: Any = None
) -> tuple[dict[str, dict[str, float]], dict[str, list[Any]]]:
    """Median step wall time and node times (``nodes``: column -> node) of each graph, on two
    controllers, interleaved in blocks of 3 steps; also each setting's step results."""
    runs = {k: {m: [] for m in ("wall", *nodes)} for k in graphs}
    results: dict[str, list[Any]] = {k: [] for k in graphs}
    executors: dict[str, ZmqExecutor] = {}
    try:
        for label, graph in graphs.items():
            executors[label] = ZmqExecutor(plan(graph) if plan else graph.plan(2))
            executors[label].run(2)  # warm-up
        for _ in range(max(1, steps // 3)):
            for label, ex in executors.items():
                for _ in range(3):
                    t0 = time.perf_counter()
                    r = ex.step()
                    runs[label]["wall"].append(time.perf_counter() - t0)
                    for column, node in nodes.items():
                        runs[label][column].append(r.node_seconds[node])
                    results[label].append(r)
    finally:
        for ex in executors.values():
            ex.close()
    medians = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in runs.items()}
    return medians, results


def report(medians: dict[str, dict[str, float]], columns: list[str]) -> str:
    base = next(iter(medians.values()))["wall"]
    rows = [
        [label, *(f"{m[c] * 1e3:.0f} ms" for c in ("wall", *columns)), f"{base / m['wall']:.2f}x"]
        for label, m in medians.items()
    ]
    return table(["setting", "step wall time", *columns, "speed-up"], rows)


def synthetic(steps: int, prompts: int) -> dict[str, dict[str, float]]:
    options = {
        "generate": {"prompts": prompts, "median_len": 96, "max_len": 384, "chunk": 16},
        "judge": {"critique": 24},
    }
    graphs = {
        k: build_graph(kind, **options)
        for k, kind in (("whole", "stream_whole"), ("streamed", "stream"))
    }
    columns = {"rollout node": "generate", "reward node (sum of calls)": "judge"}
    medians, results = compare(graphs, steps, columns)
    same = all(
        torch.allclose(a.outputs["score"], b.outputs["score"], atol=1e-5)
        for a, b in zip(results["whole"], results["streamed"], strict=True)
    )
    print(
        f"1. synthetic: {prompts} prompts, lengths lognormal(median 96, sigma 0.7) capped at "
        f"384, D=512, critique 24 tokens; {len(results['whole'])} steps each; same scores: {same}\n"
    )
    print(report(medians, list(columns)) + "\n")
    return medians


def ppo(steps: int, batch: int) -> dict[str, dict[str, float]]:
    def graph(stream: bool) -> Graph:
        return load_graph("graphs.mm_ppo", batch_size=batch, max_new_tokens=24, stream=stream)

    def plan(g: Graph) -> Any:
        return g.plan(2, placement=controller_assignment(g, 2, "partial"))

    graphs = {"stream=false": graph(False), "stream=true": graph(True)}
    columns = {"rollout": "rollout", "reference": "reference", "critic": "critic", "ppo": "ppo"}
    medians, results = compare(graphs, steps, columns, plan)
    lengths = torch.cat([r.outputs["response_lengths"] for r in results["stream=true"]]).float()
    print(
        f"2. mm_ppo, --placement partial: batch {batch}, responses of up to 24 tokens (mean "
        f"{lengths.mean():.1f}, max {lengths.max():.0f} in the streamed run); "
        f"{len(results['stream=true'])} steps each\n"
    )
    print(report(medians, list(columns)))
    return medians


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12, help="timed steps per setting")
    p.add_argument("--prompts", type=int, default=64, help="rows per step (synthetic)")
    p.add_argument("--ppo-batch", type=int, default=32, help="prompts per step (mm_ppo)")
    args = p.parse_args(argv)
    load_start = load_average()
    print(f"machine: {machine()}")
    print(f"load average: {load_start} (start)\n")
    out = {"synthetic": synthetic(args.steps, args.prompts), "ppo": ppo(args.steps, args.ppo_batch)}
    print(f"\nload average: {load_average()} (end)")
    return out


if __name__ == "__main__":
    main()
