"""Concurrent rule rewards (nodes/rewards/calls.py): 64 responses whose reward sleeps 0.1 s
(a stand-in for a reward that waits on a server or a sandbox), scored by one ``RuleReward``
call at concurrency 1, 16 and 64, for a ``def`` (a thread a call) and an ``async def`` (the
event loop), side by side in one run; the settings interleaved round by round.

    .venv/bin/python -m bench.rewards --rounds 2

Reports each setting's median wall time of the node's call and its speed-up over concurrency
1 of the same kind. The floor is 0.1 s x 64 / concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bench._util import load_average, machine, table
from nodes.rewards import RuleReward

SLEEP_S = 0.1


def sleeps(text: str, meta: dict) -> float:
    time.sleep(SLEEP_S)
    return float(len(text))


async def async_sleeps(text: str, meta: dict) -> float:
    await asyncio.sleep(SLEEP_S)
    return float(len(text))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--responses", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    texts = [f"response {i}" for i in range(args.responses)]
    settings = [(kind, fn, c) for kind, fn in (("def", sleeps), ("async def", async_sleeps))
                for c in (1, 16, 64)]  # fmt: skip
    times: dict[tuple[str, int], list[float]] = {(k, c): [] for k, _, c in settings}
    for _ in range(args.rounds):
        for kind, fn, concurrency in settings:
            node = RuleReward(fn, concurrency=concurrency)
            start = time.perf_counter()
            scores = node.run(texts=texts)["scores"]
            times[kind, concurrency].append(time.perf_counter() - start)
            assert scores.tolist() == [float(len(t)) for t in texts]  # in order
    rows = []
    for kind, _, concurrency in settings:
        median = statistics.median(times[kind, concurrency])
        base = statistics.median(times[kind, 1])
        floor = SLEEP_S * -(-args.responses // concurrency)
        rows.append([kind, concurrency, f"{median:.3f}", f"{floor:.1f}", f"{base / median:.1f}x"])
    print(f"{machine()}; load {load_average()}")
    print(f"{args.responses} responses, a reward that sleeps {SLEEP_S} s, {args.rounds} rounds")
    print(table(["reward", "concurrency", "median s", "floor s", "speed-up"], rows))


if __name__ == "__main__":
    main()
