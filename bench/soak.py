"""Soak: many small steps through 3 controllers and the training loop, every result checked
and memory measured.

    .venv/bin/python -m bench.soak [--steps 10000] [--controllers 3] [--warmup 500] [--json]

The graph: a source on controller 0 (8 floats per step, seeded by the step), an accumulator
on controller 1 that adds them to the running total it gets back from a mirror on controller
2 over a delayed edge, and the total returned to the driver: every step crosses all three
controllers and a delayed edge. The steps run as ``yatt-graph run`` runs them: the training
loop (``runtime.train.loop.train``) drives the executor and writes its metric rows, trace and
TensorBoard events to a temporary folder. Each step's total is compared (bitwise) with the
sum computed here. RSS (resident memory) of the driver and of each controller is read after
``--warmup`` steps and then every ``--every`` steps; the growth after warm-up is the figure
(target: under 10 %). ``--json`` prints one JSON object (tests/runtime/test_soak.py reads it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from typing import Any

import psutil
import torch

from bench._util import load_average, machine, table
from runtime.train.loop import Accounting, train
from runtime.zmq.driver import ZmqExecutor
from yatt_graph import ANY, Graph, Node, Port, Tensor

__all__ = ["build_graph", "soak"]

SIZE = 8


def _x(step: int) -> torch.Tensor:
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(1234 + step))  # (N,)


class SoakSource(Node):
    kind = "data"
    outputs = {"x": Tensor("float32", SIZE)}

    def forward(self) -> dict[str, Any]:
        return {"x": _x(self.step)}  # (N,)


class SoakAccumulate(Node):
    inputs = {"x": Tensor("float32", SIZE), "prev": Port(ANY, required=False)}
    outputs = {"total": Tensor("float32", SIZE), "seen": ANY}

    def forward(self, x: torch.Tensor, prev: Any) -> dict[str, Any]:
        total = x if prev is None else prev["total"] + x  # (N,)
        return {"total": total, "seen": {"total": total, "step": self.step}}


class SoakMirror(Node):
    inputs = {"value": ANY}
    outputs = {"out": ANY}

    def forward(self, value: Any) -> dict[str, Any]:
        return {"out": value}


def build_graph(controllers: int = 3) -> Graph:
    with Graph("soak") as g:
        x = SoakSource(placement=0, name="source")()
        acc = SoakAccumulate(placement=min(1, controllers - 1), name="acc")
        out = acc(x)
        mirror = SoakMirror(placement=min(2, controllers - 1), name="mirror")(out.seen)
        g.connect(mirror, acc, "prev", delay=1)
        g.output("total", out.total)
    return g


class Checked:
    """An executor whose every result goes to ``check`` before the training loop gets it."""

    def __init__(self, executor: Any, check: Any) -> None:
        self.executor, self.check = executor, check

    def __getattr__(self, name: str) -> Any:  # graph, next_step, state_dict, ...
        return getattr(self.executor, name)

    def run(self, steps: int = 1, on_step: Any = None, stop: Any = None) -> list[Any]:
        def both(result: Any) -> None:
            self.check(result)
            if on_step is not None:
                on_step(result)

        return self.executor.run(steps, on_step=both, stop=stop)


def _rss_mb(pids: list[int]) -> list[float]:
    return [psutil.Process(p).memory_info().rss / 2**20 for p in pids]


def soak(
    steps: int = 10_000, controllers: int = 3, warmup: int = 500, every: int = 1000
) -> dict[str, Any]:
    """Run the soak; a dict of figures (see the module docstring)."""
    import os

    if steps < 1 or warmup < 1 or every < 1:
        raise ValueError("--steps, --warmup and --every must each be at least 1")

    expected = torch.zeros(SIZE)
    wrong: list[int] = []
    samples: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    started: list[float] = []
    with ZmqExecutor(build_graph(controllers).plan(controllers)) as ex:
        pids = [os.getpid(), *ex.pids]

        def check(result: Any) -> None:
            nonlocal expected
            expected = expected + _x(result.step)
            if not torch.equal(result.outputs["total"], expected):
                wrong.append(result.step)
            done = result.step + 1
            if done == warmup:
                started.append(time.perf_counter())
            if done >= warmup and ((done - warmup) % every == 0 or done == warmup + steps):
                samples.append({"step": done, "rss_mb": _rss_mb(pids)})

        with tempfile.TemporaryDirectory(prefix="yatt-soak-") as out:
            train(Accounting(Checked(ex, check)), warmup + steps, out, progress=False)
        seconds = time.perf_counter() - started[0]
        dropped = ex.dropped_messages
        # What the driver keeps between steps must not grow with the steps run.
        held = {
            "partial": len(ex._partial),
            "events": len(ex.link.events),
            "peers": len(ex.link.last_seen),
        }
    base = samples[0]["rss_mb"]
    final = samples[-1]["rss_mb"]
    peak = [max(s["rss_mb"][i] for s in samples) for i in range(len(pids))]
    names = ["driver", *[f"controller {i}" for i in range(controllers)]]
    return {
        "steps": steps,
        "warmup": warmup,
        "controllers": controllers,
        "seconds": seconds,
        "steps_per_s": steps / seconds,
        "total_seconds": time.perf_counter() - t0,
        "wrong_steps": wrong,
        "dropped_messages": dropped,
        "driver_held": held,
        "processes": [
            {
                "name": name,
                "rss_start_mb": base[i],
                "rss_end_mb": final[i],
                "rss_peak_mb": peak[i],
                "growth": (final[i] - base[i]) / base[i],
                "peak_growth": (peak[i] - base[i]) / base[i],
            }
            for i, name in enumerate(names)
        ],
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--controllers", type=int, default=3)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--every", type=int, default=1000, help="steps between RSS readings")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    figures = soak(args.steps, args.controllers, args.warmup, args.every)
    if args.json:
        print(json.dumps(figures))
        return 0 if not figures["wrong_steps"] else 1
    print(f"machine: {machine()}; load average {load_average()}")
    print(
        f"{figures['steps']} steps after {figures['warmup']} warm-up steps, "
        f"{figures['controllers']} controllers: {figures['seconds']:.1f} s "
        f"({figures['steps_per_s']:.0f} steps/s); wrong results: {len(figures['wrong_steps'])}; "
        f"dropped messages: {figures['dropped_messages']}; held by the driver between steps: "
        f"{figures['driver_held']}\n"
    )
    rows = [
        [
            q["name"],
            f"{q['rss_start_mb']:.1f}",
            f"{q['rss_end_mb']:.1f}",
            f"{q['rss_peak_mb']:.1f}",
            f"{100 * q['growth']:+.1f} %",
        ]
        for q in figures["processes"]
    ]
    print(table(["process", "RSS after warm-up MB", "RSS at end MB", "peak MB", "growth"], rows))
    return 0 if not figures["wrong_steps"] else 1


if __name__ == "__main__":
    # Controllers rebuild the nodes as bench.soak:..., not __main__:...
    from bench.soak import main as _main

    sys.exit(_main())
