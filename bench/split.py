"""Benchmark: splitting node calls across CPU slots inside a real run (runtime/sched/fanout.py).

    .venv/bin/python -m bench.split [--steps 12] [--batch 64]

The multimodal PPO graph (``graphs.mm_ppo``, tiny models) on one controller process with
``torch.set_num_threads(1)`` (the controller default), run twice in this one run, the two
alternating in blocks of steps: ``slots=None`` (every node's call whole on the
controller's thread) and ``slots=2`` (the vision encoder, the reference and the critic cut
into micro-batches on 2 CPU slots). Reported: the median step time, the median time of the
three split nodes per step, and the ratio. The first 2 steps of each are warm-up.
"""

from __future__ import annotations

import argparse
import statistics

from bench._util import load_average, machine, table
from runtime.zmq.driver import ZmqExecutor
from yatt_graph.refs import load_graph

SPLIT = ("vision", "reference", "critic")


def _block(ex: ZmqExecutor, steps: int, into: dict[str, list[float]]) -> None:
    for r in ex.run(steps):
        step_s = sum(r.node_seconds.values())
        into["step"].append(step_s)
        into["split"].append(sum(r.node_seconds.get(n, 0.0) for n in SPLIT))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12, help="timed steps per setting")
    p.add_argument("--batch", type=int, default=64, help="prompts per step")
    args = p.parse_args(argv)
    load_start = load_average()
    options = {"batch_size": args.batch}
    results: dict[str, dict[str, list[float]]] = {}
    executors = {}
    try:
        for label, slots in (("whole", None), ("2 slots", 2)):
            plan = load_graph("graphs.mm_ppo", **options).plan(1)
            executors[label] = ZmqExecutor(
                plan, graph_ref="graphs.mm_ppo", graph_options=options, slots=slots
            )
            executors[label].run(2)  # warm-up
            results[label] = {"step": [], "split": []}
        for _ in range(max(1, args.steps // 3)):
            for label, ex in executors.items():
                _block(ex, 3, results[label])
    finally:
        for ex in executors.values():
            ex.close()
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in results.items()}
    rows = [
        [
            label,
            f"{m['step'] * 1e3:.0f} ms",
            f"{m['split'] * 1e3:.0f} ms",
            f"{med['whole']['split'] / m['split']:.2f}x",
        ]
        for label, m in med.items()
    ]
    print(f"machine: {machine()}")
    print(f"load average: {load_start} (start), {load_average()} (end)")
    print(
        f"graphs.mm_ppo, batch {args.batch}, 1 controller, {len(results['whole']['step'])} steps each\n"
    )
    print(
        table(
            ["setting", "node time per step", "vision+reference+critic", "speed-up of those"], rows
        )
    )


if __name__ == "__main__":
    main()
