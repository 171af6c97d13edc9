"""Driver-routed vs direct data plane for a batch of images + tensors: step time, driver RSS.

    .venv/bin/python -m bench.dataplane [--batches 16 64 256] [--steps 10]

Per step, a source process makes ``batch`` 224x224 RGB PIL images, embeddings
``float32[B, 1024]`` and token ids ``int64[B, 256]``; a sink process consumes them.

* direct: ``ZmqExecutor`` with the source on controller 0 and the sink on controller 1:
  the batch goes controller to controller; the driver sees a 3-number summary.
* routed: the single-controller pattern (one driver process that every batch passes
  through, as in verl): source -> driver (decoded there into Python objects) -> sink,
  with the same codec and sockets.
* Ray (when installed: ``bash bench/install_ray.sh``): the same two nodes in a source actor
  and a sink actor (``num_cpus=0``); the driver passes the source's ObjectRef to the sink
  (``ray.get(sink.consume.remote(source.produce.remote()))``), so the batch goes through
  the object store and the driver gets the summary. The batch is pickled by Ray as is (PIL
  images, torch tensors). Ray's own processes (raylet, object store) are not in "driver RSS".

Each configuration runs in a fresh driver process; "driver RSS growth" is the peak
resident memory during the steps minus the resident memory just before them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import psutil
import zmq

from bench._util import load_average, machine, ray_available, ray_session, table
from bench.graphs import ImageBatch, build_graph
from runtime.children import stop
from runtime.codec import decode_value, encode_value


class _PeakRss:
    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> _PeakRss:
        self.base = self.peak = self.proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _measure(step: Callable[[], object], steps: int, warmup: int = 0) -> dict[str, float]:
    """Median seconds per ``step()`` and this process's peak RSS growth over ``steps`` calls."""
    for _ in range(warmup):
        step()
    times = []
    with _PeakRss() as rss:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "growth_mb": (rss.peak - rss.base) / 2**20}


def run_direct(batch: int, steps: int) -> dict[str, float]:
    from runtime.zmq.driver import ZmqExecutor

    with ZmqExecutor(build_graph("images", batch=batch).plan(2)) as ex:
        ex.run(2)
        return _measure(ex.step, steps)


def _worker(role: str, pull: str, push: str, batch: int) -> None:
    from bench.graphs import Consume

    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind(pull)
    outbox.connect(push)
    node = ImageBatch(batch) if role == "source" else Consume()
    outbox.send_multipart([role.encode(), b"ready"])
    while True:
        frames = inbox.recv_multipart(copy=False)
        if frames[0].bytes == b"q":
            break
        if role == "source":
            out = node.forward()
            outbox.send_multipart([b"batch", *encode_value(out)], copy=False)
        else:
            value = decode_value(frames[1:])
            outbox.send_multipart([b"done", *encode_value(node.forward(**value))], copy=False)
    ctx.destroy(linger=1000)


def run_routed(batch: int, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="yatt-bench-") as d:
        ctx = zmq.Context()
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(f"ipc://{d}/driver")
        procs, out = [], {}
        try:
            for role in ("source", "sink"):
                cmd = [
                    sys.executable,
                    "-m",
                    "bench.dataplane",
                    "--worker",
                    role,
                    "--batches",
                    str(batch),
                ]
                cmd += ["--pull", f"ipc://{d}/{role}", "--push", f"ipc://{d}/driver"]
                procs.append(subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": os.getcwd()}))
                out[role] = ctx.socket(zmq.PUSH)
                out[role].connect(f"ipc://{d}/{role}")
            for _ in range(2):
                inbox.recv_multipart()  # ready

            def step() -> None:
                out["source"].send(b"go")
                frames = inbox.recv_multipart(copy=False)
                value = decode_value(frames[1:])  # the batch, as Python objects in the driver
                out["sink"].send_multipart([b"batch", *encode_value(value)], copy=False)
                decode_value(inbox.recv_multipart(copy=False)[1:])

            result = _measure(step, steps, warmup=2)
            for role in out:
                out[role].send(b"q")
        finally:
            stop(procs, grace_s=10)
            ctx.destroy(linger=0)
    return result


def run_ray(batch: int, steps: int) -> dict[str, float]:
    with ray_session() as ray:

        @ray.remote(num_cpus=0)
        class Source:
            def __init__(self, batch: int):
                self.node = ImageBatch(batch)

            def produce(self) -> dict:
                return self.node.forward()

        @ray.remote(num_cpus=0)
        class Sink:
            def __init__(self):
                from bench.graphs import Consume

                self.node = Consume()

            def consume(self, batch: dict) -> dict:
                return self.node.forward(**batch)

        source, sink = Source.remote(batch), Sink.remote()
        return _measure(lambda: ray.get(sink.consume.remote(source.produce.remote())), steps, 2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--one", choices=["direct", "routed", "ray"], help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=["source", "sink"], help=argparse.SUPPRESS)
    p.add_argument("--pull", help=argparse.SUPPRESS)
    p.add_argument("--push", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args.worker, args.pull, args.push, args.batches[0])
    if args.one:
        run = {"direct": run_direct, "routed": run_routed, "ray": run_ray}[args.one]
        print(json.dumps(run(args.batches[0], args.steps)))
        return None
    load_start = load_average()
    modes = ("routed", "direct", "ray") if ray_available() else ("routed", "direct")
    rows = []
    for batch in args.batches:
        mb = batch * (224 * 224 * 3 + 1024 * 4 + 256 * 8) / 2**20
        row = [str(batch), f"{mb:.1f}"]
        res = {}
        for mode in modes:
            cmd = [sys.executable, "-m", "bench.dataplane", "--one", mode, "--batches", str(batch)]
            cmd += ["--steps", str(args.steps)]
            res[mode] = json.loads(
                subprocess.check_output(cmd, env={**os.environ, "PYTHONPATH": os.getcwd()})
            )
            row += [f"{res[mode]['step_s'] * 1e3:.1f}", f"{res[mode]['growth_mb']:.1f}"]
        if "ray" in res:
            row.append(f"{res['ray']['step_s'] / res['direct']['step_s']:.2f}")
        else:
            row += ["not installed", "-", "-"]
        rows.append(row)
        print(f"batch {batch} done", flush=True)
    print(f"\nmachine: {machine()}")
    print(f"load average: {load_start} (start), {load_average()} (end)\n")
    header = [
        "batch",
        "MB/step",
        "routed ms/step",
        "routed driver RSS +MB",
        "direct ms/step",
        "direct driver RSS +MB",
        "Ray ms/step",
        "Ray driver RSS +MB",
        "Ray / direct time",
    ]
    print(table(header, rows))
    return None


if __name__ == "__main__":
    main()
