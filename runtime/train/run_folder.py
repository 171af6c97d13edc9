"""A run folder (``yatt-graph run --out DIR``): one run at a time, never mixed with another.

A folder holds ``metrics.jsonl``, ``trace.json``, ``events.jsonl``, ``summary.json``, ``checkpoints/`` (and
``tensorboard/`` when installed), ``samples/``, and from the start ``settings.json`` and
``graph.json`` (:func:`record_run`). :class:`RunLock` holds ``DIR/.lock`` (``fcntl.flock``,
with the pid and host written in it) for the run's lifetime, so a second run into the folder
is refused at once; the kernel drops the lock when its process dies, and a lock file left by a
dead process is taken over with a warning. :func:`prepare_run_folder` refuses a folder that
already holds a run unless it is resumed or overwritten (its files are then moved into
``DIR/previous-<time>/``, nothing is deleted). :func:`check_folder` and :func:`check_new_path`
check output paths before the first step.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from runtime.pids import pid_alive
from runtime.train.checkpoint import checkpoint_step, checkpoints
from yatt_graph import UsageError

__all__ = [
    "RunLock",
    "check_folder",
    "check_new_path",
    "holds_run",
    "move_aside",
    "prepare_run_folder",
    "record_run",
    "run_folder_of",
]

LOCK_NAME = ".lock"
_EDGE_FIELDS = ("src", "src_port", "dst", "dst_port", "delay")


def check_folder(path: Path, flag: str) -> None:
    """``path`` is (or can be made) a folder this process can write into; else a UsageError."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path}: this is a file, not a folder; choose a folder path")
    probe = path / f".write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(
            f"{flag} {path}: cannot write there ({exc.strerror or exc}); choose a folder you "
            "can write to"
        ) from None


def check_new_path(path: Path, flag: str) -> None:
    """``path`` does not exist yet and its parent folder can be written."""
    if path.exists():
        raise UsageError(f"{flag} {path}: it already exists; remove it or choose a new path")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot create it under {parent}; choose another path")


def holds_run(out: Path) -> list[str]:
    """What in ``out`` shows that a run wrote there (empty: nothing)."""
    found = []
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    if checkpoints(out):
        found.append(f"{len(checkpoints(out))} checkpoint(s)")
    return found


def run_folder_of(resume: Path) -> Path:
    """The run folder that holds ``resume`` (a run folder, or its ``checkpoints/step_N``)."""
    if checkpoint_step(resume) is not None and resume.parent.name == "checkpoints":
        return resume.parent.parent
    return resume


def move_aside(out: Path, names: list[str] | None = None) -> Path | None:
    """Move the entries of ``out`` (all but the lock and earlier ``previous-*`` folders, or
    only ``names``) into a new ``out/previous-<time>/``; returns it, None if nothing moved."""
    entries = [
        p
        for p in sorted(out.iterdir())
        if p.name != LOCK_NAME and not p.name.startswith("previous-")
    ]
    if names is not None:
        entries = [out / n for n in names if (out / n).exists()]
    if not entries:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = out / f"previous-{stamp}"
    n = 1
    while target.exists():
        n += 1
        target = out / f"previous-{stamp}-{n}"
    target.mkdir()
    for entry in entries:
        dest = target / entry.relative_to(out)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(entry, dest)
    return target


def prepare_run_folder(out: Path, *, resuming_here: bool, overwrite: bool) -> str | None:
    """Refuse a folder holding a run unless resumed into or overwritten; returns a note to
    print (where old files went), or None."""
    found = holds_run(out)
    if not found:
        return None
    if overwrite:
        moved = move_aside(out)
        return f"--overwrite: moved the earlier run's files into {moved}" if moved else None
    if resuming_here:
        return None
    raise UsageError(
        f"--out {out} already holds a run ({', '.join(found)}); continue it with --resume {out}, "
        f"start afresh with --overwrite (its files move into {out}/previous-<time>/), or choose "
        "another --out"
    )


def graph_record(graph: Any) -> dict[str, Any]:
    """A graph's nodes (name, kind) and edges, as JSON values: what a report draws."""
    return {
        "name": graph.name,
        "nodes": [{"name": name, "kind": node.kind} for name, node in graph.nodes.items()],
        "edges": [{k: getattr(e, k) for k in _EDGE_FIELDS} for e in graph.edges],
    }


def record_run(out: Path, settings: dict[str, Any], graph: Any) -> None:
    """Write ``out/settings.json`` (the run's effective settings) and ``out/graph.json``
    (:func:`graph_record`) as the run starts, each whole or not at all."""
    for name, value in (("settings.json", settings), ("graph.json", graph_record(graph))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, out / name)


class RunLock:
    """``DIR/.lock`` held with ``fcntl.flock`` while a run writes into ``DIR``."""

    def __init__(self, out: Path):
        self.out = out
        self.path = out / LOCK_NAME
        self._file: Any = None

    def acquire(self) -> RunLock:
        self.out.mkdir(parents=True, exist_ok=True)
        f = self.path.open("a+", encoding="utf-8")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(f)
            f.close()
            raise UsageError(
                f"--out {self.out} is in use by another run ({holder}); wait for it to end, "
                "stop it, or choose another --out"
            ) from None
        held = self._read(f)
        if held.get("pid") and (held.get("pid"), held.get("host")) != (
            os.getpid(),
            socket.gethostname(),
        ):
            gone = "gone" if not pid_alive(int(held["pid"])) else "no longer holding it"
            print(
                f"yatt-graph run: taking over the stale lock of {self.out} (pid {held['pid']} on "
                f"{held.get('host')}, {gone})",
                file=sys.stderr,
            )
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n")
        f.flush()
        self._file = f
        return self

    @staticmethod
    def _read(f: Any) -> dict[str, Any]:
        f.seek(0)
        try:
            held = json.loads(f.read() or "{}")
        except json.JSONDecodeError:
            return {}
        return held if isinstance(held, dict) else {}

    def _holder(self, f: Any) -> str:
        held = self._read(f)
        if not held.get("pid"):
            return f"its lock {self.path} is held"
        return f"pid {held['pid']} on {held.get('host', '?')}, lock file {self.path}"

    def release(self) -> None:
        if self._file is None:
            return
        self._file.seek(0)
        self._file.truncate()  # an empty lock file: the next run sees a clean hand-over
        self._file.flush()
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        self._file = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
