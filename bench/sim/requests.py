"""What the batching scheduler moves and hands back: requests, micro-batches, chunks, tickets.

A submitted request is a :class:`_Root`; on a node's queue it is a :class:`_Request`; fused and
split, it becomes :class:`_Work` (one micro-batch for one device); what a node finishes of it
is a :class:`Chunk`; the caller holds a :class:`Ticket`. :class:`_Node` is a node's queue,
policy and counters.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from runtime.sched.batching import Batch, CostFn, join_outputs
from runtime.sched.devices import Slot
from yatt_graph import BatchPolicy

__all__ = ["Chunk", "NodeFn", "SchedulerError", "Ticket"]

NodeFn = Callable[[Batch, Slot], Any]
"""``fn(inputs, device) -> outputs`` (a dict with one entry per sample for batched ports), or
for a streaming node an iterable of ``(rows, outputs)``: ``rows`` are positions in ``inputs``."""


class SchedulerError(RuntimeError):
    """A node call failed under the scheduler; names the node, device and samples."""

    def __init__(self, message: str, node: str, device: str | None = None):
        super().__init__(message)
        self.node = node
        self.device = device


@dataclass
class Chunk:
    """Some samples of one submitted request, finished by one node (what a streaming node
    yields at a time, or a whole micro-batch)."""

    node: str
    root: int
    """The id of the submitted request (its :class:`Ticket`)."""
    rows: list[int]
    """Positions of these samples in the submitted request."""
    outputs: Batch
    inputs: Batch
    """The node's inputs for these samples (filled when a subscriber or a ``carry`` needs them)."""


class _Root:
    """One submitted request: collects its chunks at the nodes whose results are kept."""

    def __init__(self, rid: int, size: int, kept: Collection[str]):
        self.id, self.size = rid, size
        self.futures: dict[str, Future[Batch]] = {n: Future() for n in kept}
        self.chunks: dict[str, list[tuple[list[int], Batch]]] = {n: [] for n in kept}
        self.count = dict.fromkeys(kept, 0)
        self.failed: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        if self.failed is None:
            self.failed = exc
            for fut in self.futures.values():
                if not fut.done():
                    fut.set_exception(exc)


class Ticket:
    """The handle of a submitted request: its results, per kept node, in submitted order."""

    def __init__(self, root: _Root, node: str, sinks: list[str]):
        self._root, self.node, self.sinks = root, node, sinks
        self.id, self.size = root.id, root.size

    def future(self, node: str | None = None) -> Future[Batch]:
        if node is None:
            if len(self.sinks) != 1:
                raise ValueError(
                    f"request {self.id} reaches several final nodes {self.sinks}; name one: "
                    "ticket.result('node')"
                )
            node = self.sinks[0]
        try:
            return self._root.futures[node]
        except KeyError:
            raise KeyError(
                f"request {self.id}: results of node {node!r} are not kept; kept are "
                f"{sorted(self._root.futures)} (add the node with keep=True)"
            ) from None

    def result(self, node: str | None = None, timeout: float | None = None) -> Batch:
        """The outputs of ``node`` (default: the one final node) for every sample, in order."""
        try:
            return self.future(node).result(timeout)
        except FutureTimeout:
            raise TimeoutError(
                f"request {self.id}: node {node or self.sinks[0]!r} did not finish all "
                f"{self.size} samples within {timeout} s"
            ) from None

    def done(self) -> bool:
        return all(f.done() for f in self._root.futures.values())


@dataclass
class _Request:
    root: _Root
    rows: list[int]
    inputs: Batch
    costs: list[float]
    arrived: float


@dataclass
class _Work:
    node: str
    inputs: Batch
    origin: list[tuple[_Root, int]]
    arrivals: list[float]
    cost: float


@dataclass
class _Link:
    dst: str
    ports: dict[str, str]
    carry: dict[str, str]
    constants: dict[str, Any]


@dataclass
class _Node:
    name: str
    fn: NodeFn
    policy: BatchPolicy
    max_queue_delay_s: float
    cost: CostFn | None
    streaming: bool
    devices: list[Slot]
    group: str | None
    keep: bool
    shared: frozenset[str]
    pad_values: dict[str, float]
    left_pad: frozenset[str]
    downstream: list[_Link] = field(default_factory=list)
    upstream: list[str] = field(default_factory=list)
    pending: deque[_Request] = field(default_factory=deque)
    pending_samples: int = 0
    pending_cost: float = 0.0
    staging: int = 0
    ready: deque[_Work] = field(default_factory=deque)
    running: int = 0
    flush: bool = False
    # statistics
    requests: int = 0
    samples: int = 0
    batches: int = 0
    calls: int = 0
    wait_sum: float = 0.0
    wait_max: float = 0.0
    wait_n: int = 0
    delay_sum: float = 0.0
    delay_max: float = 0.0
    delay_n: int = 0

    def busy(self) -> bool:
        return bool(self.pending or self.staging or self.ready or self.running)


def _oldest(nodes: list[_Node]) -> _Node:
    return min(nodes, key=lambda st: min(st.ready[0].arrivals))


def _merge_outputs(chunks: list[tuple[list[int], Batch]], st: _Node) -> Batch:
    """Reassemble chunks in request order."""
    outs = [o for _, o in chunks]
    return join_outputs(outs, [rows for rows, _ in chunks], st.pad_values, st.left_pad)


def _per_sample(value: Any) -> bool:
    import torch

    return isinstance(value, list | tuple) or (isinstance(value, torch.Tensor) and value.dim() > 0)
