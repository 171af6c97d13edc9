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

Ray (when installed: ``bash bench/install_ray.sh``), in the same run, after all of the
above, measured the same way (one way, producer end -> consumer start, on one host clock,
``time.time()`` as the controllers use): a source actor holds the tensor (made once) and
returns ``(time.time(), t.numpy())``, Ray's zero-copy path for arrays; the driver hands the
ObjectRef to a sink actor (``consume.remote(ref)``: Ray fetches and deserializes the
argument before the method starts), which takes ``time.time()`` after ``torch.from_numpy``
on the zero-copy array it was given. So it counts serialization into the object store, the
hand-off, the mapping and deserialization, as ours counts encoding, the copy, the hop and
decoding. Both actors ``num_cpus=0``; object store 1.5 GB in /dev/shm. "Ray, tensor as is"
returns the torch tensor itself (Ray's default pickling of tensors; its opt-in
``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS`` is left off). "shm / Ray" is our shared-memory
figure over Ray's numpy figure (the target is at least 2 at 64 MB).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from bench._util import load_average, machine, median_time, ray_available, ray_session, table
from bench.graphs import build_graph
from runtime.zmq.driver import ZmqExecutor

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


def ray_transfers(sizes_mb: list[int], steps_for: dict[int, int]) -> dict[int, dict[str, float]]:
    """Seconds per one-way Ray transfer (median), by size: numpy (zero-copy) and tensor as is."""
    if not ray_available():
        return {}
    out: dict[int, dict[str, float]] = {}
    with ray_session() as ray:

        @ray.remote(num_cpus=0)
        class Source:
            def __init__(self, nbytes: int):
                self.blob = torch.ones(nbytes, dtype=torch.uint8)  # (N,), pages faulted

            def produce(self, as_numpy: bool):
                return time.time(), self.blob.numpy() if as_numpy else self.blob

        @ray.remote(num_cpus=0)
        class Sink:
            def consume(self, produced) -> tuple[float, int]:
                end, blob = produced
                if not isinstance(blob, torch.Tensor):
                    with warnings.catch_warnings():  # Ray's zero-copy arrays are read-only
                        warnings.simplefilter("ignore", UserWarning)
                        blob = torch.from_numpy(blob)  # (N,), a view of the object store
                return time.time() - end, int(blob.numel())

        sink = Sink.remote()
        for size in sizes_mb:
            nbytes, steps = size * MB, steps_for[size]
            source = Source.remote(nbytes)
            out[size] = {}
            for key, as_numpy in (("numpy", True), ("tensor", False)):
                times = []
                for i in range(steps + 2):  # 2 warm-up transfers
                    seconds, n = ray.get(sink.consume.remote(source.produce.remote(as_numpy)))
                    if n != nbytes:
                        raise RuntimeError(f"Ray sink got {n} bytes, expected {nbytes}")
                    if i >= 2:
                        times.append(seconds)
                out[size][key] = statistics.median(times)
            ray.kill(source)
            print(f"Ray {size} MB done", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 256], help="MB")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as in the controllers
    load_start = load_average()
    steps_for = {size: 20 if size <= 8 else 10 if size <= 64 else 6 for size in args.sizes}
    ours = {}
    for size in args.sizes:
        nbytes, steps = size * MB, steps_for[size]
        t = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(t).fill_(0)
        ours[size] = {
            "clone": median_time(t.clone, repeat=steps),
            "copy": median_time(lambda dst=dst, t=t: dst.copy_(t), repeat=steps),
            "shm": transfer_seconds(nbytes, True, steps),
            "frames": transfer_seconds(nbytes, False, steps),
        }
        del t, dst
        print(f"{size} MB done", flush=True)
        time.sleep(0.2)
    load_before_ray = load_average()
    ray = ray_transfers(args.sizes, steps_for)
    rows = []
    for size in args.sizes:
        gbs = lambda s, n=size * MB: n / s / 1e9  # noqa: E731
        o = ours[size]
        row = [
            f"{size} MB",
            f"{gbs(o['clone']):.2f}",
            f"{gbs(o['copy']):.2f}",
            f"{gbs(o['shm']):.2f} ({gbs(o['shm']) / gbs(o['clone']):.0%})",
            f"{gbs(o['frames']):.2f} ({gbs(o['frames']) / gbs(o['clone']):.0%})",
        ]
        if size in ray:
            r = ray[size]
            row += [
                f"{gbs(r['numpy']):.2f} ({gbs(r['numpy']) / gbs(o['clone']):.0%})",
                f"{gbs(r['tensor']):.2f}",
                f"{r['numpy'] / o['shm']:.2f}",
                f"{r['numpy'] / o['frames']:.2f}",
            ]
        else:
            row += ["not installed", "not installed", "-", "-"]
        rows.append(row)
    print(f"\nmachine: {machine()}")
    print(
        f"load average: {load_start} (start), {load_before_ray} (before the Ray part), "
        f"{load_average()} (end)\n"
    )
    header = [
        "size",
        "clone GB/s",
        "copy_ GB/s",
        "shm GB/s (of clone)",
        "frames GB/s (of clone)",
        "Ray numpy GB/s (of clone)",
        "Ray, tensor as is GB/s",
        "shm / Ray",
        "frames / Ray",
    ]
    print(table(header, rows))


if __name__ == "__main__":
    main()
