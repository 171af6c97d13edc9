"""Node spans in Chrome trace format (open ``trace.json`` in Perfetto or chrome://tracing).

Each controller is a process row and each node a span on it, so pipelining across
controllers shows as overlapping bars. A multi-turn rollout's turns are spans inside its own
(:meth:`Tracer.turns`).
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
        self,
        name: str,
        start_s: float,
        duration_s: float,
        controller: int = 0,
        cat: str = "node",
        **args: Any,
    ) -> None:
        """A span that began at ``start_s`` (``time.time()``) and lasted ``duration_s``;
        ``cat``: ``node`` (a node's call, a switch), or ``turn`` (part of a node's call)."""
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
                "cat": cat,
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

    def turns(self, trajectories: Any, controller: int, step: int) -> None:
        """A multi-turn rollout's turns, from its ``trajectories`` records' ``turn_times``,
        as spans inside the rollout's: each turn of a call is ``turn K`` (its sampling, then
        the environment's steps), with the rows of the trajectories it held, and ``turn K:
        environment`` inside it."""
        turns: dict[tuple[int, float], list[tuple[int, float, float]]] = {}
        for row, record in enumerate(trajectories):
            times = record.get("turn_times", ()) if isinstance(record, dict) else ()
            for k, (start, sampling, env) in enumerate(times):
                turns.setdefault((k, start), []).append((row, sampling, env))
        for (k, start), rows in sorted(turns.items(), key=lambda item: item[0][1]):
            sampling, env = rows[0][1], sum(r[2] for r in rows)
            self.span(
                f"turn {k + 1}", start, sampling + env, controller, "turn", step=step,
                trajectories=[r[0] for r in rows],
            )  # fmt: skip
            self.span(f"turn {k + 1}: environment", start + sampling, env, controller, "turn",
                      step=step)  # fmt: skip

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
