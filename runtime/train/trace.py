"""Node spans in Chrome trace format (open ``trace.json`` in Perfetto or chrome://tracing).

Each controller is a process row and each node a span on it, so pipelining across
controllers shows as overlapping bars.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["Tracer"]


class Tracer:
    """Collect complete ('X') events; ``save()`` writes them as a Chrome trace JSON file."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._origin: float | None = None
        self._named: set[int] = set()

    def span(
        self, name: str, start_s: float, duration_s: float, controller: int = 0, **args: Any
    ) -> None:
        """A span that began at ``start_s`` (``time.time()``) and lasted ``duration_s``."""
        if self._origin is None:
            self._origin = start_s
        if controller not in self._named:
            self._named.add(controller)
            self.events.append(
                {
                    "ph": "M",
                    "name": "process_name",
                    "pid": controller,
                    "tid": 0,
                    "args": {"name": f"controller {controller}"},
                }
            )
        self.events.append(
            {
                "ph": "X",
                "name": name,
                "pid": controller,
                "tid": 0,
                "ts": (start_s - self._origin) * 1e6,
                "dur": duration_s * 1e6,
                "args": args,
            }
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}))
        os.replace(tmp, path)
        return path
