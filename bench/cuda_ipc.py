"""CUDA tensors between two controller processes on one GPU: by CUDA IPC and by the host copy,
over a sweep of sizes.

Rows of :mod:`bench.gpu_check` (``ipc_rows``), or on its own::

    python -m bench.cuda_ipc [--kib 16 64 1024 65536] [--reps 5]

The source (controller 0) makes a float32 tensor on its GPU each step, the sizes in turn, and
stamps ``time.time()`` after a synchronize; the sink (controller 1, the same GPU: both get
``cuda=(0,)``, so a machine with more GPUs does not quietly measure the host copy) checks it
equals the expected values and reports the seconds from the stamp to its call, and the bytes
its process opened by CUDA IPC for it (``runtime.codec.cuda_ipc.OPENED``: the node sees the same
tensor either way). Once with ``ZmqExecutor(cuda_ipc=True)``, every size by IPC (the source
lowers ``MIN_BYTES`` in its own process, so the sizes under it are measured too), and once with
``cuda_ipc=False``; the median of ``--reps`` rounds after a warm-up round. The IPC row fails
when no byte went by IPC, the host-copy row when any did. The threshold row compares the two
per size: where IPC starts to win is what ``cuda_ipc.MIN_BYTES`` should be. The nodes live at
module level, so controllers rebuild them by reference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from yatt_graph import ANY, Graph, Node

SIZES_KIB = (16, 64, 256, 1024, 16384, 65536)
"""Below, at and above ``MIN_BYTES`` (64 KiB), up to 64 MiB."""
QUICK_SIZES_KIB = (16, 64, 1024, 65536)


def _values(step: int, numel: int, device: Any) -> torch.Tensor:
    return torch.arange(numel, device=device, dtype=torch.float32) + step


class CudaSource(Node):
    kind = "data"
    outputs = {"x": ANY, "t0": ANY}

    def __init__(
        self,
        sizes_kib: Sequence[int] = (65536,),
        device: str = "cuda",
        min_bytes: int | None = None,
        name: str | None = None,
        **kw: Any,
    ):
        super().__init__(name=name, **kw)
        self.sizes_kib, self.device, self.min_bytes = list(sizes_kib), device, min_bytes

    def build(self) -> None:
        if self.min_bytes is not None:  # this process's senders, made at their first send
            from runtime.codec import cuda_ipc

            cuda_ipc.MIN_BYTES = self.min_bytes

    def forward(self) -> dict[str, Any]:
        kib = self.sizes_kib[self.step % len(self.sizes_kib)]
        x = _values(self.step, kib * 1024 // 4, self.device)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return {"x": x, "t0": time.time()}


class CudaSink(Node):
    inputs = {"x": ANY, "t0": ANY}
    outputs = {"seconds": ANY, "equal": ANY, "device": ANY, "kib": ANY, "ipc_bytes": ANY}

    def __init__(self, name: str | None = None, **kw: Any):
        super().__init__(name=name, **kw)
        self._opened = 0

    def forward(self, x: torch.Tensor, t0: float) -> dict[str, Any]:
        from runtime.codec.cuda_ipc import OPENED

        seconds = time.time() - t0
        ipc_bytes, self._opened = OPENED.bytes - self._opened, OPENED.bytes
        equal = bool(torch.equal(x, _values(self.step, x.numel(), x.device)))
        return {
            "seconds": seconds, "equal": equal, "device": str(x.device),
            "kib": x.numel() * 4 // 1024, "ipc_bytes": ipc_bytes,
        }  # fmt: skip


def build_graph(
    sizes_kib: Sequence[int], device: str = "cuda", min_bytes: int | None = None
) -> Graph:
    with Graph("cuda_ipc_bench") as g:
        src = CudaSource(sizes_kib, device=device, min_bytes=min_bytes, placement=0, name="source")
        out = src()
        sink = CudaSink(placement=1, name="sink")(x=out.x, t0=out.t0)
        for port in CudaSink.outputs:
            g.output(port, getattr(sink, port))
    return g


class Sweep(dict):
    """size in KiB -> (median seconds, bytes by IPC over the measured rounds); and ``equal``
    (every step's values arrived right) and ``device`` (the sink's)."""

    equal: bool = True
    device: str = ""


def measure(sizes_kib: Sequence[int], reps: int, ipc: bool, device: str = "cuda") -> Sweep:
    """One executor, ``reps + 1`` rounds of every size (the first round warms up)."""
    from runtime.sched.devices import Resources
    from runtime.zmq.driver import ZmqExecutor

    graph = build_graph(sizes_kib, device, min_bytes=1 if ipc else None)
    on_one_gpu = [Resources(cuda=(0,))] * 2 if device == "cuda" else None
    seconds: dict[int, list[float]] = {k: [] for k in sizes_kib}
    opened: dict[int, int] = dict.fromkeys(sizes_kib, 0)
    sweep = Sweep()
    with ZmqExecutor(graph.plan(2), device=device, cuda_ipc=ipc, resources=on_one_gpu) as ex:
        for step in range((reps + 1) * len(sizes_kib)):
            out = ex.step().outputs
            sweep.equal = sweep.equal and bool(out["equal"])
            sweep.device = str(out["device"])
            if step >= len(sizes_kib):
                kib = int(out["kib"])
                seconds[kib].append(float(out["seconds"]))
                opened[kib] += int(out["ipc_bytes"])
    sweep.update({k: (statistics.median(seconds[k]), opened[k]) for k in sizes_kib})
    return sweep


def row_name(device: str, ipc: bool) -> str:
    """The check name of one of :func:`ipc_rows`' two transfer rows."""
    how = "CUDA IPC" if ipc else "host copy"
    return f"{device} tensors 2 controllers 1 GPU, {how}"


THRESHOLD_ROW = "CUDA IPC threshold (cuda_ipc.MIN_BYTES)"


def _size(kib: int) -> str:
    return f"{kib // 1024} MiB" if kib >= 1024 else f"{kib} KiB"


def transfer_verdict(sweep: Sweep, ipc: bool, device: str) -> str:
    """``ok``, or ``FAILED (why)``: values that differ; on CUDA, an IPC run that moved no byte
    by IPC, or a host-copy run that moved any."""
    if not sweep.equal:
        return "FAILED (values differ)"
    by_ipc = sum(b for _, b in sweep.values())
    if device == "cuda" and ipc and by_ipc == 0:
        return "FAILED (no byte went by CUDA IPC: every tensor took the host copy)"
    if device == "cuda" and not ipc and by_ipc:
        return f"FAILED ({by_ipc} bytes went by CUDA IPC with it turned off)"
    return "ok"


def threshold_figure(ipc: Sweep, host: Sweep) -> str:
    """The smallest size from which IPC beats the host copy at every larger size."""
    sizes = sorted(ipc)
    wins = [ipc[k][0] < host[k][0] for k in sizes]
    first = next((i for i in range(len(sizes)) if all(wins[i:])), None)
    from runtime.codec.cuda_ipc import MIN_BYTES

    now = f"MIN_BYTES is {_size(MIN_BYTES // 1024)}"
    if first is None:
        return f"the host copy is as fast or faster at every size; {now}"
    return f"IPC faster from {_size(sizes[first])} on; {now}"


def ipc_rows(
    row: Callable[..., None],
    sizes_kib: Sequence[int] = SIZES_KIB,
    reps: int = 5,
    device: str = "cuda",
) -> None:
    """Three rows of ``check, result, figure``: IPC, host copy, threshold. ``device="cpu"``
    rehearses them without a GPU (both runs then send host tensors, no byte by IPC)."""
    sweeps: dict[bool, Sweep] = {}
    for ipc in (True, False):
        name = row_name(device, ipc)
        try:
            sweep = sweeps[ipc] = measure(sizes_kib, reps, ipc, device)
        except Exception as err:  # one failure must not hide the other row
            row(name, f"FAILED ({type(err).__name__}: {err})")
            continue
        times = ", ".join(f"{_size(k)} {s * 1e3:.2f} ms" for k, (s, _) in sorted(sweep.items()))
        by_ipc = sum(b for _, b in sweep.values())
        figure = f"{times}; {by_ipc / 2**20:.1f} MiB by CUDA IPC, on {sweep.device}"
        row(name, transfer_verdict(sweep, ipc, device), figure)
    if len(sweeps) == 2:
        row(THRESHOLD_ROW, "ok", threshold_figure(sweeps[True], sweeps[False]))
    else:
        row(THRESHOLD_ROW, "skipped: a transfer row failed")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kib", type=int, nargs="+", default=list(SIZES_KIB))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda", help="cpu: rehearse without a GPU")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAILED: no CUDA")
        return 1
    failed = []

    def row(check: str, result: str, figure: str = "") -> None:
        print(f"| {check} | {result} | {figure} |", flush=True)
        failed.append(result.startswith("FAILED"))

    from bench.cuda_ipc import ipc_rows as rows  # not __main__'s: controllers import the nodes

    rows(row, args.kib, args.reps, args.device)
    return 1 if any(failed) else 0


if __name__ == "__main__":
    sys.exit(main())
