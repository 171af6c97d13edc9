"""A weight version to a replica on another host: the replica's own connection (what a run
uses) against a gloo broadcast over the same network.

    .venv/bin/python -m bench.replica_weights [--sizes 16 64 256] [--repeat 5]

A state dict of SIZE MB in float32 (tensors of 4 MB each, as a model's layers) goes from this
process to a receiver process and is acknowledged, over tcp on 127.0.0.1 (on one machine the
network is memory, so the figures are the CPU cost of each path; across hosts the link's
bandwidth bounds all of them alike). Paths, timed from the send to the acknowledgement:

* zmq + CURVE: what ``--replicas-per-host`` does: the value codec's frames over the node's
  PAIR socket, a CURVE server here (the run's ``--keys``), decoded into tensors there.
* zmq: the same without keys (a run across hosts without ``--keys``).
* gloo broadcast: ``torch.distributed.broadcast`` of each tensor from rank 0 (this process)
  to rank 1 (the receiver), then a one-element all-reduce as the acknowledgement: the rank
  fabric the training ranks use.

Each path's receiver is a fresh process; the median of ``--repeat`` sends after one warm-up.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

from bench._util import load_average, machine, table

CHUNK_MB = 4

RECEIVER = r"""
import sys, torch
mode, address, keys, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.set_num_threads(1)
if mode == "gloo":
    import datetime, torch.distributed as dist
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), 2, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=1, world_size=2)
    shapes = [int(s) for s in sys.argv[5].split(",")]
    for _ in range(count):
        bufs = [torch.empty(n) for n in shapes]
        for b in bufs:
            dist.broadcast(b, src=0)
        dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
else:
    import zmq
    from runtime.codec import decode_value
    from runtime.zmq.transport import make_socket
    curve = server = None
    if keys:
        from runtime.zmq.keys import load_keys
        curve = load_keys(keys, "controller")
        server = curve.controller_public
    sock = make_socket(zmq.Context.instance(), zmq.PAIR, address, curve=curve,
                       curve_server_key=server)
    for _ in range(count):
        frames = sock.recv_multipart(copy=False)
        value = decode_value(frames, where="weights")
        sock.send(b"k")
"""


def _state(size_mb: int) -> dict[str, torch.Tensor]:
    n = CHUNK_MB * (1 << 20) // 4
    return {f"layer{i}.weight": torch.randn(n) for i in range(max(1, size_mb // CHUNK_MB))}


def _receiver(mode: str, address: str, keys: str, count: int, *extra: str) -> subprocess.Popen:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", RECEIVER, mode, address, keys, str(count), *extra]
    return subprocess.Popen(args, env=env)


def zmq_times(state: dict[str, torch.Tensor], keys: str, count: int) -> list[float]:
    import zmq

    from runtime.codec import encode_value
    from runtime.zmq.keys import load_keys, start_authenticator
    from runtime.zmq.transport import make_socket

    ctx = zmq.Context()
    curve = load_keys(keys, "controller") if keys else None
    auth = start_authenticator(ctx, curve) if curve is not None else None
    sock = make_socket(ctx, zmq.PAIR, curve=curve)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    child = _receiver("zmq", f"tcp://127.0.0.1:{port}", keys, count)
    times = []
    try:
        for _ in range(count):
            start = time.perf_counter()
            sock.send_multipart(encode_value(state, where="weights"), copy=False)
            sock.recv()
            times.append(time.perf_counter() - start)
    finally:
        child.wait(timeout=120)
        sock.close(linger=0)
        if auth is not None:
            auth.stop()
        ctx.term()
    return times


def gloo_times(state: dict[str, torch.Tensor], count: int) -> list[float]:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True,
                          timeout=datetime.timedelta(seconds=120), wait_for_workers=False)  # fmt: skip
    shapes = ",".join(str(t.numel()) for t in state.values())
    child = _receiver("gloo", f"127.0.0.1:{store.port}", "", count, shapes)
    dist.init_process_group("gloo", store=store, rank=0, world_size=2)
    times = []
    try:
        for _ in range(count):
            start = time.perf_counter()
            for t in state.values():
                dist.broadcast(t, src=0)
            dist.all_reduce(torch.ones(1))
            times.append(time.perf_counter() - start)
    finally:
        dist.destroy_process_group()
        child.wait(timeout=120)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replica_weights", description=__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256], help="MB")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from runtime.zmq.keys import generate_keys

    keys = str(generate_keys(os.path.join(tempfile.mkdtemp(prefix="yatt-bench-"), "keys")))
    print(f"# {machine()}; load {load_average()}")
    rows = []
    for size in args.sizes:
        state = _state(size)
        count = args.repeat + 1  # (the first is the warm-up)
        figures = {
            "zmq + CURVE": zmq_times(state, keys, count)[1:],
            "zmq": zmq_times(state, "", count)[1:],
            "gloo broadcast": gloo_times(state, count)[1:],
        }
        medians = {k: sorted(v)[len(v) // 2] for k, v in figures.items()}
        row = [f"{size} MB"]
        for seconds in medians.values():
            row.append(f"{seconds * 1e3:.0f} ms ({size / 1024 / seconds:.2f} GB/s)")
        row.append(f"{medians['gloo broadcast'] / medians['zmq + CURVE']:.2f}x")
        rows.append(row)
    header = ["state", *figures, "gloo / (zmq + CURVE) time"]
    print(table(header, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
