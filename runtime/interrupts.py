"""Ctrl-C and SIGTERM held off a stretch of code that must not be cut in the middle.

Python raises ``KeyboardInterrupt`` (and the run's SIGTERM handler :class:`Terminated`) between
any two bytecodes of the main thread, also inside ``queue`` and ``threading`` code, whose state
it can leave broken: a writer thread then never sees its shutdown and ``close()`` waits for
ever. :func:`interrupts_held` records the signals that arrive in its block and hands them to
their handlers when the block ends.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["interrupts_held"]

_HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Within the block, Ctrl-C and SIGTERM wait; at its end they act as they would have.

    Keep the block short and bounded (a write, a close with timeouts): a signal waits for it.
    In a thread other than the main one (where no handler runs) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    old = {s: signal.signal(s, lambda s, f: caught.append(s)) for s in _HELD}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    for s in dict.fromkeys(caught):
        handler = old[s]
        if callable(handler):
            handler(s, None)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(s)
