"""Apply :class:`~runtime.sched.devices.Resources` to this process: the CPU affinity of every
one of its threads, torch's thread count on the thread that runs nodes, and which GPUs it sees.

On Linux ``os.sched_setaffinity(0, ...)`` moves only the calling thread, so
:func:`set_process_affinity` sets it for each thread in ``/proc/self/task`` (threads started
later inherit their creator's). ``torch.set_num_threads`` sets the OpenMP thread count of the
calling thread, and torch's default for threads that start computing later, so
:func:`apply_resources` must run on the thread that runs the nodes. ``CUDA_VISIBLE_DEVICES``
is read when CUDA initializes: a process that has not touched CUDA yet takes a new value; one
that has is refused with the reason.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

from runtime.sched.devices import Resources, cuda_visible_devices, usable_core_ids

__all__ = ["DRIVER_CUDA_ENV", "apply_resources", "child_env", "start_cores", "set_process_affinity"]

DRIVER_CUDA_ENV = "YATT_DRIVER_CUDA_VISIBLE_DEVICES"
"""Set in a controller's environment at spawn: the driver's ``CUDA_VISIBLE_DEVICES`` ("" when
unset), which ``Resources.cuda`` ordinals index."""

_START_CORES = usable_core_ids()
_DRIVER_CUDA = os.environ.get(DRIVER_CUDA_ENV, os.environ.get("CUDA_VISIBLE_DEVICES")) or None


def start_cores() -> tuple[int, ...]:
    """The cores this process may use at all: its affinity when it started (a controller
    narrowed to a few cores may be widened again up to these)."""
    return _START_CORES


def child_env(env: dict[str, str], res: Resources | None) -> dict[str, str]:
    """``env`` for a controller started with ``res``: its GPUs in ``CUDA_VISIBLE_DEVICES`` (and
    the driver's value in :data:`DRIVER_CUDA_ENV`), so CUDA there sees only them from the start."""
    if res is None or not res.cuda:
        return env
    parent = env.get("CUDA_VISIBLE_DEVICES")
    return {
        **env,
        DRIVER_CUDA_ENV: parent or "",
        "CUDA_VISIBLE_DEVICES": cuda_visible_devices(res.cuda, parent),
    }


def set_process_affinity(cores: Iterable[int]) -> tuple[int, ...]:
    """Pin every thread of this process to ``cores``; returns the mask now in force."""
    mask = set(cores)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except (OSError, AttributeError):
        tids = [0]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(tid, mask)
    os.sched_setaffinity(0, mask)
    return usable_core_ids()


def apply_resources(res: Resources, *, pinned_threads: int | None = None) -> Resources:
    """Make ``res`` true for this process (call it on the thread that runs the nodes); returns
    what is in force afterwards, to report.

    ``cores`` ``()`` means every core the process started with. ``pinned_threads`` overrides
    ``res.threads`` (a run's fixed ``num_threads``; 0 leaves torch's count as it is).
    """
    import torch

    bad = sorted(set(res.cores) - set(_START_CORES))
    if bad:
        raise ValueError(
            f"resources name cores {bad}, which this process may not use (it may use "
            f"{list(_START_CORES)}); the driver's and this host's cores differ"
        )
    cores = set_process_affinity(res.cores or _START_CORES)
    want = res.threads or len(cores) if pinned_threads is None else pinned_threads
    if want > 0 and torch.get_num_threads() != want:
        torch.set_num_threads(want)
    if res.cuda:
        value = cuda_visible_devices(res.cuda, _DRIVER_CUDA)
        if os.environ.get("CUDA_VISIBLE_DEVICES") != value:
            if torch.cuda.is_initialized():
                raise RuntimeError(
                    f"cannot give this process GPUs {value}: CUDA is already initialized here "
                    f"with CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}"
                )
            os.environ["CUDA_VISIBLE_DEVICES"] = value
    return Resources(cores, torch.get_num_threads(), res.cuda)
