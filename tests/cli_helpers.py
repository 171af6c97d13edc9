"""``yatt-graph`` as a user types it: the venv's console script in a subprocess, in a folder
the test chose (outside the repository), with a timeout."""

from __future__ import annotations

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
