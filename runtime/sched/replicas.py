"""Replicas of an inference node: a step's batch cut by cost across R copies of the node, each
piece run by whichever copy is free next, and the pieces joined back in the batch's order.

A node with ``BatchPolicy(replicas=R)`` (or ``yatt-graph run --replicas NODE=R``) runs as R
copies: the executor's own node (replica 0) and R-1 replica processes
(:mod:`runtime.zmq.replicas`), each pinned to cores of its own (or a GPU). For each call:

1. **Cut.** The per-sample inputs (the ports whose values hold one entry per sample) are
   partitioned by predicted cost with Karmarkar-Karp into ``pieces_per_replica * R`` pieces
   (the costs: the rollout's prompt length plus the mean response length seen so far, times
   its samples per prompt; other nodes: :func:`~runtime.sched.batching.default_costs`).
   Shared inputs (weights, scalars) go with every piece; a replica process gets a weight
   update once per version.
2. **Run.** The pieces wait in one queue, heaviest first; each replica's worker thread takes
   the next one when its replica is free, so a replica that finishes early takes more (work
   stealing for the long tail).
3. **Join.** Outputs are put back in the batch's order (:func:`~runtime.sched.batching.merge`,
   ragged tensors padded with the node's pad values, on the left for ``left_padded`` ports).
   A node that makes several output rows per input row (the rollout's ``n`` samples per
   prompt) gets its rows back grouped as a whole-batch call would give them.

A node with state that depends on the call (the rollout's seed and group labels) says so
with ``piece_context()`` / ``begin_piece(context, rows)`` / ``end_piece()`` /
``end_pieces(context, size)``: every piece is seeded from the step and its first row, so the
samples of a step do not depend on which replica ran which piece, and the node's counters
move once per step. The cut is a pure function of the batch, the costs seen so far and R.

What equals a plain run: nodes with no randomness (the vision encoder, rewards, reference,
critic) give the plain run's values up to float rounding (smaller matmuls). The rollout's
*sampled* tokens differ from a one-copy run (a piece has its own random stream), while its
greedy tokens are the same; either way the same piece gives the same tokens on any replica.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from runtime.sched.batching import _is_batched, default_costs, join_outputs, take
from yatt_graph.partition import partition

__all__ = [
    "CallRouter",
    "LocalReplica",
    "Replica",
    "ReplicaSet",
    "build_replica_sets",
    "node_caller",
    "replica_counts",
    "replicable",
]


class Replica(Protocol):
    """One copy of a node that runs pieces: the executor's own node or a replica process."""

    label: str
    """Its name in summaries and errors (``local``, ``process 1 (pid 123)``)."""

    def call(
        self, inputs: dict[str, Any], context: Mapping[str, int] | None, rows: list[int]
    ) -> dict[str, Any]: ...

    def close(self) -> None: ...


def replicable(node: Any) -> str | None:
    """Why ``node`` cannot have replicas, or None: it must have inputs and either run pieces
    of a step as the step's own (``piece_context()``: the rollout) or be splittable with a per-call
    budget (vision, rewards, reference, critic). Updates (an optimizer step on the whole
    batch) cannot."""
    policy = node.batch_policy
    if not node.inputs:
        return "it has no inputs to cut"
    if node.piece_context() is not None:
        if node.streaming:
            return "it streams (stream=True); a replicated rollout returns whole pieces"
        return None
    if policy.splittable and (policy.max_batch_size or policy.max_tokens):
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


class LocalReplica:
    """The executor's own node as replica 0; its worker thread computes on ``threads``
    torch threads."""

    def __init__(self, node: Any, threads: int | None = 1):
        self.node, self.threads, self.label = node, threads, "local"
        self._thread: int | None = None

    def call(
        self, inputs: dict[str, Any], context: Mapping[str, int] | None, rows: list[int]
    ) -> dict[str, Any]:
        if self.threads and self._thread != threading.get_ident():
            import torch

            torch.set_num_threads(self.threads)  # per thread (OpenMP), as the scheduler's workers
            self._thread = threading.get_ident()
        if context is None:
            return self.node.run(inputs)
        self.node.begin_piece(context, rows)
        try:
            return self.node.run(inputs)
        finally:
            self.node.end_piece()

    def close(self) -> None:
        pass


class ReplicaSet:
    """The R copies of one node and the cut/run/join of each call (see the module doc)."""

    def __init__(
        self,
        node: Any,
        replicas: Sequence[Replica],
        pieces_per_replica: int = 1,
        method: str = "kk",
    ):
        if not replicas:
            raise ValueError(f"node {node.name!r}: a ReplicaSet needs at least one replica")
        if pieces_per_replica < 1:
            raise ValueError(f"pieces_per_replica must be >= 1, got {pieces_per_replica}")
        self.node, self.replicas = node, list(replicas)
        self.pieces_per_replica, self.method = pieces_per_replica, method
        self.stats = {r.label: {"busy_s": 0.0, "pieces": 0, "samples": 0} for r in self.replicas}
        self._mean_response: float | None = None
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._workers = [
            threading.Thread(target=self._work, args=(r,), daemon=True, name=f"replica-{r.label}")
            for r in self.replicas
        ]
        for t in self._workers:
            t.start()

    # --- one call ------------------------------------------------------------------------------
    def call(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        inputs = dict(inputs)
        per = {p for p, v in inputs.items() if _is_batched(v)}
        sizes = {len(inputs[p]) for p in per}
        if len(sizes) != 1:  # nothing per sample, or lengths disagree: one copy runs it whole
            return self.replicas[0].call(inputs, None, [])
        (size,) = sizes
        shared = set(inputs) - per
        costs = self.costs(inputs, size)
        k = min(size, self.pieces_per_replica * len(self.replicas))
        parts = [sorted(p) for p in partition(costs, k, self.method) if p]
        parts.sort(key=lambda p: (-sum(costs[i] for i in p), p[0]))  # heaviest first
        context = self.node.piece_context()
        results: queue.Queue[tuple[int, Any, BaseException | None]] = queue.Queue()
        for j, part in enumerate(parts):
            self._jobs.put((j, take(inputs, part, shared), context, part, results))
        outs: list[Any] = [None] * len(parts)
        errors: list[BaseException] = []
        for _ in parts:  # every piece reports, so nothing is left running on a failure
            j, out, exc = results.get()
            outs[j] = out
            if exc is not None:
                errors.append(exc)
        if errors:
            raise errors[0]
        merged = self._join(outs, parts, size)
        if context is not None:
            self.node.end_pieces(context, size)
        self._learn(merged, size)
        return merged

    def costs(self, inputs: Mapping[str, Any], size: int) -> list[float]:
        """Predicted cost per sample: for prompts, their length in tokens (about 4 characters
        each) plus the mean response seen so far times the samples per prompt."""
        prompts = inputs.get("prompts")
        if isinstance(prompts, list | tuple) and all(isinstance(p, str) for p in prompts):
            n = self.node.rows_per_input
            tail = n * (self._mean_response or 0.0)
            return [len(p) / 4 + tail for p in prompts]
        try:
            return default_costs(inputs)
        except ValueError:
            return [1.0] * size

    def _learn(self, outputs: Mapping[str, Any], size: int) -> None:
        lengths = outputs.get("response_lengths")
        if lengths is not None and len(lengths):
            self._mean_response = float(lengths.float().mean())

    def _join(self, outs: list[Any], parts: list[list[int]], size: int) -> dict[str, Any]:
        where = f"node {self.node.name!r}"
        first = outs[0]
        per = {p for p, v in first.items() if _is_batched(v)}
        if not per:  # nothing per sample came back (metrics only): the pieces' values, kept once
            return dict(first)
        expand = None
        rows: list[list[int]] = []
        for out, part in zip(outs, parts):
            got = {len(out[p]) for p in per}
            if len(got) != 1 or next(iter(got)) % len(part):
                raise ValueError(
                    f"{where}: a piece of {len(part)} samples returned outputs of lengths "
                    f"{sorted(got)}; a replicated node must return a whole number of rows per "
                    "input sample"
                )
            e = next(iter(got)) // len(part)
            if expand is not None and e != expand:
                raise ValueError(f"{where}: pieces returned {expand} and {e} rows per sample")
            expand = e
            rows.append([i * e + j for i in part for j in range(e)])
        return join_outputs(outs, rows, self.node.pad_values(), self.node.left_padded)

    # --- the workers ---------------------------------------------------------------------------
    def _work(self, replica: Replica) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            j, inputs, context, part, results = job
            start = time.perf_counter()
            try:
                out, exc = replica.call(inputs, context, part), None
            except BaseException as e:  # reported to the caller, who raises it
                out, exc = None, e
            st = self.stats[replica.label]
            st["busy_s"] += time.perf_counter() - start
            st["pieces"] += 1
            st["samples"] += len(part)
            results.put((j, out, exc))

    def summary(self) -> dict[str, Any]:
        return {
            "replicas": len(self.replicas),
            "by_replica": {k: dict(v) for k, v in self.stats.items()},
        }

    def close(self) -> None:
        for _ in self._workers:
            self._jobs.put(None)
        for t in self._workers:
            t.join(timeout=30)
        for r in self.replicas:
            r.close()


def build_replica_sets(
    nodes: Mapping[str, Any],
    override: Mapping[str, int] | None,
    spawn: Callable[[Any, int, int], Replica] | None,
    pieces_per_replica: int = 1,
) -> dict[str, ReplicaSet]:
    """A ReplicaSet for each node of ``nodes`` with replicas: replica 0 is the node itself,
    replica i a ``spawn(node, i, count)`` (a process: :func:`runtime.zmq.replicas.spawn_replica`)."""
    counts = replica_counts(nodes, override)
    if counts and spawn is None:
        raise ValueError(
            f"nodes {sorted(counts)} ask for replicas, but this executor was given no way to "
            "start replica processes (replica_factory)"
        )
    sets: dict[str, ReplicaSet] = {}
    started: list[Replica] = []
    try:
        for name, r in counts.items():
            node = nodes[name]
            copies: list[Replica] = [LocalReplica(node)]
            for i in range(1, r):
                copies.append(spawn(node, i, r))  # type: ignore[misc]
                started.append(copies[-1])
            sets[name] = ReplicaSet(node, copies, pieces_per_replica)
    except BaseException:
        for s in sets.values():
            s.close()
        for rep in started:
            rep.close()
        raise
    return sets


class CallRouter:
    """What an executor calls nodes through: replicated nodes go to their ReplicaSet, nodes the
    splitter cuts to the :class:`~runtime.sched.splitting.NodeSplitter`, the rest run whole."""

    def __init__(self, nodes: Mapping[str, Any], splitter: Any, sets: Mapping[str, ReplicaSet]):
        self.nodes, self.splitter, self.sets = dict(nodes), splitter, dict(sets)

    @property
    def split_nodes(self) -> list[str]:
        own = self.splitter.split_nodes if self.splitter is not None else []
        return sorted({*own, *self.sets})

    def call(self, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
        rs = self.sets.get(name)
        if rs is not None:
            return self.nodes[name]._check_outputs(rs.call(inputs), None)
        if self.splitter is not None:
            return self.splitter.call(name, inputs)
        return self.nodes[name].run(inputs)

    def summary(self) -> dict[str, Any]:
        out = dict(self.splitter.summary()) if self.splitter is not None else {}
        if self.sets:
            out["replicas"] = {name: rs.summary() for name, rs in self.sets.items()}
        return out

    def close(self) -> None:
        if self.splitter is not None:
            self.splitter.close()
        for rs in self.sets.values():
            rs.close()
        self.sets = {}


def node_caller(
    nodes: Mapping[str, Any],
    pool: Any,
    replicas: Mapping[str, int] | None = None,
    spawn: Callable[[Any, int, int], Replica] | None = None,
) -> Any:
    """What an executor calls its nodes through (None: ``node.run``): a NodeSplitter for a
    device pool, wrapped in a :class:`CallRouter` when nodes have replicas."""
    from runtime.sched.splitting import NodeSplitter

    splitter = NodeSplitter(nodes, pool) if pool is not None else None
    try:
        sets = build_replica_sets(nodes, replicas, spawn)
    except BaseException:
        if splitter is not None:
            splitter.close()
        raise
    return CallRouter(nodes, splitter, sets) if sets else splitter
