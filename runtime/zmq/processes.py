"""Controller processes as the driver sees them: start-up, bookkeeping, clean-up.

:class:`ControllerProc` is the driver's record of one controller; :func:`spawn_controllers`
starts them; :class:`RunCleanup` holds everything that must go when the run ends (processes,
the zmq context, the run folder, shared-memory segments), even if the executor is lost.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

import zmq

from runtime.children import Child, python_env, start_child, stop
from runtime.pids import pid_alive
from runtime.sched.affinity import child_env
from runtime.sched.devices import Resources, openmp_env
from runtime.zmq import messages as m
from runtime.zmq.transport import remove_run_segments

__all__ = [
    "OWNER_FILE",
    "ControllerProc",
    "RunCleanup",
    "remove_stale_runs",
    "spawn_controllers",
]


class ControllerProc:
    """The driver's view of one controller: its process, links, state and last heartbeat."""

    def __init__(self, index: int, nodes: list[str]):
        self.index, self.nodes = index, nodes
        self.child: Child | None = None
        """Its process, when the driver started it (:class:`runtime.children.Child`: how a
        dead one is told); None for one that joined from elsewhere (heartbeats only)."""
        self.identity: bytes | None = None
        """The control link's identity (SETUP, heartbeats, SHUTDOWN)."""
        self.work: bytes | None = None
        """The work link's identity (RUN, STATE_*), announced in HELLO."""
        self.data_address = ""
        self.pid = 0
        self.state = m.State.STARTING
        self.last_beat: m.Heartbeat | None = None
        self.resources: Resources | None = None
        """What it reported it computes on (READY, then STEP_DONE after each change)."""

    def doing(self) -> str:
        """What its last heartbeat said it was running, for error messages."""
        beat = self.last_beat
        if beat is None or not beat.running:
            return ""
        return (
            f"; its last heartbeat said it was running node {beat.running!r} at step "
            f"{beat.running_step} (for {beat.running_s:.1f}s)"
        )

    @property
    def log_path(self) -> str:
        """Where its output goes ('' when it shares the driver's, or runs elsewhere)."""
        return self.child.log_path if self.child is not None else ""

    def log_tail(self) -> str:
        return self.child.log_tail() if self.child is not None else ""


class RunCleanup:
    """Everything that must go at close, even when the executor object is lost (weakref.finalize)."""

    def __init__(self, run_dir: str, run_id: str):
        self.run_dir, self.run_id = run_dir, run_id
        # Who owns the folder: a later run removes it if this process dies without clean-up.
        with open(os.path.join(run_dir, OWNER_FILE), "w") as f:
            f.write(str(os.getpid()))
        self.procs: list[Child] = []
        self.ctx: zmq.Context | None = None
        self.auth: Any = None
        self.io_stop = threading.Event()
        self.io_thread: threading.Thread | None = None
        self.done = False

    def cleanup(self, grace_s: float = 0.0) -> None:
        if self.done:
            return
        self.done = True
        stop(self.procs, grace_s)
        self.io_stop.set()
        if self.io_thread is not None and self.io_thread is not threading.current_thread():
            self.io_thread.join(timeout=2.0)
        if self.auth is not None:
            with contextlib.suppress(Exception):
                self.auth.stop()
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.run_id:
            remove_run_segments(self.run_id)


OWNER_FILE = "driver.pid"


def remove_stale_runs(parent: str | None = None) -> list[str]:
    """Remove the socket folders (and shared memory) of runs whose driver is gone (killed with
    SIGKILL, so it never cleaned up); returns the folders removed."""
    removed = []
    for path in glob.glob(os.path.join(parent or tempfile.gettempdir(), "yatt-*")):
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                pid = int(f.read().strip() or 0)
            if os.stat(path).st_uid != os.getuid():
                continue
        except (OSError, ValueError):
            continue  # not a run folder of this user's, or one being made
        if pid <= 0 or pid_alive(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        remove_run_segments(os.path.basename(path))
        removed.append(path)
    return removed


def spawn_controllers(
    controllers: list[ControllerProc],
    res: RunCleanup,
    *,
    address: str,
    run_dir: str,
    output: str,
    num_threads: int,
    startup_timeout_s: float,
    max_message_bytes: int,
    keys_dir: str | None,
    preload: tuple[str, ...] = (),
    resources: Sequence[Resources | None] = (),
) -> None:
    """Start ``python -m runtime.zmq.controller_main`` for each controller (plain subprocesses: no fork
    of a process that has torch loaded), with Ctrl-C ignored in them (the driver stops them).

    ``output="capture"`` writes each one's output to ``run_dir/controller-N.log``; ``res``
    keeps the processes, so they are stopped at close whatever happens. ``resources[c]``
    (when given) sets controller c's ``CUDA_VISIBLE_DEVICES`` and ``OMP_NUM_THREADS``, so its
    first CUDA call and first thread pool already see its own share.
    """
    # A controller imports the user's graph module and node classes whatever the working folder.
    # OpenMP as the run chose (runtime.sched.devices), else sleeping; children inherit SIG_IGN
    env = openmp_env(python_env(num_threads), spin=None)
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        for c in controllers:
            args = [
                "--connect", address,
                "--index", str(c.index), "--bind", f"ipc://{run_dir}/c{c.index}",
                "--parent-pid", str(os.getpid()), "--spawned",
                "--startup-timeout", str(startup_timeout_s),
                "--max-message-bytes", str(max_message_bytes),
                *(["--keys", keys_dir] if keys_dir else []),
                *(arg for ref in preload for arg in ("--preload", ref)),
            ]  # fmt: skip
            log_path = (
                os.path.join(run_dir, f"controller-{c.index}.log") if output == "capture" else ""
            )
            share = resources[c.index] if c.index < len(resources) else None
            own = dict(child_env(env, share))
            threads = share.threads or len(share.cores) if share is not None else 0
            if threads and num_threads <= 0:
                own["OMP_NUM_THREADS"] = str(threads)
            label = f"controller {c.index}"
            c.child = start_child("runtime.zmq.controller_main", args, own, label, log_path)
            c.pid = c.child.pid
            res.procs.append(c.child)
    finally:
        if main:
            signal.signal(signal.SIGINT, old)
