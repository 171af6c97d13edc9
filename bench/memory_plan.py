"""Benchmark: the memory plan (``yatt-graph show GRAPH --memory``) against measured peaks.

For each case, one fresh process runs ``yatt-graph run`` in-process for a few steps and reports
its peak RSS (``VmHWM``), and another fresh process builds the same graph and prints the plan's
host total (``nodes/memory.py``). The cases: every ready graph at its defaults with the tiny
models, and ``text_grpo`` with a 98M Qwen2 built in code (``bench.real_model.build_model``)
with and without a token budget. The target (docs/PERFORMANCE.md): the plan within 25 % of
the measured peak in every case.

    .venv/bin/python -m bench.memory_plan             # about 4 min
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench._util import last_json, machine, peak_run, table

_PLAN = """
import json, sys
from runtime.cli import build_parser
from runtime.flags import graph_args
from runtime.run import graph_options, load, resolve_graph, run_memory_plan
args = build_parser().parse_args(["show", *sys.argv[1:]])
args.graph = resolve_graph(args.graph)
given = graph_args(args)
config, graph = load(given, graph_options(given))
plan = run_memory_plan(args.graph, config, graph)
print("\\n".join(plan.lines()), file=sys.stderr)
print(json.dumps({"total": plan.device_totals()["cpu"]}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory_plan")
    p.add_argument("--model", default="", help="the 98M model's folder from an earlier run")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    folder = Path(args.model or tempfile.mkdtemp(prefix="yatt-memory-plan-"))
    if not args.model:
        from bench.real_model import build_model

        build_model(folder)
    real = ["--policy", str(folder), "--set", "batch_size=8", "group_size=8",
            "max_new_tokens=32"]  # fmt: skip
    cases = [
        ("text_grpo", ["text_grpo"]),
        ("text_ppo", ["text_ppo"]),
        ("mm_grpo", ["mm_grpo"]),
        ("mm_ppo", ["mm_ppo"]),
        ("text_grpo, 98M Qwen2", ["text_grpo", *real]),
        ("text_grpo, 98M Qwen2, budget 1024", ["text_grpo", *real, "micro_batch_tokens=1024"]),
    ]
    rows = []
    for label, argv_case in cases:
        with tempfile.TemporaryDirectory() as out:
            run = ["run", *argv_case, "--steps", str(args.steps), "--out", out, "--quiet"]
            measured = peak_run(run)["peak"]
        planned = last_json([sys.executable, "-c", _PLAN, *argv_case])["total"]
        rows.append([label, f"{measured / 2**20:.0f}", f"{planned / 2**20:.0f}",
                     f"{planned / measured:.2f}"])  # fmt: skip
        print(rows[-1], flush=True)
    print(machine())
    print(table(["case", "measured peak MB", "plan MB", "plan / measured"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
