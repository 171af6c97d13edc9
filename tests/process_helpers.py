"""The processes a test started: what a test checks is gone after a command ends."""

from __future__ import annotations

import os
from pathlib import Path


def live_children() -> list[int]:
    """Pids of live (not zombie) processes this process started."""
    me, pids = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == me and stat[0] != "Z":
                pids.append(int(entry.name))
    return pids
