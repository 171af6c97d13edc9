"""Roles taking turns on a device: when a process's model state leaves it and comes back, timed.

Under colocated placement the roles of a step share the devices. A node's :meth:`offload`
moves its device state (weights, buffers, optimizer state) to host memory and :meth:`reload`
brings it back (:mod:`nodes.models.offload`; nodes without device state do nothing). The step
engine asks a :class:`Switch` when:

* ``"phase"`` (a ZeroMQ controller whose device another controller shares): once nothing
  here is ready to run (its part of the step is done, the next role is elsewhere) and no
  stream is being fed here, every node here is offloaded; a node's state comes back just
  before its own next call, not its neighbours': a small node that runs early (the vision
  encoder of the next step, while another controller still trains) does not bring the
  rollout's policy back onto a device the trainer is using.
* ``"roles"`` (the in-process executor, several model roles on one device): before a node
  with device state runs, the other nodes' state leaves and its own comes back; what it
  shares with them (a policy under the rollout and the update) stays (:meth:`Node.claim`).

Each switch is timed (``time.time()`` start, seconds, bytes moved) and kept with the step it
belongs to: :attr:`StepResult.switches`, the ``sched/switch_s``, ``sched/offload_s``,
``sched/reload_s`` (and bytes) metrics of :func:`switch_metrics`, and spans in ``trace.json``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from runtime.engine.calls import node_op
from runtime.engine.config import check_offload
from runtime.sched.devices import check_choice
from yatt_graph import Node

__all__ = [
    "Switch",
    "has_device_state",
    "offloading",
    "switch_metrics",
]


def offloading(
    offload: str, *, placement: str, max_staleness: int, resources: Sequence[Any]
) -> list[int]:
    """The controllers of a ZeroMQ run that offload (``"phase"``): every one with ``"on"``,
    none with ``"off"``; with ``"auto"``, under colocated placement on-policy (the roles take
    turns), each controller whose GPUs (``Resources.cuda``) another controller also has. On a
    CPU nothing is time-shared this way (the cores are, :mod:`runtime.sched.affinity`)."""
    check_offload(offload, "offloading")
    if offload != "auto":
        return list(range(len(resources))) if offload == "on" else []
    if placement != "colocated" or max_staleness != 0:
        return []
    gpus = [set(r.cuda) if r is not None else set() for r in resources]
    return [c for c, mine in enumerate(gpus) if any(mine & o for d, o in enumerate(gpus) if d != c)]


def has_device_state(node: Any) -> bool:
    """Whether a node moves anything on :meth:`offload` (it overrides Node's no-op)."""
    return type(node).offload is not Node.offload


class Switch:
    """Offloads and reloads the nodes of one process (see the module docstring)."""

    def __init__(self, nodes: Mapping[str, Any], mode: str, here: int = 0):
        check_choice("Switch", "mode", mode, ("phase", "roles"))
        self.mode, self.here = mode, here
        self.nodes = {n: node for n, node in nodes.items() if has_device_state(node)}
        self.resident = set(self.nodes)
        """Nodes whose state is on the device (all of them, as built)."""
        for node in self.nodes.values():  # moves nothing; each node now holds its modules, so
            node_op(node, "reload")  # one that another node shares stays while either needs it
        self.spans: dict[int, list[tuple[str, float, float, int, int]]] = defaultdict(list)
        """Per step: (``offload``/``reload``, start ``time.time()``, seconds, bytes, controller)."""

    def _timed(self, what: str, names: Iterable[str], step: int) -> None:
        names = list(names)
        if not names:
            return
        start, t0 = time.time(), time.perf_counter()
        moved = 0
        for name in names:
            node = self.nodes[name]
            moved += int(node_op(node, what) or 0)
            if what == "offload":
                self.resident.discard(name)
            else:
                self.resident.add(name)
        self.spans[step].append((what, start, time.perf_counter() - t0, moved, self.here))

    def before(self, name: str, step: int) -> None:
        """``name`` is about to run ``step``: bring back what it needs."""
        if name not in self.nodes:
            return  # a node without device state needs none back
        if self.mode == "phase":
            if name not in self.resident:
                self._timed("reload", [name], step)
            return
        self.nodes[name].claim()  # what it shares with the others stays on the device
        self._timed("offload", [n for n in self.nodes if n in self.resident and n != name], step)
        if name not in self.resident:
            self._timed("reload", [name], step)

    def phase_done(self, step: int) -> None:
        """Nothing here is ready: this process's turn on the device ends (``"phase"``)."""
        if self.mode == "phase" and self.resident:
            self._timed("offload", [n for n in self.nodes if n in self.resident], step)

    def pop(self, step: int) -> list[tuple[str, float, float, int, int]]:
        """The switches of ``step`` (once)."""
        return self.spans.pop(step, [])


def switch_metrics(
    switches: Sequence[Sequence[Any]], controllers: Iterable[int] = ()
) -> dict[str, float]:
    """A step's switches as ``sched/*`` metrics: ``switch_s`` (offload + reload seconds, over
    every process), ``offload_s``, ``reload_s``, ``offload_bytes``, ``reload_bytes``,
    ``switches``, and ``switch_s/cN`` for each controller in ``controllers``."""
    kinds = ("switch_s", "offload_s", "reload_s", "offload_bytes", "reload_bytes")
    out = {f"sched/{k}": 0.0 for k in kinds} | {"sched/switches": float(len(switches))}
    out.update({f"sched/switch_s/c{c}": 0.0 for c in controllers})
    for what, _, seconds, moved, controller in switches:
        out["sched/switch_s"] += seconds
        out[f"sched/{what}_s"] += seconds
        out[f"sched/{what}_bytes"] += float(moved)
        key = f"sched/switch_s/c{controller}"
        out[key] = out.get(key, 0.0) + seconds
    return out
