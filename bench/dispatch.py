"""Per-node dispatch overhead across processes, against a raw pyzmq REQ/REP round trip.

    .venv/bin/python -m bench.dispatch [--steps 500]

* raw: a REQ/REP round trip (1-byte messages) between this process and a child over
  ``ipc://``: the floor any driver -> process -> driver exchange pays.
* step, 1 node: ``ZmqExecutor.step()`` on a graph of one empty node (1-element tensor
  output, returned to the driver): RUN to the controller, the node, STEP_DONE back.
* chain, per node: ``step()`` on a chain of 8 empty nodes alternating between 2
  controllers (7 controller-to-controller hops), divided by 8.
* run(), per step: the one-node graph under ``run(steps)`` (pipelined, 2 steps in flight).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import zmq

from bench._util import machine, ray_available, table
from bench.graphs import build_graph
from runtime.driver import ZmqExecutor

_ECHO = """
import sys, zmq
s = zmq.Context().socket(zmq.REP); s.bind(sys.argv[1])
while True:
    m = s.recv()
    s.send(m)
    if m == b"q": break
"""


def raw_round_trip(n: int) -> float:
    with tempfile.TemporaryDirectory(prefix="yatt-bench-") as d:
        address = f"ipc://{d}/echo"
        proc = subprocess.Popen([sys.executable, "-c", _ECHO, address])
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.REQ)
            sock.connect(address)
            for _ in range(200):
                sock.send(b"x")
                sock.recv()
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                sock.send(b"x")
                sock.recv()
                times.append(time.perf_counter() - t0)
            sock.send(b"q")
            sock.recv()
            return statistics.median(times)
        finally:
            proc.wait(timeout=10)
            ctx.destroy(linger=0)


def executor_steps(graph_kind: str, controllers: int, n: int, **options) -> float:
    with ZmqExecutor(
        build_graph(graph_kind, controllers=controllers, **options).plan(controllers)
    ) as ex:
        ex.run(20)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            ex.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def executor_run(n: int) -> float:
    with ZmqExecutor(build_graph("tick").plan(1)) as ex:
        ex.run(20)
        t0 = time.perf_counter()
        ex.run(n)
        return (time.perf_counter() - t0) / n


def ray_round_trip(n: int) -> str:
    if not ray_available():
        return "not installed"
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        def empty(x):
            return x

        for _ in range(50):
            ray.get(empty.remote(1))
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            ray.get(empty.remote(1))
            times.append(time.perf_counter() - t0)
        return f"{statistics.median(times) * 1e6:.0f} us"
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=500)
    args = p.parse_args(argv)
    raw = raw_round_trip(args.steps * 4)
    one = executor_steps("tick", 1, args.steps)
    chain = executor_steps("chain", 2, args.steps // 2, length=8) / 8
    piped = executor_run(args.steps)
    ray = ray_round_trip(args.steps)
    us = lambda s: f"{s * 1e6:.0f} us"  # noqa: E731
    print(f"machine: {machine()}\n")
    print(
        table(
            ["measure", "time", "x raw round trip"],
            [
                ["raw pyzmq REQ/REP round trip (ipc)", us(raw), "1.0"],
                ["ZmqExecutor.step(), 1 empty node", us(one), f"{one / raw:.1f}"],
                ["chain of 8 over 2 controllers, per node", us(chain), f"{chain / raw:.1f}"],
                ["ZmqExecutor.run(), per step (pipelined)", us(piped), f"{piped / raw:.1f}"],
                ["Ray task round trip", ray, "-"],
            ],
        )
    )


if __name__ == "__main__":
    main()
