"""A CUDA tensor between two controller processes on one GPU: by CUDA IPC and by the host copy.

A row of :mod:`bench.gpu_check` (``ipc_rows``), or on its own::

    python -m bench.cuda_ipc [--mib 64] [--steps 5]

The source (controller 0) makes a ``--mib`` MiB float32 tensor on its GPU each step and
stamps ``time.time()`` after a synchronize; the sink (controller 1, the same GPU) checks it
equals the expected values and reports the seconds from the stamp to its call, once with
``ZmqExecutor(cuda_ipc=True)`` and once with ``cuda_ipc=False`` (median of ``--steps`` after
one warm-up step). The nodes live at module level, so controllers rebuild them by reference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from yatt_graph import ANY, Graph, Node


def _values(step: int, numel: int, device: Any) -> torch.Tensor:
    return torch.arange(numel, device=device, dtype=torch.float32) + step


class CudaSource(Node):
    kind = "data"
    outputs = {"x": ANY, "t0": ANY}

    def __init__(self, mib: int = 64, device: str = "cuda", name: str | None = None, **kw: Any):
        super().__init__(name=name, **kw)
        self.mib, self.device = mib, device

    def forward(self) -> dict[str, Any]:
        x = _values(self.step, self.mib * (1 << 20) // 4, self.device)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return {"x": x, "t0": time.time()}


class CudaSink(Node):
    inputs = {"x": ANY, "t0": ANY}
    outputs = {"seconds": ANY, "equal": ANY, "device": ANY}

    def forward(self, x: torch.Tensor, t0: float) -> dict[str, Any]:
        seconds = time.time() - t0
        equal = bool(torch.equal(x, _values(self.step, x.numel(), x.device)))
        return {"seconds": seconds, "equal": equal, "device": str(x.device)}


def build_graph(mib: int = 64, device: str = "cuda") -> Graph:
    with Graph("cuda_ipc_bench") as g:
        out = CudaSource(mib=mib, device=device, placement=0, name="source")()
        sink = CudaSink(placement=1, name="sink")(x=out.x, t0=out.t0)
        g.output("seconds", sink.seconds)
        g.output("equal", sink.equal)
        g.output("device", sink.device)
    return g


def measure(mib: int, steps: int, ipc: bool, device: str = "cuda") -> tuple[float, bool, str]:
    """(median seconds source -> sink, every step equal, the sink's device)."""
    from runtime.zmq.driver import ZmqExecutor

    graph = build_graph(mib, device)
    seconds, equal, where = [], True, ""
    with ZmqExecutor(graph.plan(2), device=device, cuda_ipc=ipc) as ex:
        for step in range(steps + 1):
            out = ex.step().outputs
            equal = equal and bool(out["equal"])
            where = str(out["device"])
            if step:
                seconds.append(float(out["seconds"]))
    return statistics.median(seconds), equal, where


def row_name(mib: int, device: str, ipc: bool) -> str:
    """The check name of one of :func:`ipc_rows`' rows."""
    how = "CUDA IPC" if ipc else "host copy"
    return f"{mib} MiB {device} tensor, 2 controllers, 1 GPU, {how}"


def ipc_rows(row: Callable[..., None], mib: int = 64, steps: int = 5, device: str = "cuda") -> None:
    """Two rows (IPC, host copy) of ``check, result, figure``; FAILED where values differ.
    ``device="cpu"`` rehearses the rows without a GPU (both then send host tensors)."""
    for ipc in (True, False):
        name = row_name(mib, device, ipc)
        try:
            sec, equal, where = measure(mib, steps, ipc, device)
        except Exception as err:  # one failure must not hide the other row
            row(name, f"FAILED ({type(err).__name__}: {err})")
            continue
        row(name, "ok" if equal else "FAILED (values differ)", f"{sec * 1e3:.2f} ms on {where}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda", help="cpu: rehearse without a GPU")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    failed = []

    def row(check: str, result: str, figure: str = "") -> None:
        print(f"| {check} | {result} | {figure} |", flush=True)
        failed.append(result.startswith("FAILED"))

    from bench.cuda_ipc import ipc_rows as rows  # not __main__'s: controllers import the nodes

    rows(row, args.mib, args.steps, args.device)
    return 1 if any(failed) else 0


if __name__ == "__main__":
    sys.exit(main())
