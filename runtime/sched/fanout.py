"""One node call fanned out over workers: cut by cost into pieces, each piece run by whichever
worker is free next, the outputs joined back in the batch's order.

This is the one layer through which an executor (in-process or a controller) calls a node on
more than one worker. A node fans out one of two ways:

* **Slots** (``--slots N``, ``RunConfig.slots``): the node's call runs on N worker threads
  over the executor's own node, one per CPU slot of its
  :class:`~runtime.sched.devices.SlotPool` (torch releases the GIL in its kernels, so with one
  torch thread per controller N slots use N cores). A node fans out over slots when it
  declares a per-call budget (``BatchPolicy.max_batch_size`` or ``max_tokens`` > 0: a promise
  that it may be called on any part of a batch), its ``BatchPolicy.splittable`` is true (nodes
  whose result depends on the whole batch, such as advantage whitening, group baselines, an
  optimizer step or a sampler with one random stream per call, say False) and it has inputs:
  in the node library the vision encoder, the rewards, the reference and the critic. All such
  nodes of an executor share the slots' threads, so a slot runs one call at a time.
* **Replicas** (``BatchPolicy(replicas=R)``, ``--replicas NODE=R``): the executor's own node and
  R-1 replica processes (:mod:`runtime.zmq.replicas`), each pinned to a core of its own (or a
  GPU). A replica process gets a weight update once per version.

For each call:

1. **Cut.** Ports that hold one entry per sample are read from the port specs and the values
   (a tensor port with no dimensions or a fixed first one is shared by all samples, as is any
   value that is not a tensor or list). A call whose per-sample values disagree in length
   (per-prompt inputs next to per-response ones) runs whole. The samples are cut by predicted
   cost with Karmarkar-Karp (:func:`~runtime.sched.batching.cut_pieces`) into at least one
   piece per worker (:class:`Fanout`'s ``pieces_per_worker``), each within the node's budget.
   The cost of a prompt is its length in tokens (about 4 characters each) plus the mean response
   seen so far times ``rows_per_input``; of anything else,
   :func:`~runtime.sched.batching.default_costs`.
2. **Run.** The pieces wait in one queue, heaviest first; each worker takes the next one when
   it is free, so a worker that finishes early takes more (work stealing for the long tail).
3. **Join.** Outputs are put back in the batch's order, ragged tensors padded with the node's
   pad values (on the left for ``left_padded`` ports). A node that makes several output rows per
   input row (the rollout's ``n`` samples per prompt) gets them back grouped as a whole call
   would give them.

A node whose state depends on the call (the rollout's seed and group labels) says so with
``piece_context()`` / ``begin_piece(context, rows)`` / ``end_piece()`` /
``end_pieces(context, size)``: every piece is seeded from the step and its first row, so a
step's samples do not depend on which worker ran which piece, and the node's counters move
once per step.

The cut is a pure function of the batch, the costs seen so far and the worker count, so two
runs with the same settings cut alike (a ZeroMQ run equals the in-process one). Nodes with no
randomness give a whole call's values up to float rounding (smaller matmuls); a replicated
rollout's *sampled* tokens differ from a one-copy run (a piece has its own random stream), its
greedy tokens do not, and the same piece gives the same tokens on any worker.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from runtime.errors import ProcessFault
from runtime.sched.batching import _is_batched, cut_pieces, join_outputs, sample_costs, take
from runtime.sched.devices import Slot, SlotPool
from yatt_graph.types import TensorSpec

__all__ = [
    "THREAD_PREFIX",
    "Crew",
    "Fanout",
    "Fanouts",
    "NodeThread",
    "Worker",
    "slot_pool",
    "replica_counts",
    "replicable",
    "run_with_context",
    "shared_ports",
    "start_fanouts",
]


THREAD_PREFIX = "yatt-worker "
"""How a crew's threads are named (a hang's report shows their stacks)."""


class Worker(Protocol):
    """What runs pieces: a thread over the executor's own node, or a replica process."""

    label: str
    """Its name in summaries and errors (``cpu:0``, ``local``, ``process 1 (pid 123)``)."""

    def call(
        self, node: Any, inputs: dict[str, Any], context: Mapping[str, int] | None, rows: list[int]
    ) -> dict[str, Any]: ...

    def close(self) -> None: ...


def slot_pool(slots: int | str | SlotPool | None) -> SlotPool | None:
    """``None``/0: no slots; an int: that many CPU slots; ``"auto"``: ``$YATT_CPU_SLOTS`` or the
    usable cores; a SlotPool as it is (CPU only: a slot is a thread over one copy of the
    model, and CUDA devices would each need their own copy: replicas)."""
    if slots is None or slots == 0:
        return None
    if isinstance(slots, SlotPool):
        pool = slots
    elif slots == "auto":
        pool = SlotPool.detect(kind="cpu")
    elif isinstance(slots, int) and not isinstance(slots, bool) and slots > 0:
        pool = SlotPool.cpu(slots)
    else:
        raise ValueError(
            f"slots must be None, a positive int (CPU slots), 'auto' or a SlotPool, got {slots!r}"
        )
    if any(d.kind != "cpu" for d in pool):
        raise ValueError(
            f"slots={pool}: slots are threads over one copy of a node's model, so they are CPU "
            "only; give a node replicas (one per GPU), or place nodes on GPUs through the plan"
        )
    return pool


def shared_ports(node: Any) -> frozenset[str]:
    """Input ports of ``node`` that never hold one entry per sample: tensor ports with no
    dimensions or a fixed first dimension."""
    return frozenset(
        name
        for name, port in node.inputs.items()
        if isinstance(port.spec, TensorSpec)
        and (not port.spec.shape or isinstance(port.spec.shape[0], int))
    )


def _splittable(node: Any) -> bool:
    policy = node.batch_policy
    return bool(policy.splittable and (policy.max_batch_size or policy.max_tokens) and node.inputs)


def replicable(node: Any) -> str | None:
    """Why ``node`` cannot have replicas, or None: it must have inputs and either run pieces of
    a step as the step's own (``piece_context()``: the rollout) or fan out over slots. Updates
    (an optimizer step on the whole batch) cannot."""
    if not node.inputs:
        return "it has no inputs to cut"
    if node.piece_context() is not None:
        if node.streaming:
            return "it streams (stream=True); a replicated rollout returns whole pieces"
        return None
    if _splittable(node):
        return None
    return (
        "its result depends on the whole batch (BatchPolicy.splittable is False or it sets no "
        "max_batch_size/max_tokens): updates and batch statistics run as one copy"
    )


def replica_counts(nodes: Mapping[str, Any], override: Mapping[str, int] | None) -> dict[str, int]:
    """Replicas per node: each node's ``BatchPolicy.replicas``, then ``override`` (the run's
    ``--replicas``); only nodes with more than one. Unknown or unreplicable nodes raise."""
    counts = {name: n.batch_policy.replicas for name, n in nodes.items()}
    for name, r in (override or {}).items():
        if name not in nodes:
            raise ValueError(f"no node {name!r} in the graph; its nodes: {sorted(nodes)}")
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"replicas: {name}={r!r}; give a whole number >= 1")
        counts[name] = r
    for name, r in counts.items():
        if r > 1 and (why := replicable(nodes[name])):
            raise ValueError(f"node {name!r} cannot have {r} replicas: {why}")
    return {name: r for name, r in counts.items() if r > 1}


class NodeThread:
    """A worker in this process: runs the node it is given on the crew's thread, with
    ``threads`` torch threads (None: as the process has), counted busy on a pool's slot."""

    def __init__(
        self,
        label: str,
        threads: int | None = None,
        pool: SlotPool | None = None,
        slot: Slot | None = None,
    ):
        self.label, self.threads, self.pool, self.slot = label, threads, pool, slot
        self._thread: int | None = None

    def call(
        self, node: Any, inputs: dict[str, Any], context: Mapping[str, int] | None, rows: list[int]
    ) -> dict[str, Any]:
        if self.threads and self._thread != threading.get_ident():
            import torch

            torch.set_num_threads(self.threads)  # per thread (OpenMP)
            self._thread = threading.get_ident()
        if self.pool is not None and self.slot is not None:
            with self.pool.busy(self.slot, node.name):
                return run_with_context(node, inputs, context, rows)
        return run_with_context(node, inputs, context, rows)

    def close(self) -> None:
        pass


def run_with_context(
    node: Any, inputs: dict[str, Any], context: Mapping[str, int] | None, rows: list[int]
) -> dict[str, Any]:
    """``node.run(inputs)`` on a piece: inside ``begin_piece(context, rows)`` /
    ``end_piece()`` when the node has a piece context (a thread's or a replica's piece)."""
    if context is None:
        return node.run(inputs)
    node.begin_piece(context, rows)
    try:
        return node.run(inputs)
    finally:
        node.end_piece()


class Crew:
    """Workers, a thread each (named for it), over one queue of pieces; each worker takes the
    next piece when it is free. A worker whose process is lost (a
    :class:`~runtime.errors.ProcessFault`: a replica that exited or stopped answering) is
    named on stderr and leaves the crew, and the piece it held goes back to the queue for the
    others; the crew's pieces fail with that error only when no worker is left."""

    def __init__(self, workers: Sequence[Worker]):
        if not workers:
            raise ValueError("a crew needs at least one worker")
        self.workers = list(workers)
        self.stats = {w.label: {"busy_s": 0.0, "pieces": 0, "samples": 0} for w in self.workers}
        self.lost: dict[str, str] = {}
        """The workers that left the crew, by label: why."""
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = len(self.workers)
        self._last_loss: BaseException | None = None
        self._threads = [
            threading.Thread(
                target=self._work, args=(w,), name=f"{THREAD_PREFIX}{w.label}", daemon=True
            )
            for w in self.workers
        ]
        for t in self._threads:
            t.start()

    def submit(
        self, node: Any, inputs: dict[str, Any], context: Mapping[str, int] | None, rows: list[int]
    ) -> Future:
        job: Future = Future()
        with self._lock:
            if not self._live:  # every worker is lost
                job.set_exception(self._last_loss or RuntimeError("the crew has no workers"))
                return job
            self._jobs.put((node, inputs, context, rows, job))
        return job

    def _work(self, worker: Worker) -> None:
        while (item := self._jobs.get()) is not None:
            node, inputs, context, rows, job = item
            start = time.perf_counter()
            job.worker = worker.label  # which worker ran the piece (Fanout.last_workers)
            try:
                job.set_result(worker.call(node, inputs, context, rows))
            except BaseException as exc:  # the caller raises it, unless the worker is lost
                if isinstance(exc, ProcessFault) and not isinstance(worker, NodeThread):
                    self._leave(worker, exc, item)
                    return
                job.set_exception(exc)
            st = self.stats[worker.label]
            st["busy_s"] += time.perf_counter() - start
            st["pieces"] += 1
            st["samples"] += len(rows)

    def _leave(self, worker: Worker, exc: BaseException, item: Any) -> None:
        """``worker``'s process is lost: it leaves, and its piece goes to the others."""
        with self._lock:
            self._live -= 1
            self.lost[worker.label] = str(exc)
            self._last_loss = exc
            left = self._live
            if left:
                self._jobs.put(item)
            else:  # nobody is left to run this piece or the ones still queued
                item[-1].set_exception(exc)
                while True:
                    try:
                        queued = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if queued is not None:
                        queued[-1].set_exception(exc)
                    else:
                        self._jobs.put(None)  # (a close: the threads have left)
                        break
        if left:
            print(
                f"yatt-graph: {exc}\nyatt-graph: its pieces go to the node's {left} other "
                f"{'copy' if left == 1 else 'copies'}; the run goes on",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        """End the threads once the pieces they run return, then the workers."""
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=30)
        self._threads = []
        for w in self.workers:
            w.close()


class Fanout:
    """One node's calls over a crew, ``pieces_per_worker`` pieces per worker at least."""

    def __init__(self, node: Any, crew: Crew, kind: str, pieces_per_worker: int = 1):
        if pieces_per_worker < 1:
            raise ValueError(f"pieces per worker must be >= 1, got {pieces_per_worker}")
        self.node, self.crew, self.kind = node, crew, kind
        self.pieces = len(crew.workers) * pieces_per_worker
        self.shared = shared_ports(node)
        self.calls = self.samples = 0
        self._mean_response: float | None = None
        self.last_workers: list[int] = []
        """Per input row of the last call, the index in the crew of the worker that ran it
        (0: the executor's own node); empty where the call ran whole."""

    def call(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        inputs = dict(inputs)
        self.last_workers = []
        per = {p for p, v in inputs.items() if p not in self.shared and _is_batched(v)}
        sizes = {len(inputs[p]) for p in per}
        if len(sizes) != 1:  # nothing per sample, or lengths disagree: the node runs it whole
            return self.node.run(inputs)
        (size,) = sizes
        if not size:
            return self.node.run(inputs)
        policy = self.node.batch_policy
        costs = self.costs(inputs)
        cut = cut_pieces(costs, self.pieces, policy.max_batch_size, policy.max_tokens)
        parts = [sorted(p) for p in cut]  # a piece's first row seeds it (piece_context)
        context = self.node.piece_context()
        shared = set(inputs) - per
        jobs = [
            self.crew.submit(self.node, take(inputs, p, shared) if len(parts) > 1 else inputs, context, p)
            for p in parts
        ]  # fmt: skip
        outs, errors = [], []
        for job in jobs:  # every piece ends first, so nothing is left running on a failure
            try:
                outs.append(job.result())
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        self.calls += len(parts)
        self.samples += size
        index = {w.label: i for i, w in enumerate(self.crew.workers)}
        self.last_workers = [0] * size
        for job, part in zip(jobs, parts):
            for row in part:
                self.last_workers[row] = index.get(getattr(job, "worker", None), 0)
        merged = outs[0] if len(parts) == 1 else self._join(outs, parts)
        if context is not None:
            self.node.end_pieces(context, size)
        lengths = merged.get("response_lengths")
        if lengths is not None and len(lengths):
            self._mean_response = float(lengths.float().mean())
        return merged if len(parts) == 1 else self.node._check_outputs(merged, None)

    def costs(self, inputs: Mapping[str, Any]) -> list[float]:
        """Predicted cost per sample (see the module doc)."""
        prompts = inputs.get("prompts")
        if isinstance(prompts, list | tuple) and all(isinstance(p, str) for p in prompts):
            tail = self.node.rows_per_input * (self._mean_response or 0.0)
            return [len(p) / 4 + tail for p in prompts]
        return sample_costs(inputs, where=f"node {self.node.name!r}")

    def _join(self, outs: list[Any], parts: list[list[int]]) -> dict[str, Any]:
        where = f"node {self.node.name!r}"
        per = {p for p, v in outs[0].items() if _is_batched(v)}
        if not per:  # nothing per sample came back (metrics only): the first piece's values
            return dict(outs[0])
        expand = None
        rows: list[list[int]] = []
        for out, part in zip(outs, parts):
            got = {len(out[p]) for p in per}
            if len(got) != 1 or next(iter(got)) % len(part):
                raise ValueError(
                    f"{where}: a piece of {len(part)} samples returned outputs of lengths "
                    f"{sorted(got)}; a node that fans out must return a whole number of rows "
                    "per input sample"
                )
            e = next(iter(got)) // len(part)
            if expand is not None and e != expand:
                raise ValueError(f"{where}: pieces returned {expand} and {e} rows per sample")
            expand = e
            rows.append([i * e + j for i in part for j in range(e)])
        return join_outputs(outs, rows, self.node.pad_values(), self.node.left_padded)

    def summary(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "workers": [w.label for w in self.crew.workers],
            "pieces": self.calls,
            "samples": self.samples,
            "by_worker": {k: dict(v) for k, v in self.crew.stats.items()},
            "lost": dict(self.crew.lost),
        }


class Fanouts:
    """The :class:`Fanout` of each node of a process whose calls are cut across workers (the
    executor runs the others whole: :func:`runtime.engine.calls.run_node`)."""

    def __init__(self, fanouts: Mapping[str, Fanout], pool: Any = None):
        self.fanouts, self.pool = dict(fanouts), pool

    @property
    def split_nodes(self) -> list[str]:
        """The nodes whose calls may be cut."""
        return sorted(self.fanouts)

    def fans_out(self, name: str) -> bool:
        """Whether calls of ``name`` are cut across workers."""
        return name in self.fanouts

    def call(self, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
        """A call of ``name``, one that :meth:`fans_out`, cut across its workers."""
        return self.fanouts[name].call(inputs)

    def last_workers(self, name: str) -> list[int]:
        """Per input row of ``name``'s last call, the worker that ran it (:class:`Fanout`)."""
        fanout = self.fanouts.get(name)
        return list(fanout.last_workers) if fanout is not None else []

    def summary(self) -> dict[str, Any]:
        """The pool's per-slot busy/idle time and utilization, and per node its pieces."""
        out = self.pool.summary() if self.pool is not None else {}
        out["nodes"] = {name: f.summary() for name, f in self.fanouts.items()}
        return out

    def close(self) -> None:
        for crew in {id(f.crew): f.crew for f in self.fanouts.values()}.values():
            crew.close()
        self.fanouts = {}


def start_fanouts(
    nodes: Mapping[str, Any],
    pool: SlotPool | None,
    replicas: Mapping[str, int] | None = None,
    spawn: Callable[[Any, int, int], Worker] | None = None,
) -> Fanouts | None:
    """The fan-outs of ``nodes`` (None when no node fans out): slots over ``pool`` for the
    splittable nodes, replicas for those with ``replicas`` (replica 0 is the node itself,
    replica i a ``spawn(node, i, count)``: :func:`runtime.zmq.replicas.spawn_replica`)."""
    counts = replica_counts(nodes, replicas)
    if counts and spawn is None:
        raise ValueError(
            f"nodes {sorted(counts)} ask for replicas, but this executor was given no way to "
            "start replica processes"
        )
    fanouts: dict[str, Fanout] = {}
    try:
        for name, r in counts.items():
            workers: list[Worker] = [NodeThread("local", threads=1)]
            try:
                for i in range(1, r):
                    workers.append(spawn(nodes[name], i, r))  # type: ignore[misc]
            except BaseException:
                for w in workers:
                    w.close()
                raise
            fanouts[name] = Fanout(nodes[name], Crew(workers), "replicas")
        split = [n for n, node in nodes.items() if n not in counts and _splittable(node)]
        if pool is not None and split:
            crew = Crew([NodeThread(d.name, pool=pool, slot=d) for d in pool])
            fanouts.update({n: Fanout(nodes[n], crew, "slots") for n in split})
            pool.start()
    except BaseException:
        Fanouts(fanouts).close()
        raise
    return Fanouts(fanouts, pool) if fanouts else None
