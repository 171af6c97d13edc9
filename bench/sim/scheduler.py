"""The dynamic batching scheduler: per-node queues, fusing by BatchPolicy, splitting across
devices, and streaming finished samples downstream.

::

    pool = SlotPool.detect(cpu_slots=2)
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

Placement (:mod:`bench.sim.placement`) says which devices serve which node, and the cost of
switching a device between nodes. The :meth:`Scheduler.summary` dict holds per-device busy,
switch and idle time and per-node queue waits.

The code follows those roles: this module is the public API (declaring, starting, submitting,
accounting); :mod:`bench.sim.dispatch` queues, fuses and splits (steps 1 to 3);
:mod:`bench.sim.workers` runs micro-batches on devices, streams and gathers (4 and 5);
:mod:`bench.sim.requests` holds the values they pass around.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from bench.sim.dispatch import _Dispatch
from bench.sim.placement import Placement
from bench.sim.requests import (
    Chunk,
    NodeFn,
    SchedulerError,
    Ticket,
    _Link,
    _Node,
    _Request,
    _Root,
)
from bench.sim.workers import _Workers
from runtime.sched.batching import CostFn, batch_size, sample_costs
from runtime.sched.devices import Slot, SlotPool
from yatt_graph import BatchPolicy

__all__ = ["Chunk", "NodeFn", "Scheduler", "SchedulerError", "Ticket", "summary_text"]


class Scheduler(_Dispatch, _Workers):
    """Queues per node, fusing by BatchPolicy, splitting across devices, streaming.

    ``placement`` assigns nodes to device groups (default: every node on every device);
    ``partition`` is ``"kk"`` (Karmarkar-Karp) or ``"lpt"``; ``threads_per_worker`` sets
    ``torch.set_num_threads`` in each CPU worker (None leaves it); ``on_switch(device, old,
    new)`` runs, timed as switch time, whenever a device changes node (offload/reload).
    """

    def __init__(
        self,
        pool: SlotPool,
        placement: Placement | None = None,
        partition: str = "kk",
        threads_per_worker: int | None = 1,
        on_switch: Callable[[Slot, str, str], None] | None = None,
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


def summary_text(summary: Mapping[str, Any]) -> str:
    """A :meth:`Scheduler.summary` as a short table, for the CLI and logs."""
    lines = [f"scheduler ({summary.get('placement', '?')}), window {summary['window_s']:.2f} s"]
    for name, d in summary["slots"].items():
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
