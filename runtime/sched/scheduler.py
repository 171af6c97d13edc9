"""The dynamic batching scheduler: per-node queues, fusing by BatchPolicy, splitting across
devices, and streaming finished samples downstream.

::

    pool = DevicePool.detect(cpu_slots=2)
    sched = Scheduler(pool, placement=colocated(["rollout", "reward"], len(pool)))
    sched.add("rollout", generate, policy=BatchPolicy(max_batch_size=16), streaming=True)
    sched.add("reward", score, policy=BatchPolicy(max_batch_size=32), max_queue_delay_s=0.02)
    sched.connect("rollout", "reward", ports={"texts": "texts"}, carry={"meta": "meta"})
    with sched:
        ticket = sched.submit("rollout", {"prompts": prompts, "meta": meta})
        scores = ticket.result("reward", timeout=60)["scores"]     # in prompt order
    print(sched.summary())

How a request moves (the knobs are those of Triton's dynamic batcher):

1. **Queue.** ``submit`` (or an upstream node's output) puts a *request* (a batch of one or
   more samples) on the node's queue, with a cost per sample (``cost=``, default tokens /
   images / 1 by :func:`~runtime.sched.batching.default_costs`).
2. **Fuse.** The dispatcher thread merges queued requests, first come first served, into one
   batch of at most ``max_batch_size`` samples and ``max_tokens`` cost *per serving device*.
   It sends a batch when it is full, when its oldest request has waited the node's
   ``max_queue_delay_s`` (an argument of :meth:`Scheduler.add`; so a lone request is never held longer while a device could take
   it), or when no more can come (every upstream node is idle, or :meth:`Scheduler.flush`).
   While no serving device could start it anyway (each already has a micro-batch of the node
   queued, or the placement group is running another role) it keeps fusing instead.
3. **Split.** The batch is cut into micro-batches balanced by cost (Karmarkar-Karp or LPT),
   at least one per serving device and each within ``max_batch_size``/``max_tokens``. They
   go on the node's ready queue heaviest first; each device's worker thread takes the next
   one when it is free, so a slow micro-batch never holds the others.
4. **Stream.** A node function may be a generator yielding ``(rows, outputs)`` as samples
   finish (``streaming=True``); each :class:`Chunk` goes to the downstream queues at once, so the
   next node starts before the slowest sample of the batch is done.
5. **Gather.** Results reach a :class:`Ticket` per submitted request, put back in the
   submitted order (the inverse permutation of every fuse and split).

Placement (:mod:`runtime.sched.placement`) says which devices serve which node, and the cost of
switching a device between nodes. The :meth:`Scheduler.summary` dict holds per-device busy,
switch and idle time and per-node queue waits.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from runtime.sched.batching import (
    Batch,
    CostFn,
    batch_size,
    fuse,
    merge,
    micro_batches,
    sample_costs,
    split,
    take,
)
from runtime.sched.devices import Device, DevicePool
from runtime.sched.placement import Placement
from yatt_graph import BatchPolicy

__all__ = ["Chunk", "NodeFn", "Scheduler", "SchedulerError", "Ticket", "summary_text"]

NodeFn = Callable[[Batch, Device], Any]
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
    devices: list[Device]
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


class Scheduler:
    """Queues per node, fusing by BatchPolicy, splitting across devices, streaming.

    ``placement`` assigns nodes to device groups (default: every node on every device);
    ``partition`` is ``"kk"`` (Karmarkar-Karp) or ``"lpt"``; ``threads_per_worker`` sets
    ``torch.set_num_threads`` in each CPU worker (None leaves it); ``on_switch(device, old,
    new)`` runs, timed as switch time, whenever a device changes node (offload/reload).
    """

    def __init__(
        self,
        pool: DevicePool,
        placement: Placement | None = None,
        partition: str = "kk",
        threads_per_worker: int | None = 1,
        on_switch: Callable[[Device, str, str], None] | None = None,
    ):
        if partition not in ("kk", "lpt"):
            raise ValueError(f"Scheduler: partition must be 'kk' or 'lpt', got {partition!r}")
        self.pool = pool
        self.placement = placement.verify(len(pool)) if placement is not None else None
        self.partition = partition
        self.threads_per_worker = threads_per_worker
        self.on_switch = on_switch
        self._nodes: dict[str, _Node] = {}
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._started = self._stopping = False
        self._ids = itertools.count()
        self._role: dict[str, str | None] = {d.name: None for d in pool}
        self._active: dict[str, str | None] = {}
        self._subscribers: dict[str, list[Callable[[Chunk], None]]] = {}
        self._live: dict[int, _Root] = {}  # submitted requests not finished yet

    # --- declaring ---------------------------------------------------------------------------
    def add(
        self,
        name: str,
        fn: NodeFn,
        *,
        policy: BatchPolicy | None = None,
        max_queue_delay_s: float = 0.0,
        cost: CostFn | None = None,
        streaming: bool = False,
        devices: Sequence[int] | None = None,
        keep: bool = False,
        shared: Collection[str] = (),
        pad_values: Mapping[str, float] | None = None,
        left_pad: Collection[str] = (),
    ) -> None:
        """Register a node function.

        ``max_queue_delay_s`` is the longest a request waits for others to fuse with before it
        goes alone. ``devices`` (pool indices) overrides the placement. ``keep`` keeps this node's results
        in tickets even though it has downstream nodes. ``shared``, ``pad_values`` and
        ``left_pad`` tell fusing which ports are not per sample and how to pad ragged ones.
        """
        self._check_not_started("add")
        if name in self._nodes:
            raise ValueError(f"Scheduler.add: node {name!r} was already added")
        policy = (policy or BatchPolicy()).verify()
        if not max_queue_delay_s >= 0:
            raise ValueError(
                f"Scheduler.add: node {name!r}: max_queue_delay_s must be >= 0 seconds, got "
                f"{max_queue_delay_s!r}"
            )
        group = None
        if devices is None:
            if self.placement is not None and name in self.placement.nodes:
                devices = self.placement.devices_of(name)
                group = self.placement.group_of(name)
            else:
                devices = range(len(self.pool))
        bad = [d for d in devices if not 0 <= d < len(self.pool)]
        if bad or not devices:
            raise ValueError(
                f"Scheduler.add: node {name!r} asks for devices {list(devices)} but the pool "
                f"has {len(self.pool)} ({self.pool})"
            )
        self._nodes[name] = _Node(
            name,
            fn,
            policy,
            float(max_queue_delay_s),
            cost,
            streaming,
            [self.pool[d] for d in devices],
            group,
            keep,
            frozenset(shared),
            dict(pad_values or {}),
            frozenset(left_pad),
        )

    def add_node(self, node: Any, **options: Any) -> None:
        """Register a yatt_graph ``Node``: its name, its ``batch_policy`` and ``node.run``."""
        options.setdefault("policy", node.batch_policy)
        self.add(node.name, lambda inputs, device: node.run(inputs), **options)

    def connect(
        self,
        src: str,
        dst: str,
        ports: Mapping[str, str] | None = None,
        carry: Mapping[str, str] | None = None,
        constants: Mapping[str, Any] | None = None,
    ) -> None:
        """Send ``src``'s finished samples to ``dst`` as they finish.

        ``ports`` maps src output -> dst input (default: same names, all outputs); ``carry``
        maps src *input* -> dst input (fields passed through, such as ``meta``); ``constants``
        are dst inputs given the same value for every request.
        """
        self._check_not_started("connect")
        for n in (src, dst):
            if n not in self._nodes:
                raise KeyError(
                    f"Scheduler.connect: node {n!r} was not added; added: {sorted(self._nodes)}"
                )
        if self._nodes[dst].upstream:
            raise ValueError(
                f"Scheduler.connect: node {dst!r} already receives from "
                f"{self._nodes[dst].upstream[0]!r}; a node takes one upstream here (joins are "
                f"not supported): pass the other fields through with carry="
            )
        if self._reaches(dst, src):
            raise ValueError(f"Scheduler.connect: {src!r} -> {dst!r} would close a cycle")
        self._nodes[src].downstream.append(
            _Link(dst, dict(ports or {}), dict(carry or {}), dict(constants or {}))
        )
        self._nodes[dst].upstream.append(src)

    def subscribe(self, node: str, callback: Callable[[Chunk], None]) -> None:
        """Call ``callback(chunk)`` (on a worker thread) whenever ``node`` finishes samples."""
        if node not in self._nodes:
            raise KeyError(f"Scheduler.subscribe: node {node!r} was not added")
        self._subscribers.setdefault(node, []).append(callback)

    # --- running -----------------------------------------------------------------------------
    def start(self) -> Scheduler:
        """Start the dispatcher and one worker thread per device serving a node."""
        self._check_not_started("start")
        if not self._nodes:
            raise RuntimeError("Scheduler.start: no nodes were added")
        self._started = True
        self.pool.start()
        self._served: dict[str, list[str]] = {d.name: [] for d in self.pool}
        for st in self._nodes.values():
            for d in st.devices:
                self._served[d.name].append(st.name)
        # A device follows its group's role (the barrier) when everything it serves is in one
        # placement group of several nodes and the placement asks for the barrier.
        self._barrier_of: dict[str, str | None] = {}
        for d in self.pool:
            groups = {self._nodes[n].group for n in self._served[d.name]}
            g = groups.pop() if len(groups) == 1 else None
            members = [st for st in self._nodes.values() if st.group == g]
            ok = g is not None and self.placement is not None and self.placement.barrier
            self._barrier_of[d.name] = g if ok and len(members) > 1 else None
        self._barrier_groups = {g for g in self._barrier_of.values() if g is not None}
        self._active = dict.fromkeys(self._barrier_groups)
        self._threads = [
            threading.Thread(target=self._dispatch_loop, name="yatt-dispatch", daemon=True)
        ]
        for d in self.pool:
            if self._served[d.name]:
                self._threads.append(
                    threading.Thread(
                        target=self._worker_loop, args=(d,), name=f"yatt-{d.name}", daemon=True
                    )
                )
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the threads (after the calls now running); unfinished tickets fail."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)
        stopped = SchedulerError("the scheduler was stopped before this request finished", "-")
        with self._cond:
            for root in self._live.values():
                root.fail(stopped)
            self._live.clear()
            for st in self._nodes.values():
                st.pending.clear()
                st.ready.clear()

    def __enter__(self) -> Scheduler:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def submit(self, node: str, inputs: Mapping[str, Any]) -> Ticket:
        """Queue a request (a batch of samples) for ``node``; returns its :class:`Ticket`."""
        if not self._started or self._stopping:
            raise RuntimeError("Scheduler.submit: start the scheduler first (with sched: ...)")
        st = self._node(node, "submit")
        inputs = dict(inputs)
        n = batch_size(inputs, st.shared, where=f"node {node!r}: submitted request")
        costs = sample_costs(inputs, st.cost, where=f"node {node!r}")
        kept = self._kept_from(node)
        root = _Root(next(self._ids), n, kept)
        with self._cond:
            self._live[root.id] = root
            self._enqueue(st, _Request(root, list(range(n)), inputs, costs, time.monotonic()))
        return Ticket(root, node, [k for k in kept if not self._nodes[k].downstream])

    def flush(self, node: str | None = None) -> None:
        """Send what is queued at ``node`` (default: every node) now, without waiting the delay."""
        with self._cond:
            for st in [self._node(node, "flush")] if node else self._nodes.values():
                st.flush = bool(st.pending)
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> None:
        """Wait until no node has queued or running work; TimeoutError names the busy nodes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while any(st.busy() for st in self._nodes.values()):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    busy = {
                        st.name: f"{len(st.pending)} queued, {len(st.ready)} ready, {st.running} running"
                        for st in self._nodes.values()
                        if st.busy()
                    }
                    raise TimeoutError(f"Scheduler.drain: still busy after {timeout} s: {busy}")
                self._cond.wait(left)

    def reset_stats(self) -> None:
        """Start a new accounting window (device times and queue waits)."""
        with self._cond:
            self.pool.start()
            for st in self._nodes.values():
                st.requests = st.samples = st.batches = st.calls = st.wait_n = st.delay_n = 0
                st.wait_sum = st.wait_max = st.delay_sum = st.delay_max = 0.0

    def summary(self) -> dict[str, Any]:
        """Utilization per device and queue waits per node, as a JSON-able dict.

        ``devices[name]``: ``busy_s``, ``switch_s``, ``idle_s``, ``utilization``, ``calls``.
        ``nodes[name]``: ``requests``, ``samples``, ``batches`` (fused), ``calls``
        (micro-batches), ``mean_queue_wait_s``/``max_queue_wait_s`` (per sample, from queueing
        to the start of its call), ``mean_batch_delay_s``/``max_batch_delay_s`` (per request,
        from queueing to being sent by the batcher).
        """
        out = self.pool.summary()
        with self._cond:
            out["placement"] = self.placement.mode if self.placement else "all-devices"
            out["nodes"] = {
                st.name: {
                    "devices": [d.name for d in st.devices],
                    "requests": st.requests,
                    "samples": st.samples,
                    "batches": st.batches,
                    "calls": st.calls,
                    "mean_batch_samples": st.samples / st.batches if st.batches else 0.0,
                    "mean_queue_wait_s": st.wait_sum / st.wait_n if st.wait_n else 0.0,
                    "max_queue_wait_s": st.wait_max,
                    "mean_batch_delay_s": st.delay_sum / st.delay_n if st.delay_n else 0.0,
                    "max_batch_delay_s": st.delay_max,
                }
                for st in self._nodes.values()
            }
        return out

    # --- internals: graph --------------------------------------------------------------------
    def _node(self, name: str, where: str) -> _Node:
        try:
            return self._nodes[name]
        except KeyError:
            raise KeyError(
                f"Scheduler.{where}: no node {name!r}; added: {sorted(self._nodes)}"
            ) from None

    def _check_not_started(self, what: str) -> None:
        if self._started:
            raise RuntimeError(
                f"Scheduler.{what}: the scheduler is already running; declare nodes before start()"
            )

    def _reaches(self, a: str, b: str) -> bool:
        todo, seen = [a], set()
        while todo:
            n = todo.pop()
            if n == b:
                return True
            if n not in seen:
                seen.add(n)
                todo += [link.dst for link in self._nodes[n].downstream]
        return False

    def _kept_from(self, node: str) -> list[str]:
        kept, todo, seen = [], [node], set()
        while todo:
            n = todo.pop(0)
            if n in seen:
                continue
            seen.add(n)
            st = self._nodes[n]
            if st.keep or not st.downstream:
                kept.append(n)
            todo += [link.dst for link in st.downstream]
        return kept

    # --- internals: queues (call with the lock held) -----------------------------------------
    def _enqueue(self, st: _Node, req: _Request) -> None:
        st.pending.append(req)
        st.pending_samples += len(req.rows)
        st.pending_cost += sum(req.costs)
        st.requests += 1
        self._cond.notify_all()

    def _caps(self, st: _Node) -> tuple[float, float]:
        per_call = len(st.devices) if st.policy.splittable else 1
        cap_n = st.policy.max_batch_size * per_call or float("inf")
        cap_c = st.policy.max_tokens * per_call or float("inf")
        return cap_n, cap_c

    def _due(self, st: _Node, now: float) -> float | None:
        """None if a batch should go now, else when it will be due (inf: when a device frees)."""
        cap_n, cap_c = self._caps(st)
        if st.flush or st.pending_samples >= cap_n or st.pending_cost >= cap_c:
            return None
        if self._blocked(st):
            # No device could start it now: keep fusing (as Triton's batcher does while every
            # model instance is busy); a worker's pick or finish wakes the dispatcher.
            return math.inf
        due = st.pending[0].arrived + st.max_queue_delay_s
        return None if now >= due else due

    def _blocked(self, st: _Node) -> bool:
        """Whether more micro-batches of ``st`` would only wait: its group is busy with another
        role, or it already has a micro-batch queued for each of its devices."""
        if st.group is not None and st.group in self._barrier_groups:
            active = self._active.get(st.group)
            if active is not None and active != st.name and self._nodes[active].busy():
                return True
        return len(st.ready) >= len(st.devices)

    def _take(self, st: _Node, now: float) -> list[_Request]:
        cap_n, cap_c = self._caps(st)
        taken: list[_Request] = []
        n = c = 0.0
        while st.pending:
            r = st.pending[0]
            rn, rc = len(r.rows), sum(r.costs)
            if taken and (n + rn > cap_n or c + rc > cap_c):
                break
            st.pending.popleft()
            taken.append(r)
            n, c = n + rn, c + rc
            st.pending_samples -= rn
            st.pending_cost -= rc
            st.delay_sum += now - r.arrived
            st.delay_n += 1
            st.delay_max = max(st.delay_max, now - r.arrived)
        st.batches += 1
        st.samples += int(n)
        if not st.pending:
            st.flush, st.pending_cost = False, 0.0
        return taken

    def _dispatch_loop(self) -> None:
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                wake: float | None = None
                batches: list[tuple[_Node, list[_Request]]] = []
                for st in self._nodes.values():
                    if st.pending and st.upstream and not st.flush and self._upstream_idle(st):
                        st.flush = True  # nothing more can come: do not wait the delay
                    while st.pending:
                        due = self._due(st, now)
                        if due is not None:
                            wake = due if wake is None else min(wake, due)
                            break
                        batches.append((st, self._take(st, now)))
                        st.staging += 1
                if not batches:
                    timed = wake is not None and wake != math.inf
                    self._cond.wait(max(0.0, wake - now) if timed else None)
                    continue
                # Fuse and split outside the lock: workers keep running meanwhile.
                self._cond.release()
                try:
                    made = [(st, self._make_work(st, reqs)) for st, reqs in batches]
                finally:
                    self._cond.acquire()
                for st, works in made:
                    st.ready.extend(works)
                    st.staging -= 1
                self._cond.notify_all()

    def _make_work(self, st: _Node, reqs: list[_Request]) -> list[_Work]:
        try:
            if len(reqs) == 1:
                batch = reqs[0].inputs
            else:
                batch, _ = fuse([r.inputs for r in reqs], st.shared, st.pad_values, st.left_pad)
            origin = [(r.root, row) for r in reqs for row in r.rows]
            arrivals = [r.arrived for r in reqs for _ in r.rows]
            costs = [c for r in reqs for c in r.costs]
            if st.policy.splittable:
                parts = micro_batches(
                    costs,
                    devices=len(st.devices),
                    max_batch_size=st.policy.max_batch_size,
                    max_cost=st.policy.max_tokens,
                    method=self.partition,
                )
            else:
                parts = [list(range(len(costs)))]
            whole = len(parts) == 1 and parts[0] == list(range(len(costs)))
            micro = [batch] if whole else split(batch, parts, st.shared)
        except Exception as exc:
            err = SchedulerError(
                f"node {st.name!r}: could not fuse/split its batch: {exc}", st.name
            )
            err.__cause__ = exc
            for r in reqs:
                self._fail_root(r.root, err)
            return []
        return [
            _Work(
                st.name,
                mb,
                [origin[i] for i in p],
                [arrivals[i] for i in p],
                sum(costs[i] for i in p),
            )
            for mb, p in zip(micro, parts)
        ]

    # --- internals: workers ------------------------------------------------------------------
    def _pick(self, dev: Device) -> _Work | None:
        served = [self._nodes[n] for n in self._served[dev.name]]
        ready = [st for st in served if st.ready]
        if not ready:
            return None
        group = self._barrier_of[dev.name]
        if group is not None:
            active = self._active[group]
            if active is None or not self._nodes[active].busy():
                active = self._active[group] = _oldest(ready).name
            st = self._nodes[active]
            return st.ready.popleft() if st.ready else None
        role = self._role[dev.name]
        mine = [st for st in ready if st.name == role]
        return (mine[0] if mine else _oldest(ready)).ready.popleft()

    def _worker_loop(self, dev: Device) -> None:
        self._init_worker(dev)
        while True:
            with self._cond:
                work = None
                while not self._stopping and (work := self._pick(dev)) is None:
                    self._cond.wait()
                if work is None:
                    return
                self._cond.notify_all()  # the dispatcher may be holding a batch for a free device
                st = self._nodes[work.node]
                st.running += 1
                st.calls += 1
                start = time.monotonic()
                for t in work.arrivals:
                    st.wait_sum += start - t
                    st.wait_max = max(st.wait_max, start - t)
                st.wait_n += len(work.arrivals)
                old, self._role[dev.name] = self._role[dev.name], work.node
            try:
                if old is not None and old != work.node:
                    self._switch(dev, old, work.node)
                with self.pool.busy(dev, work.node):
                    self._execute(st, dev, work)
            except Exception as exc:
                err = SchedulerError(
                    f"node {work.node!r} failed on {dev.name} for {len(work.origin)} sample(s) "
                    f"(requests {sorted({r.id for r, _ in work.origin})}): {type(exc).__name__}: "
                    f"{exc}\n--- original traceback ---\n{traceback.format_exc()}",
                    work.node,
                    dev.name,
                )
                err.__cause__ = exc
                for root, _ in work.origin:
                    self._fail_root(root, err)
            finally:
                with self._cond:
                    st.running -= 1
                    self._cond.notify_all()

    def _init_worker(self, dev: Device) -> None:
        import torch

        if dev.kind == "cuda":
            torch.cuda.set_device(dev.index)
        elif self.threads_per_worker:
            torch.set_num_threads(self.threads_per_worker)

    def _switch(self, dev: Device, old: str, new: str) -> None:
        cost = self.placement.switch_cost_s if self.placement is not None else 0.0
        if not cost and self.on_switch is None:
            return
        with self.pool.switching(dev, new):
            if self.on_switch is not None:
                self.on_switch(dev, old, new)
            if cost:
                time.sleep(cost)  # a modelled offload/reload: the device can do nothing else

    def _fail_root(self, root: _Root, exc: BaseException) -> None:
        root.fail(exc)
        with self._cond:
            self._live.pop(root.id, None)

    def _upstream_idle(self, st: _Node) -> bool:
        return all(
            not self._nodes[u].busy() and self._upstream_idle(self._nodes[u]) for u in st.upstream
        )

    def _execute(self, st: _Node, dev: Device, work: _Work) -> None:
        n = len(work.origin)
        result = st.fn(work.inputs, dev)
        if not st.streaming:
            self._publish(st, work, list(range(n)), result)
            return
        if isinstance(result, Mapping) or not isinstance(result, Iterable):
            raise TypeError(
                f"node {st.name!r} is streaming but returned {type(result).__name__}; yield "
                "(rows, outputs) pairs, or add it with streaming=False"
            )
        done: set[int] = set()
        for item in result:
            try:
                rows, outputs = item
                rows = [int(r) for r in rows]
            except (TypeError, ValueError):
                raise TypeError(
                    f"node {st.name!r} yielded {type(item).__name__}; a streaming node yields "
                    "(rows, outputs) with rows = positions in its input batch"
                ) from None
            bad = [r for r in rows if not 0 <= r < n or r in done]
            if bad:
                raise ValueError(
                    f"node {st.name!r} yielded rows {bad}: out of range 0..{n - 1} or yielded twice"
                )
            done.update(rows)
            self._publish(st, work, rows, outputs)
        if len(done) != n:
            missing = sorted(set(range(n)) - done)
            raise ValueError(
                f"node {st.name!r} finished without yielding rows {missing[:10]} of its {n}"
            )

    def _publish(self, st: _Node, work: _Work, rows: list[int], outputs: Any) -> None:
        if not isinstance(outputs, Mapping):
            raise TypeError(
                f"node {st.name!r} returned {type(outputs).__name__}; return a dict of outputs"
            )
        outputs = dict(outputs)
        # Outputs with nothing per sample (metrics only) are fine; per-sample ones must match.
        got = (
            batch_size(outputs, where=f"node {st.name!r}: outputs")
            if any(_per_sample(v) for v in outputs.values())
            else len(rows)
        )
        if got != len(rows):
            raise ValueError(
                f"node {st.name!r} returned outputs for {got} samples, expected {len(rows)}"
            )
        by_root: dict[int, tuple[_Root, list[int], list[int]]] = {}
        for pos, r in enumerate(rows):
            root, row = work.origin[r]
            by_root.setdefault(root.id, (root, [], []))
            by_root[root.id][1].append(pos)
            by_root[root.id][2].append(row)
        for root, positions, root_rows in by_root.values():
            if root.failed is not None:
                continue
            whole = len(positions) == len(rows)
            chunk_out = outputs if whole else take(outputs, positions)
            chunk_in = (
                take(work.inputs, [rows[p] for p in positions], st.shared)
                if self._subscribers.get(st.name) or any(link.carry for link in st.downstream)
                else {}
            )
            chunk = Chunk(st.name, root.id, root_rows, chunk_out, chunk_in)
            for cb in self._subscribers.get(st.name, ()):
                cb(chunk)
            if st.name in root.futures:
                self._gather(st, root, chunk)
            for link in st.downstream:
                self._forward(st, link, chunk, root)

    def _forward(self, st: _Node, link: _Link, chunk: Chunk, root: _Root) -> None:
        dst = self._nodes[link.dst]
        try:
            ports = link.ports or {p: p for p in chunk.outputs}
            inputs = {d: chunk.outputs[s] for s, d in ports.items()}
            inputs.update({d: chunk.inputs[s] for s, d in link.carry.items()})
            inputs.update(link.constants)
            costs = sample_costs(inputs, dst.cost, where=f"node {dst.name!r}")
        except KeyError as exc:
            raise ValueError(
                f"connect {st.name!r} -> {dst.name!r}: port {exc} is not among "
                f"{st.name!r}'s outputs {sorted(chunk.outputs)} / inputs {sorted(chunk.inputs)}"
            ) from None
        with self._cond:
            self._enqueue(dst, _Request(root, chunk.rows, inputs, costs, time.monotonic()))

    def _gather(self, st: _Node, root: _Root, chunk: Chunk) -> None:
        with self._cond:
            root.chunks[st.name].append((chunk.rows, chunk.outputs))
            root.count[st.name] += len(chunk.rows)
            if root.count[st.name] < root.size:
                return
            chunks = root.chunks.pop(st.name, None)
        if chunks is None:
            return
        try:
            merged = _merge_outputs(chunks, st)
        except Exception as exc:
            self._fail_root(
                root,
                SchedulerError(
                    f"node {st.name!r}: could not reassemble request {root.id}: {exc}", st.name
                ),
            )
            return
        fut = root.futures[st.name]
        if not fut.done():
            fut.set_result(merged)
        if all(f.done() for f in root.futures.values()):
            with self._cond:
                self._live.pop(root.id, None)


def summary_text(summary: Mapping[str, Any]) -> str:
    """A :meth:`Scheduler.summary` as a short table, for the CLI and logs."""
    lines = [f"scheduler ({summary.get('placement', '?')}), window {summary['window_s']:.2f} s"]
    for name, d in summary["devices"].items():
        lines.append(
            f"  {name:8s} busy {d['busy_s']:7.2f} s  switch {d['switch_s']:6.2f} s  "
            f"idle {d['idle_s']:7.2f} s  utilization {d['utilization']:5.1%}  calls {d['calls']}"
        )
    for name, n in summary.get("nodes", {}).items():
        lines.append(
            f"  {name:12s} {n['samples']} samples in {n['batches']} batches / {n['calls']} calls; "
            f"queue wait mean {n['mean_queue_wait_s'] * 1e3:.1f} ms, max "
            f"{n['max_queue_wait_s'] * 1e3:.1f} ms"
        )
    return "\n".join(lines)


def _oldest(nodes: list[_Node]) -> _Node:
    return min(nodes, key=lambda st: min(st.ready[0].arrivals))


def _merge_outputs(chunks: list[tuple[list[int], Batch]], st: _Node) -> Batch:
    """Reassemble chunks in request order; a non-per-sample output is kept once if all chunks
    agree, else as the list of the chunks' values."""
    outs = [o for _, o in chunks]
    ports = list(outs[0])
    shared = {p for p in ports if not _per_sample(outs[0][p])}
    extra: Batch = {}
    for p in shared:
        values = [o[p] for o in outs]
        try:
            same = all(v is values[0] or bool(v == values[0]) for v in values)
        except Exception:
            same = False
        extra[p] = values[0] if same else values
    batched = [{p: o[p] for p in ports if p not in shared} for o in outs]
    if not batched[0]:
        return extra
    merged = merge(batched, [rows for rows, _ in chunks], (), st.pad_values, st.left_pad)
    return {p: merged[p] if p in merged else extra[p] for p in ports}


def _per_sample(value: Any) -> bool:
    import torch

    return isinstance(value, list | tuple) or (isinstance(value, torch.Tensor) and value.dim() > 0)
