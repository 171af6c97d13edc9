"""``yatt-graph`` as a user types it, in a folder the test chose (outside the repository): the
venv's console script in a subprocess, with a timeout (:func:`yatt`), or the same command's
``main`` in this process (:func:`yatt_here`: a refusal found before any step, without the
seconds a new process spends importing torch)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

YATT = str(Path(sys.executable).with_name("yatt-graph"))
"""The installed console script, beside this interpreter."""


def yatt(cwd: Path, *argv: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``yatt-graph ARGV`` run in ``cwd``, its output captured as text (no PYTHONPATH of the
    suite's: what a user's shell has)."""
    return subprocess.run(
        [YATT, *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": ""},
    )  # fmt: skip


def yatt_here(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """``yatt-graph ARGV`` as :func:`yatt` runs it, through the console script's ``main`` in
    this process, in ``cwd``: its exit code and its output as text."""
    from runtime.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["yatt-graph", *argv], code, out.getvalue(), err.getvalue())
