"""The errors a user can fix, told apart from bugs.

``yatt-graph`` shows a :class:`UsageError` as one line (what, where, how to fix) with exit
code 2; any other exception is a bug and keeps its traceback. :class:`Terminated` is how a
SIGTERM reaches the code that cleans up: it is a ``KeyboardInterrupt``, so every path that
handles Ctrl-C (closing controllers, flushing metrics and the trace) handles it too.
"""

from __future__ import annotations

__all__ = ["Terminated", "UsageError"]


class UsageError(Exception):
    """Bad input from the user (a flag, a folder, a checkpoint): the message says how to fix it."""


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM (from ``timeout``, systemd, Slurm, ``kill``)."""
