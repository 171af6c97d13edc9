"""How a run is stopped from outside (the errors a user can fix are
:class:`yatt_graph.UsageError`).

:class:`Terminated` is how a SIGTERM reaches the code that cleans up: it is a
``KeyboardInterrupt``, so every path that handles Ctrl-C (closing controllers, flushing
metrics and the trace) handles it too.
"""

from __future__ import annotations

__all__ = ["Terminated"]


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM (from ``timeout``, systemd, Slurm, ``kill``)."""
