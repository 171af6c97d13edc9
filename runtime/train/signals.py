"""SIGTERM handled like Ctrl-C, stopping at a step boundary where it can.

``timeout``, systemd and Slurm stop a job with SIGTERM. While :func:`sigterm_as_interrupt` is
active, SIGTERM raises :class:`Terminated` (a ``KeyboardInterrupt``) in the main thread, so
every path that handles Ctrl-C runs: controllers shut down, metrics and the trace are flushed.
Inside :func:`at_step_boundary`, the training loop asks for the signal to wait for the end of
the step in progress (:func:`check` raises it there), so that the state a checkpoint takes is
a whole step's; a second SIGTERM stops at once.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "Terminated",
    "at_step_boundary",
    "check",
    "pending",
    "sigterm_as_interrupt",
    "stopped_by",
]


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM (from ``timeout``, systemd, Slurm, ``kill``)."""


def stopped_by(exc: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped a run, ``SIGTERM`` or ``Ctrl-C``, and the exit code it ends with."""
    return ("SIGTERM", 143) if isinstance(exc, Terminated) else ("Ctrl-C", 130)


_state = {"active": False, "defer": False, "pending": False}


def _handler(signum: int, frame: Any) -> None:
    if _state["defer"] and not _state["pending"]:
        _state["pending"] = True
        return
    _state["pending"] = False
    raise Terminated(signum)


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
        _state.update(active=False, defer=False, pending=False)


@contextmanager
def at_step_boundary() -> Iterator[None]:
    """Within the block, a first SIGTERM waits for :func:`check` (called after each step)."""
    if not _state["active"]:
        yield
        return
    _state["defer"] = True
    try:
        yield
    except BaseException:
        _state.update(defer=False, pending=False)
        raise
    _state["defer"] = False
    check()  # a SIGTERM that came after the last step


def pending() -> bool:
    """Whether a SIGTERM is waiting for the step boundary (executors' ``run(stop=...)``)."""
    return bool(_state["pending"])


def check() -> None:
    """Raise the SIGTERM that arrived during the step that just ended, if one did."""
    if _state["pending"]:
        _state["pending"] = False
        raise Terminated(signal.SIGTERM)
