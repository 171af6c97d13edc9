"""Controller-to-controller tensor transfer, against an in-process memcpy (torch clone).

    .venv/bin/python -m bench.transfer [--sizes 1 64 256]

A source node on controller 0 returns a uint8 tensor of SIZE MB (made once); a sink on
controller 1 reads its size. The transfer time of a step is the sink's start minus the
source's end (``StepResult.node_start`` / ``node_seconds``, one host clock): encoding,
the copy into shared memory or the zmq frames, the hop, decoding (and the copy out of
shared memory), and the handoff to the compute thread. Two paths:

* shm: ``shm_threshold=1 MB`` (the default): a reusable pre-faulted segment + a handle.
* frames: ``shm_threshold=0``: zero-copy zmq frames over ``ipc://``.

The ceiling is ``t.clone()`` of the same size in one process (fresh memory, one thread
as in the controllers), and ``dst.copy_(t)`` into memory already touched.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench._util import machine, median_time, ray_available, table
from bench.graphs import build_graph
from runtime.driver import ZmqExecutor

MB = 1 << 20


def transfer_seconds(nbytes: int, shm: bool, steps: int) -> float:
    plan = build_graph("blob", nbytes=nbytes).plan(2)
    with ZmqExecutor(plan, shm_threshold=MB if shm else 0) as ex:
        ex.run(2)  # warm: segments made and mapped, pages faulted
        times = []
        for _ in range(steps):
            r = ex.step()
            end = r.node_start["source"] + r.node_seconds["source"]
            times.append(r.node_start["sink"] - end)
        return statistics.median(times)


def ray_transfer(nbytes: int) -> str:
    if not ray_available():
        return "not installed"
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)

    @ray.remote
    def size(t):
        return t.numel()

    t = torch.ones(nbytes, dtype=torch.uint8)
    seconds = median_time(lambda: ray.get(size.remote(t)), repeat=3, warmup=1)
    return f"{nbytes / seconds / 1e9:.2f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 256], help="MB")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as in the controllers
    rows = []
    for size in args.sizes:
        nbytes = size * MB
        t = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(t).fill_(0)
        steps = 20 if size <= 8 else 5 if size <= 64 else 3
        clone = median_time(t.clone, repeat=steps)
        copy = median_time(lambda dst=dst, t=t: dst.copy_(t), repeat=steps)
        shm = transfer_seconds(nbytes, True, steps)
        frames = transfer_seconds(nbytes, False, steps)
        gbs = lambda s, n=nbytes: n / s / 1e9  # noqa: E731
        rows.append(
            [
                f"{size} MB",
                f"{gbs(clone):.2f}",
                f"{gbs(copy):.2f}",
                f"{gbs(shm):.2f} ({gbs(shm) / gbs(clone):.0%})",
                f"{gbs(frames):.2f} ({gbs(frames) / gbs(clone):.0%})",
                ray_transfer(nbytes),
            ]
        )
        print(f"{size} MB done", flush=True)
        time.sleep(0.2)
    print(f"\nmachine: {machine()}\n")
    header = [
        "size",
        "clone GB/s",
        "copy_ GB/s",
        "shm GB/s (of clone)",
        "frames GB/s (of clone)",
        "Ray GB/s",
    ]
    print(table(header, rows))


if __name__ == "__main__":
    main()
