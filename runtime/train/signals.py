"""SIGTERM handled like Ctrl-C, stopping at a step boundary where it can.

``timeout``, systemd and Slurm stop a job with SIGTERM. While :func:`sigterm_as_interrupt` is
active, SIGTERM raises :class:`Terminated` (a ``KeyboardInterrupt``) in the main thread, so
every path that handles Ctrl-C runs: controllers shut down, metrics and the trace are flushed.
Inside :func:`at_step_boundary`, the training loop asks for the signal to wait for the end of
the step in progress (:func:`check` raises it there), so that the state a checkpoint takes is
a whole step's; a second SIGTERM stops at once. The first says so on stderr at once, with what
the step is waiting on (the node call in progress and the line it is at), so that a step
hung in a call is not a silent wait.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = [
    "Terminated",
    "at_step_boundary",
    "check",
    "node_call_in_progress",
    "pending",
    "sigterm_as_interrupt",
    "stopped_by",
]


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM (from ``timeout``, systemd, Slurm, ``kill``)."""


def stopped_by(exc: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped a run, ``SIGTERM`` or ``Ctrl-C``, and the exit code it ends with."""
    return ("SIGTERM", 143) if isinstance(exc, Terminated) else ("Ctrl-C", 130)


_state: dict[str, Any] = {"active": False, "defer": False, "pending": False, "waiting": None}


def _handler(signum: int, frame: Any) -> None:
    if _state["defer"] and not _state["pending"]:
        _state["pending"] = True
        _say_stopping(frame)
        return
    _state["pending"] = False
    raise Terminated(signum)


def _say_stopping(frame: FrameType | None) -> None:
    """One line on stderr: the run stops after the step in progress, and what that step is
    waiting on (``waiting()`` of :func:`at_step_boundary`, and the line the main thread is at)."""
    what = None
    try:
        what = _state["waiting"]() if _state["waiting"] is not None else None
    except Exception:  # (a description that fails must not lose the signal)
        what = None
    line = "yatt-graph run: SIGTERM: stopping after the step in progress"
    if what:
        line += f", which is waiting on {what}"
        at = _code_line(frame)
        if at:
            line += f" (at {at})"
    line += "; a second SIGTERM stops at once"
    with contextlib.suppress(OSError, ValueError):  # stderr closed: stop as asked all the same
        print(line, file=sys.stderr, flush=True)


_LIBRARY_PATHS = tuple(
    os.path.realpath(p) + os.sep
    for p in {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if p
)


def _code_line(frame: FrameType | None) -> str | None:
    """``file:line in function`` of the innermost frame of ``frame``'s stack that is not in
    Python's library or an installed package: the user's or this project's code it is in."""
    while frame is not None:
        path = os.path.realpath(frame.f_code.co_filename)
        if not path.startswith(_LIBRARY_PATHS) and not path.startswith("<"):
            name = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def node_call_in_progress(executor: Any) -> str | None:
    """What an in-process executor's step is waiting on: ``node 'x' (Class), step N, for S s``
    (its engine's call in progress), or None (between calls, or an executor whose calls run
    in other processes)."""
    engine = getattr(executor, "engine", None)
    running = getattr(engine, "running", None)
    if running is None:
        return None
    node = getattr(executor, "graph", None)
    node = node.nodes.get(running.node) if node is not None else None
    kind = f" ({type(node).__name__})" if node is not None else ""
    seconds = time.monotonic() - running.started
    return f"node {running.node!r}{kind}, step {running.step}, for {seconds:.0f} s"


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into :class:`Terminated` while the block runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread() or _state["active"]:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _handler)
    _state.update(active=True, pending=False)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _state.update(active=False, defer=False, pending=False, waiting=None)


@contextmanager
def at_step_boundary(waiting: Callable[[], str | None] | None = None) -> Iterator[None]:
    """Within the block, a first SIGTERM waits for :func:`check` (called after each step),
    and says so naming ``waiting()``: what the step in progress waits on (None: nothing
    known, e.g. :func:`node_call_in_progress`)."""
    if not _state["active"]:
        yield
        return
    _state.update(defer=True, waiting=waiting)
    try:
        yield
    except BaseException:
        _state.update(defer=False, pending=False, waiting=None)
        raise
    _state.update(defer=False, waiting=None)
    check()  # a SIGTERM that came after the last step


def pending() -> bool:
    """Whether a SIGTERM is waiting for the step boundary (executors' ``run(stop=...)``)."""
    return bool(_state["pending"])


def check() -> None:
    """Raise the SIGTERM that arrived during the step that just ended, if one did."""
    if _state["pending"]:
        _state["pending"] = False
        raise Terminated(signal.SIGTERM)
