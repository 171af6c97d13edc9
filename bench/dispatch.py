"""Per-node dispatch overhead across processes, against a raw pyzmq REQ/REP round trip.

    .venv/bin/python -m bench.dispatch [--steps 500]

* raw: a REQ/REP round trip (1-byte messages) between this process and a child over
  ``ipc://``: the floor any driver -> process -> driver exchange pays.
* step, 1 node: ``ZmqExecutor.step()`` on a graph of one empty node (1-element tensor
  output, returned to the driver): RUN to the controller, the node, STEP_DONE back.
* chain, per node: ``step()`` on a chain of 8 empty nodes alternating between 2
  controllers (7 controller-to-controller hops), divided by 8.
* run(), per step: the one-node graph under ``run(steps)`` (pipelined, 2 steps in flight).
* Ray (when installed: ``bash bench/install_ray.sh``), in the same run, after the above, on
  an actor with ``num_cpus=0``: ``ray.get(actor.tick.remote())``, a method that does what
  the Tick node does (no input, returns ``torch.tensor([step])``); ``ray.get(actor.f.remote(x))``
  with ``f`` returning its argument, for x = a 1-element int64 tensor and x = the int 1
  (Ray's cheapest call); and ``ray.get(task.remote(1))`` for a remote function. Medians over
  ``--steps`` calls after 100 warm-up calls; a local Ray instance with 2 CPUs, no dashboard,
  on loopback only.

The two "x Ray" columns are each figure divided by Ray's ``f() -> tensor`` call (the same
work as the node) and by its ``f(1) -> 1`` call: below 1 is faster than Ray; the target
(dispatch at least 5x lower than Ray's actor call) is at most 0.2.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import zmq

from bench._util import load_average, machine, ray_available, ray_session, table
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


def _median_call(fn: Callable[[], object], n: int, warmup: int = 100) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ray_round_trips(n: int) -> dict[str, float] | None:
    """Seconds per Ray call (median): actor returning a tensor, echoing a tensor / an int; a task."""
    if not ray_available():
        return None
    with ray_session() as ray:

        @ray.remote(num_cpus=0)
        class Empty:
            def __init__(self) -> None:
                self.step = 0

            def tick(self) -> torch.Tensor:  # what the Tick node does
                self.step += 1
                return torch.tensor([self.step])  # (1,)

            def f(self, x):
                return x

        @ray.remote(num_cpus=0)
        def empty(x):
            return x

        actor = Empty.remote()
        tiny = torch.tensor([1])  # (1,)
        return {
            "actor_tick": _median_call(lambda: ray.get(actor.tick.remote()), n),
            "actor_tensor": _median_call(lambda: ray.get(actor.f.remote(tiny)), n),
            "actor_int": _median_call(lambda: ray.get(actor.f.remote(1)), n),
            "task": _median_call(lambda: ray.get(empty.remote(1)), n),
        }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=500)
    args = p.parse_args(argv)
    load_start = load_average()
    raw = raw_round_trip(args.steps * 4)
    one = executor_steps("tick", 1, args.steps)
    chain = executor_steps("chain", 2, args.steps // 2, length=8) / 8
    piped = executor_run(args.steps)
    load_before = load_average()
    ray = ray_round_trips(args.steps)
    us = lambda s: f"{s * 1e6:.0f} us"  # noqa: E731
    vs = lambda s, key: f"{s / ray[key]:.2f}" if ray else "-"  # noqa: E731
    row = lambda label, s: [  # noqa: E731
        label,
        us(s),
        f"{s / raw:.1f}",
        vs(s, "actor_tick"),
        vs(s, "actor_int"),
    ]
    rows = [
        row("raw pyzmq REQ/REP round trip (ipc)", raw),
        row("ZmqExecutor.step(), 1 empty node", one),
        row("chain of 8 over 2 controllers, per node", chain),
        row("ZmqExecutor.run(), per step (pipelined)", piped),
    ]
    ray_rows = [
        ("actor_tick", "Ray actor call, f() -> tensor([step])"),
        ("actor_tensor", "Ray actor call, f(x) -> x, x = tensor([1])"),
        ("actor_int", "Ray actor call, f(x) -> x, x = 1"),
        ("task", "Ray task round trip, f(1) -> 1"),
    ]
    for key, label in ray_rows:
        rows.append(row(label, ray[key]) if ray else [label, "not installed", "-", "-", "-"])
    print(f"machine: {machine()}")
    print(
        f"load average: {load_start} (start), {load_before} (before the Ray part), "
        f"{load_average()} (end)\n"
    )
    header = ["measure", "time", "x raw round trip", "x Ray f() -> tensor", "x Ray f(1) -> 1"]
    print(table(header, rows))


if __name__ == "__main__":
    main()
