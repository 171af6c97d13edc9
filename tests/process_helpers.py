"""The processes a test started: what a test checks is gone after a command ends, and a
graph file whose node hangs, to stop a run with signals."""

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


_HANGING_GRAPH = """
import time

import torch

from yatt_graph import Graph, Tensor, node

CALLS = [0]


@node(outputs={"x": Tensor("float32", "B")})
def source():
    return {"x": torch.zeros(2)}


@node(outputs={"scores": Tensor("float32", "B")})
def stuck(x: Tensor("float32", "B")):
    CALLS[0] += 1
    if CALLS[0] > RETURNS:
        print("hung", flush=True)
        time.sleep(1000)
    return {"scores": x + 1}


def build_graph():
    with Graph("hang") as g:
        g.output("scores", stuck(source()))
    return g
"""


def hanging_graph(returns: int = 0) -> str:
    """A graph file whose node ``stuck`` returns from its first ``returns`` calls; in the next
    one it prints ``hung`` and sleeps 1000 s."""
    return _HANGING_GRAPH.replace("RETURNS", str(returns))


def hanging_lines() -> tuple[int, int]:
    """The lines of :func:`hanging_graph`'s file where ``stuck`` hangs: its print and the sleep."""
    lines = _HANGING_GRAPH.splitlines()
    at = next(i for i, line in enumerate(lines, 1) if "print(" in line)
    return at, at + 1
