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

    def instant(self, name: str, at_s: float, **args: Any) -> None:
        """A global instant event ('i') at ``at_s`` (``time.time()``): a scheduler decision."""
        if self._origin is None:
            self._origin = at_s
        self.events.append(
            {
                "ph": "i",
                "s": "g",
                "name": name,
                "pid": 0,
                "tid": 0,
                "ts": (at_s - self._origin) * 1e6,
                "args": args,
            }
        )

    def keep_earlier(self, path: str | Path, before_step: int) -> None:
        """Start from the spans of steps before ``before_step`` in an earlier ``trace.json``
        (a resumed run continues its trace); a missing or unreadable file is skipped."""
        try:
            data = json.loads(Path(path).read_text())
            events, origin = data["traceEvents"], data.get("otherData", {}).get("origin_s")
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return
        if not isinstance(events, list) or not isinstance(origin, int | float):
            return
        for event in events:
            if not isinstance(event, dict):
                continue
            if event.get("ph") == "M":
                self._named.add(event.get("pid"))
            elif (event.get("args") or {}).get("step", before_step) >= before_step:
                continue
            self.events.append(event)
        self._origin = float(origin)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        data = {"traceEvents": self.events, "displayTimeUnit": "ms"}
        if self._origin is not None:
            data["otherData"] = {"origin_s": self._origin}  # where a resumed run goes on
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
        return path
