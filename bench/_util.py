"""Small helpers shared by the benchmarks: timing, tables, the optional Ray column."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "BENCH_RAY",
    "busy_loops",
    "import_ray",
    "last_json",
    "peak_run",
    "load_average",
    "machine",
    "median_time",
    "ray_available",
    "ray_session",
    "table",
]

# Where `bash bench/install_ray.sh` puts Ray (bench only: never in .venv, never in `make test`).
BENCH_RAY = Path(__file__).resolve().parent.parent / ".bench" / "ray"


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """``n`` processes that each spin a core (``while True: pass``) while the block runs: the
    loaded machine the benchmarks compare against the idle one."""
    import subprocess

    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)
        yield
    finally:
        for p in loops:
            p.kill()
            p.wait()


def median_time(fn: Callable[[], Any], repeat: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def import_ray() -> ModuleType | None:
    """Ray, from ``.bench/ray`` when that folder exists, else from the environment; None if absent.

    ``.bench/ray`` is appended to ``sys.path`` *after* site-packages, so the project's own
    packages (numpy, msgspec, typing_extensions, ...) win over the copies pip put there as
    Ray's dependencies.
    """
    # Read by Ray at import: no usage reports, and its "no cluster" mode (the default on
    # macOS/Windows), in which every address it hands out is 127.0.0.1.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if BENCH_RAY.is_dir() and str(BENCH_RAY) not in sys.path:
        sys.path.append(str(BENCH_RAY))
    try:
        import ray
    except ImportError:
        return None
    return ray


def ray_available() -> bool:
    return import_ray() is not None


@contextlib.contextmanager
def ray_session(object_store_mb: int = 1536) -> Iterator[ModuleType]:
    """A local Ray instance for one benchmark: 2 CPUs, no dashboard, on loopback only.

    Ray's own processes (GCS, raylet, agents, workers) are started with ``PYTHONPATH`` =
    site-packages then ``.bench/ray``: they need to import ray, and the project's packages
    still come first. Raises RuntimeError when Ray is not installed.
    """
    ray = import_ray()
    if ray is None:
        raise RuntimeError("Ray is not installed: run `bash bench/install_ray.sh` first")
    old = os.environ.get("PYTHONPATH")
    paths = [*filter(None, (old or "").split(os.pathsep)), sysconfig.get_paths()["purelib"]]
    if BENCH_RAY.is_dir():
        paths.append(str(BENCH_RAY))
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    try:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=object_store_mb * 2**20,
        )
    finally:
        # Ray's processes have the environment now; the benchmark's own children don't need it.
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    try:
        yield ray
    finally:
        ray.shutdown()


def load_average() -> str:
    """The 1/5/15-minute load averages, for the figures' header."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def machine() -> str:
    import torch
    import zmq

    ray = import_ray()
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}, pyzmq {zmq.__version__} "
        f"(libzmq {zmq.zmq_version()}), ray {ray.__version__ if ray else 'not installed'}"
    )


PEAK_CLI = """
import json, sys
from runtime.cli import main
code = main(sys.argv[1:])
with open("/proc/self/status") as f:
    peak = next(int(x.split()[1]) for x in f if x.startswith("VmHWM")) * 1024
print(json.dumps({"code": code, "peak": peak}))
"""


def peak_run(argv: list[str]) -> dict[str, int]:
    """``yatt-graph ARGV`` in a fresh process: its exit code and its peak RSS (``VmHWM``,
    bytes), ``{"code": ..., "peak": ...}``."""
    return last_json([sys.executable, "-c", PEAK_CLI, *argv])


def last_json(cmd: list[str], timeout: float = 3600) -> Any:
    """Run ``cmd`` (a benchmark's child process) and return the JSON on its last stdout line;
    a failed child stops the benchmark with the end of its stderr."""
    import json
    import subprocess

    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(
            f"{' '.join(cmd[:4])} ... failed ({out.returncode}):\n{out.stderr[-4000:]}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table."""
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join(
        [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])]
    )
