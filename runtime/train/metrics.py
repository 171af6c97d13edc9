"""Per-step metrics: one JSON line per step in ``DIR/metrics.jsonl``, TensorBoard when installed.

:func:`summarize` turns a step's graph outputs into flat numbers: a tensor output
becomes its mean (and std, for per-sample scores), a dict of numbers is flattened
under its output's name, and each node's wall time becomes ``time/<node>``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import socket
import struct
import time
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

from runtime.interrupts import interrupts_held

__all__ = [
    "CURVES",
    "EventFile",
    "MetricsWriter",
    "curve_key",
    "json_number",
    "read_metrics",
    "summarize",
    "truncate_metrics",
]

#: The curves a run is followed by, each with the metric names that can carry it, in order of
#: preference: the progress bar shows them and ``yatt-graph plot`` draws them. approx_kl, the
#: policy's change within one update, is not a KL to the reference and is not one of them.
CURVES: dict[str, tuple[str, ...]] = {
    "reward": ("scores/mean", "reward/mean"),
    "kl": ("kl", "kl_ref"),
}


def curve_key(keys: Collection[str], names: tuple[str, ...]) -> str | None:
    """The first of ``names`` among ``keys``, as a key or as a key's last part
    ("advantage/kl" is the ``kl`` of the graph output "advantage"); None if none is there."""
    for name in names:
        if name in keys:
            return name
        found = sorted(k for k in keys if k.endswith("/" + name))
        if found:
            return found[0]
    return None


def json_number(value: Any) -> Any:
    """``value``, but a float JSON cannot hold (NaN, inf) as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _number(value: Any) -> float | None:
    if isinstance(value, int | float):  # bool too
        return float(value)
    if getattr(value, "numel", None) is not None and value.numel() == 1:
        return float(value)
    return None


def summarize(
    step: int, outputs: dict[str, Any], node_seconds: dict[str, float], step_seconds: float
) -> dict[str, Any]:
    """Flatten one step into ``{"step": k, "reward/mean": ..., "time/rollout": ...}``."""
    row: dict[str, Any] = {"step": step, "time/step": step_seconds}
    for name, value in outputs.items():
        if hasattr(value, "dtype") and hasattr(value, "float") and value.numel() > 0:
            flat = value.detach().float()
            row[f"{name}/mean"] = float(flat.mean())
            if flat.numel() > 1:
                row[f"{name}/std"] = float(flat.std(unbiased=False))
        elif isinstance(value, dict):
            for key, item in value.items():
                number = _number(item)
                if number is not None:
                    row[f"{name}/{key}" if name != "metrics" else key] = number
        elif (number := _number(value)) is not None:
            row[name] = number
    for node, seconds in node_seconds.items():
        row[f"time/{node}"] = seconds
    return row


class MetricsWriter:
    """Append metric rows to ``metrics.jsonl`` and, when TensorBoard is installed, to an event
    file in ``tensorboard/`` (:class:`EventFile`), both on the caller's thread: a row is whole in
    both files when :meth:`write` returns, and a Ctrl-C or SIGTERM waits for it."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = True):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._events = EventFile.open(Path(out_dir) / "tensorboard") if tensorboard else None

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: json_number(v) for k, v in row.items()}
        line = json.dumps(clean, sort_keys=True) + "\n"
        with interrupts_held():  # no line cut in half by a signal
            self._file.write(line)
            self._file.flush()
            if self._events is not None:
                self._events.scalars(row["step"], row)

    def close(self) -> None:
        self._file.close()
        if self._events is not None:
            self._events.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_SERIAL = itertools.count()
"""Tells apart the event files one process opens in one second."""


class EventFile:
    """A TensorBoard event file written on the caller's thread: one ``Event`` a step holding
    every scalar of the row, each framed as a TFRecord (its length and the Event, each with
    its masked CRC-32C).

    TensorBoard's own writer checksums in pure Python on a thread of its own, about 0.4 ms of
    CPU a step for the demo's row of 45 metrics, which the step's computing threads lose on a
    small machine; ``google_crc32c`` (the ``tensorboard`` extra) does it in microseconds. Without it,
    TensorBoard's pure-Python checksum serves."""

    def __init__(self, folder: Path, crc32c: Any, protos: tuple[Any, Any]):
        folder.mkdir(parents=True, exist_ok=True)
        self._crc32c = crc32c
        self._event, self._summary = protos
        stamp = f"{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_SERIAL)}"
        self.path = folder / f"events.out.tfevents.{stamp}"
        self._file = self.path.open("ab")
        self._put(self._event(wall_time=time.time(), file_version="brain.Event:2"))

    @classmethod
    def open(cls, folder: Path) -> EventFile | None:
        """The event file of a run in ``folder``; None where TensorBoard is not installed."""
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
        except ImportError:
            return None
        try:
            from google_crc32c import value as crc32c
        except ImportError:
            from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c
        return cls(folder, crc32c, (Event, Summary))

    def scalars(self, step: int, row: dict[str, Any]) -> None:
        """The row's numbers (all but ``step``) as the scalars of ``step``."""
        values = [
            self._summary.Value(tag=key, simple_value=float(value))
            for key, value in row.items()
            if key != "step" and isinstance(value, int | float)
        ]
        event = self._event(wall_time=time.time(), step=step, summary=self._summary(value=values))
        self._put(event)

    def _put(self, event: Any) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._file.write(header + self._masked(header) + data + self._masked(data))
        self._file.flush()

    def _masked(self, data: bytes) -> bytes:
        """TFRecord's masked CRC-32C of ``data``, as 4 bytes."""
        crc = self._crc32c(data)
        rotated = ((crc >> 15) | (crc << 17)) & 0xFFFFFFFF
        return struct.pack("<I", (rotated + 0xA282EAD8) & 0xFFFFFFFF)

    def close(self) -> None:
        self._file.close()


def read_metrics(out_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``DIR/metrics.jsonl``; a run resumed from a checkpoint keeps the last row per step."""
    path = Path(out_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"no metrics at {path}: run `yatt-graph run GRAPH --out {out_dir}` first"
        )
    rows: dict[int, dict[str, Any]] = {}
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == last:  # a crash cut the last row short: the rows before it are whole
                warnings.warn(
                    f"{path}:{number}: the last line is cut short (the run stopped while writing "
                    f"it); using the {len(rows)} rows before it",
                    RuntimeWarning,
                    stacklevel=2,
                )
                break
            raise ValueError(f"{path}:{number}: not a JSON line ({exc})") from exc
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"{path}:{number}: a row without a whole-number 'step': {line[:80]!r}")
        rows[step] = row
    return [rows[k] for k in sorted(rows)]


def truncate_metrics(out_dir: str | Path, step: int) -> list[dict[str, Any]]:
    """Rewrite ``DIR/metrics.jsonl`` without the rows of steps >= ``step`` (and lines cut short
    by a crash), before a run continues from ``step``; returns the rows kept."""
    path = Path(out_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    kept, lines = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
            before = int(row["step"]) < step
        except (json.JSONDecodeError, TypeError, KeyError, ValueError):
            continue
        if before:
            kept.append(row)
            lines.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    os.replace(tmp, path)
    return kept
