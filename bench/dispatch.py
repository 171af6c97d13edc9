"""Per-node dispatch overhead across processes, against a raw pyzmq REQ/REP round trip.

    .venv/bin/python -m bench.dispatch [--steps 500] [--rounds 10]

* raw: a REQ/REP round trip (1-byte messages) between this process and a child over
  ``ipc://``: the floor any driver -> process -> driver exchange pays.
* topology: the runtime's sockets (ROUTER; control and work DEALERs, a data PULL, an
  inproc pair, an idle IO thread) in bare pyzmq, RUN- and STEP_DONE-sized messages, no
  Python work: what the structure costs before the runtime's own code runs.
* step, 1 node: ``ZmqExecutor.step()`` on a graph of one empty node (1-element tensor
  output, returned to the driver): RUN to the controller, the node, STEP_DONE back; and
  the same with ``spin_s=0`` (the driver blocks at once instead of polling for up to 1 ms).
* chain, per node: ``step()`` on a chain of 8 empty nodes alternating between 2
  controllers (7 controller-to-controller hops), divided by 8.
* run(), per step: the one-node graph under ``run(steps)`` (pipelined, 2 steps in flight).
* Ray (when installed: ``bash bench/install_ray.sh``), side by side with the above, on an
  actor with ``num_cpus=0``: ``ray.get(actor.tick.remote())``, a method that does what the
  Tick node does (no input, returns ``torch.tensor([step])``); ``ray.get(actor.f.remote(x))``
  with ``f`` returning its argument, for x = a 1-element int64 tensor and x = the int 1
  (Ray's cheapest call); and ``ray.get(task.remote(1))`` for a remote function. A local Ray
  instance with 2 CPUs, no dashboard, on loopback only.

Interleaved: a shared VM's speed drifts by 2x over minutes, so each measure runs in
``--rounds`` blocks, each block right after a block of raw round trips; a figure is the
median over all its calls (after warm-up), and its "x raw" the median over blocks of
(block median / the raw block median just before it). Ray is started first and stays up
while the runtime is measured (and the runtime's processes while Ray is), so every round
times both in the same few seconds: the two "x Ray" columns are the median over rounds of
(this measure's block median / the Ray call's block median in the same round), for Ray's
``f() -> tensor`` call (the same work as the node) and its ``f(1) -> 1`` call. Below 1 is
faster than Ray; the target (dispatch at least 5x lower than Ray's actor call) is at most 0.2.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
import zmq

from bench._util import load_average, machine, ray_available, ray_session, table
from bench.graphs import build_graph
from runtime.zmq.driver import ZmqExecutor

_ECHO = """
import sys, zmq
s = zmq.Context().socket(zmq.REP); s.bind(sys.argv[1])
while True:
    m = s.recv()
    s.send(m)
    if m == b"q": break
"""


_TOPOLOGY = """
import sys, threading, zmq
address = sys.argv[1]
ctx = zmq.Context()
control = ctx.socket(zmq.DEALER); control.connect(address)
work = ctx.socket(zmq.DEALER); work.setsockopt(zmq.IDENTITY, b"w"); work.connect(address)
inbox = ctx.socket(zmq.PULL); inbox.bind(address + "-data")
wake = ctx.socket(zmq.PAIR); wake.bind("inproc://wake")
control.send(b"hello"); work.send(b"ready")
def io():  # an idle IO thread on the control link, as in a controller
    p = zmq.Poller(); p.register(control, zmq.POLLIN)
    while True:
        p.poll(100)
threading.Thread(target=io, daemon=True).start()
p = zmq.Poller()
for s in (work, inbox, wake):
    p.register(s, zmq.POLLIN)
while True:
    for s, _ in p.poll(500):
        if s is work:
            m = work.recv()
            work.send(b"\x08" + b"x" * 40, zmq.SNDMORE); work.send(b"y" * 20)
            if m == b"q": raise SystemExit
"""


@contextlib.contextmanager
def _child(script: str, address: str) -> Iterator[subprocess.Popen[bytes]]:
    """``python -c script address``; killed at the end unless it has exited by then."""
    proc = subprocess.Popen([sys.executable, "-c", script, address])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def topology_floor() -> Iterator[Callable[[], None]]:
    """The runtime's socket topology in bare pyzmq, no Python work: yields one round trip.

    A ROUTER here; in a child, a control DEALER on an idle IO thread and a work DEALER, a data
    PULL and an inproc pair polled by the main thread, which answers RUN-sized messages with
    STEP_DONE-sized ones (two frames), as a controller does. What the runtime pays for its
    structure before any of its Python runs.
    """
    with tempfile.TemporaryDirectory(prefix="yatt-bench-") as d:
        address = f"ipc://{d}/router"
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.bind(address)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            with _child(_TOPOLOGY, address) as proc:
                router.recv_multipart()
                router.recv_multipart()

                def call(last: bytes = b"\x05\x91\x01") -> None:
                    router.send(b"w", zmq.SNDMORE)
                    router.send(last)
                    while not poller.poll(20):
                        pass
                    frame = router.recv(copy=False)
                    while frame.more:
                        frame = router.recv(copy=False)

                yield call
                router.send(b"w", zmq.SNDMORE)
                router.send(b"q")
                proc.wait(timeout=10)
        finally:
            ctx.destroy(linger=0)


@contextlib.contextmanager
def echo() -> Iterator[Callable[[], None]]:
    """A raw REQ/REP round trip to a child process: yields the call."""
    with tempfile.TemporaryDirectory(prefix="yatt-bench-") as d:
        address = f"ipc://{d}/echo"
        ctx = zmq.Context()
        try:
            with _child(_ECHO, address) as proc:
                sock = ctx.socket(zmq.REQ)
                sock.connect(address)

                def call() -> None:
                    sock.send(b"x")
                    sock.recv()

                yield call
                sock.send(b"q")
                sock.recv()
                proc.wait(timeout=10)
        finally:
            ctx.destroy(linger=0)


def _times(fn: Callable[[], object], n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


# (seconds per call, x raw, block medians, block medians / the raw block just before)
Result = tuple[float, float, list[float], list[float]]


def interleaved(
    measures: dict[str, tuple[Callable[[], object], float]],
    raw: Callable[[], None],
    calls: int,
    rounds: int,
    warmup: int = 100,
) -> dict[str, Result]:
    """``{name: Result}``; each measure is ``(fn, divisor)`` (the calls one ``fn()`` stands
    for); block ``r`` of every measure ran in round ``r``. The "raw" entry has no blocks.

    Every block of ``calls // rounds`` calls of a measure follows a block of raw round trips
    (several times as many, as they are cheaper); see the module docstring.
    """
    for fn, _ in measures.values():
        _times(fn, warmup)
    _times(raw, warmup * 4)
    block = max(1, calls // rounds)
    all_times: dict[str, list[float]] = {k: [] for k in measures}
    blocks: dict[str, list[float]] = {k: [] for k in measures}
    ratios: dict[str, list[float]] = {k: [] for k in measures}
    raw_times: list[float] = []
    for _ in range(rounds):
        for name, (fn, divisor) in measures.items():
            floor = statistics.median(_times(raw, block * 4))
            got = [t / divisor for t in _times(fn, block)]
            raw_times.append(floor)
            all_times[name] += got
            blocks[name].append(statistics.median(got))
            ratios[name].append(blocks[name][-1] / floor)
    out = {
        k: (statistics.median(v), statistics.median(ratios[k]), blocks[k], ratios[k])
        for k, v in all_times.items()
    }
    out["raw"] = (statistics.median(raw_times), 1.0, [], [])
    return out


def vs(got: Result, ref: Result) -> float:
    """Median over rounds of ``got``'s block median / ``ref``'s in the same round (for "raw",
    the raw block just before ``ref``'s)."""
    if not got[2]:
        return statistics.median(1 / r for r in ref[3])
    return statistics.median(a / b for a, b in zip(got[2], ref[2], strict=True))


@contextlib.contextmanager
def runtime_measures() -> Iterator[dict[str, tuple[Callable[[], object], float]]]:
    with (
        topology_floor() as floor,
        ZmqExecutor(build_graph("tick").plan(1)) as one,
        ZmqExecutor(build_graph("tick").plan(1), spin_s=0) as still,
        ZmqExecutor(build_graph("chain", controllers=2, length=8).plan(2)) as chain,
        ZmqExecutor(build_graph("tick").plan(1)) as piped,
    ):
        burst = 20  # run() calls of this many steps, timed per step
        yield {
            "floor": (floor, 1),
            "step": (one.step, 1),
            "step_still": (still.step, 1),
            "chain": (chain.step, 8),
            "run": (lambda: piped.run(burst), burst),
        }


@contextlib.contextmanager
def ray_measures() -> Iterator[dict[str, tuple[Callable[[], object], float]]]:
    """Ray calls: actor returning a tensor, echoing a tensor / an int; a task. None without Ray."""
    if not ray_available():
        yield {}
        return
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
        yield {
            "actor_tick": (lambda: ray.get(actor.tick.remote()), 1),
            "actor_tensor": (lambda: ray.get(actor.f.remote(tiny)), 1),
            "actor_int": (lambda: ray.get(actor.f.remote(1)), 1),
            "task": (lambda: ray.get(empty.remote(1)), 1),
        }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=500, help="timed calls per measure")
    p.add_argument("--rounds", type=int, default=10, help="blocks per measure (interleaved)")
    args = p.parse_args(argv)
    load_start = load_average()
    with echo() as raw, ray_measures() as theirs, runtime_measures() as ours:
        load_before = load_average()
        got = interleaved({**ours, **theirs}, raw, args.steps, args.rounds)
    has_ray = bool(theirs)
    us = lambda s: f"{s * 1e6:.0f} us"  # noqa: E731
    row = lambda label, r: [  # noqa: E731
        label,
        us(r[0]),
        f"{r[1]:.1f}",
        f"{vs(r, got['actor_tick']):.2f}" if has_ray else "-",
        f"{vs(r, got['actor_int']):.2f}" if has_ray else "-",
    ]
    labels = [
        ("raw", "raw pyzmq REQ/REP round trip (ipc)"),
        ("floor", "the runtime's socket topology in bare pyzmq"),
        ("step", "ZmqExecutor.step(), 1 empty node"),
        ("step_still", "the same, spin_s=0 (the driver never spins)"),
        ("chain", "chain of 8 over 2 controllers, per node"),
        ("run", "ZmqExecutor.run(), per step (pipelined)"),
        ("actor_tick", "Ray actor call, f() -> tensor([step])"),
        ("actor_tensor", "Ray actor call, f(x) -> x, x = tensor([1])"),
        ("actor_int", "Ray actor call, f(x) -> x, x = 1"),
        ("task", "Ray task round trip, f(1) -> 1"),
    ]
    rows = [
        row(label, got[key]) if key in got else [label, "not installed", "-", "-", "-"]
        for key, label in labels
    ]
    print(f"machine: {machine()}")
    print(
        f"load average: {load_start} (start), {load_before} (all started), {load_average()} (end)\n"
    )
    header = ["measure", "time", "x raw round trip", "x Ray f() -> tensor", "x Ray f(1) -> 1"]
    print(table(header, rows))


if __name__ == "__main__":
    main()
