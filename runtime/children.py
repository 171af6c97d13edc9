"""The one way the runtime starts, describes and stops its Python child processes:
controllers, replica processes and training ranks.

Each is ``python -m MODULE ...``, a plain subprocess (never a fork of a process that has torch
loaded), which imports what its parent imports (:func:`python_env`: the parent's ``sys.path``
and the folders of graph files loaded by path) and reads no stdin. What watches each one
differs by kind (a controller's heartbeats, a replica's reply, a rank's collectives), but a
dead child is described the same way (:func:`exit_text`, :func:`log_tail`) and stopped the same
way (:func:`stop`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["exit_text", "log_tail", "python_env", "start_python", "stop"]


def python_env(threads: int = 0) -> dict[str, str]:
    """This process's environment with ``PYTHONPATH`` set so that a child imports what this
    process imports, and ``OMP_NUM_THREADS`` when ``threads`` > 0."""
    from yatt_graph.refs import import_roots

    paths = [p or os.getcwd() for p in sys.path] + import_roots()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def start_python(
    module: str, args: Sequence[str], env: Mapping[str, str], log_path: str = ""
) -> subprocess.Popen[bytes]:
    """``python -m module args`` in this folder; its output to ``log_path`` when given (else
    this process's)."""
    log: Any = open(log_path, "wb") if log_path else None  # noqa: SIM115 - the child holds it
    try:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT if log else None, env=dict(env), cwd=os.getcwd(),
        )  # fmt: skip
    finally:
        if log is not None:
            log.close()


def exit_text(code: int | None) -> str:
    """How a child ended, from its return code: ``exited with code 1``, ``was killed by
    SIGKILL (9)``; ``is running`` for None."""
    if code is None:
        return "is running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name} ({-code})"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def log_tail(path: str, who: str, chars: int = 3000) -> str:
    """The last ``chars`` of a child's log, headed with ``who``; '' when there is none."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            text = f.read().decode(errors="replace").strip()
    except OSError:
        return ""
    return f"\n--- last lines of {who}'s output ---\n{text}" if text else ""


def stop(procs: Iterable[subprocess.Popen[bytes]], grace_s: float = 0.0) -> None:
    """Give the children ``grace_s`` to exit by themselves, then SIGTERM, then SIGKILL what is
    left 2 s later."""
    procs = list(procs)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5.0)
