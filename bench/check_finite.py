"""The cost of ``check_finite`` (on by default in ``yatt-graph run``) on a ready graph.

Two in-process executors of the same graph and seed, one checking every float output for
NaN/inf and one not, run their steps in turn (which one goes first alternates), so that both
see the same load; the table shows each one's median step time, and the time spent in the
check itself per step (``first_non_finite`` timed where the engine calls it), which a loaded
machine does not blur.

    .venv/bin/python -m bench.check_finite                       # mm_ppo, 40 steps each
    .venv/bin/python -m bench.check_finite --graph graphs.mm_grpo --steps 60
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench._util import load_average, machine, table
from runtime.engine import calls
from runtime.engine.engine import LocalExecutor
from yatt_graph.refs import load_graph

__all__ = ["main", "measure"]


def measure(graph: str, steps: int, warmup: int = 3, seed: int = 0) -> dict[Any, list[float]]:
    """Step times (s) of the checking (True) and the non-checking (False) executor after
    ``warmup`` steps, and under "check" the seconds each measured step spent checking."""
    checked: list[float] = []
    check = calls.first_non_finite

    def timed(outputs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return check(outputs)
        finally:
            checked.append(time.perf_counter() - t0)

    calls.first_non_finite = timed
    executors = {
        check: LocalExecutor(load_graph(graph, seed=seed), check_finite=check)
        for check in (True, False)
    }
    times: dict[Any, list[float]] = {True: [], False: [], "check": []}
    try:
        for k in range(warmup + steps):
            for on in (True, False) if k % 2 else (False, True):
                checked.clear()
                t0 = time.perf_counter()
                executors[on].step()
                if k >= warmup:
                    times[on].append(time.perf_counter() - t0)
                    if on:
                        times["check"].append(sum(checked))
    finally:
        calls.first_non_finite = check
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--graph", default="graphs.mm_ppo")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    times = measure(args.graph, args.steps)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    check = statistics.median(times["check"])
    print(machine(), "|", load_average())
    row = [args.graph, args.steps, f"{on * 1e3:.1f}", f"{off * 1e3:.1f}", f"{check * 1e3:.2f}"]
    print(table(["graph", "steps", "step on ms", "step off ms", "check ms/step"], [row]))


if __name__ == "__main__":
    main()
