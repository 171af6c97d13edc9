"""Node spans in Chrome trace format (open ``trace.json`` in Perfetto or chrome://tracing).

Each controller is a process row and each node a span on it, so pipelining across
controllers shows as overlapping bars. A multi-turn rollout's turns are spans inside its own
(:meth:`Tracer.turns`).

The events go to the file as they come, one a line, so a run of any length holds none of them
in memory; the file is whole JSON once the run ends (:meth:`Tracer.close`), and one cut short
(a run still writing it, or killed) reads up to its last whole event (:func:`read_trace`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

__all__ = ["Tracer", "read_trace"]


def read_trace(path: str | Path) -> tuple[list[dict[str, Any]], float | None, bool]:
    """The events of a ``trace.json``, the origin its times count from (``time.time()``;
    None where it has none) and whether the file was whole; of one cut short, the events
    before the cut. Raises OSError where it cannot be read, ValueError where it holds no
    trace."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if data is not None:
        events = data.get("traceEvents") if isinstance(data, dict) else data
        if not isinstance(events, list):
            raise ValueError(f"{path}: no traceEvents list")
        other = data.get("otherData") if isinstance(data, dict) else None
        origin = other.get("origin_s") if isinstance(other, dict) else None
        origin = float(origin) if isinstance(origin, int | float) else None
        return [e for e in events if isinstance(e, dict)], origin, True
    start = text.find("[")
    if start < 0:
        raise ValueError(f"{path}: not a trace")
    origin = None
    try:  # the head before the events, up to '"traceEvents": ['
        head = json.loads(text[:start] + "[]}")
        origin = float(head["otherData"]["origin_s"])
    except (ValueError, KeyError, TypeError):
        pass
    decoder, events, at = json.JSONDecoder(), [], start + 1
    while True:
        while at < len(text) and text[at] in " \n\r\t,":
            at += 1
        try:
            event, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        if isinstance(event, dict):
            events.append(event)
    return events, origin, False


class Tracer:
    """Writes complete ('X'), instant ('i') and controller-name ('M') events to ``path`` as
    they come (none where ``path`` is None); :meth:`close` ends the file.

    ``keep_before``: a resumed run's step; the events of earlier steps in the ``trace.json``
    already at ``path`` stay at its start (a missing or unreadable one is left out), and the
    file is rewritten from the first new event."""

    def __init__(self, path: str | Path | None = None, keep_before: int = 0) -> None:
        self.path = Path(path) if path is not None else None
        self._origin: float | None = None
        self._named: set[int] = set()
        self._earlier: list[dict[str, Any]] = []
        self._file: IO[str] | None = None
        self._count = 0
        if self.path is not None and keep_before > 0:
            self._keep_earlier(keep_before)

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
            self._put(
                {
                    "ph": "M",
                    "name": "process_name",
                    "pid": controller,
                    "tid": 0,
                    "args": {"name": f"controller {controller}"},
                }
            )
        self._put(
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
        self._put(
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

    def _keep_earlier(self, before_step: int) -> None:
        assert self.path is not None
        try:
            events, origin, _ = read_trace(self.path)
        except (OSError, ValueError):
            return
        if origin is None:
            return
        for event in events:
            if event.get("ph") == "M":
                self._named.add(event.get("pid"))
            elif (event.get("args") or {}).get("step", before_step) >= before_step:
                continue
            self._earlier.append(event)
        self._origin = origin

    def _put(self, event: dict[str, Any]) -> None:
        if self.path is None:
            return
        if self._file is None:
            self._start()
        assert self._file is not None
        self._file.write(("\n" if self._count == 0 else ",\n") + json.dumps(event))
        self._count += 1

    def _start(self) -> None:
        """Open the file: its head, then the earlier run's events."""
        assert self.path is not None
        self._file = self.path.open("w", encoding="utf-8")
        head: dict[str, Any] = {"displayTimeUnit": "ms"}
        if self._origin is not None:
            head["otherData"] = {"origin_s": self._origin}  # where a resumed run goes on
        self._file.write(json.dumps(head)[:-1] + ', "traceEvents": [')
        earlier, self._earlier = self._earlier, []
        for event in earlier:
            self._put(event)

    def flush(self) -> None:
        """Put what was written so far on disk (the training loop does after each step, so a
        report of a run in progress or killed sees every step recorded)."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> Path | None:
        """End the file (a run of no new step writes the earlier run's events, or none); its
        path, or None without one."""
        if self.path is None:
            return None
        if self._file is None:
            self._start()
        assert self._file is not None
        self._file.write("\n]}\n")
        self._file.close()
        return self.path
