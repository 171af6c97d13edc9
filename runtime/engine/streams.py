"""Streaming between nodes in the executors: a consumer starts on the first finished samples.

A streaming node (one that defines ``forward_stream``, :mod:`yatt_graph.stream`) yields its
outputs in pieces as samples finish. In both executors the step engine's :class:`StreamFeeder`
hands them to its direct consumers, which work in one of two modes, chosen by the same rule
in every process (so that a ZeroMQ run equals the in-process one):

* **per piece**, when the consumer may be called on any part of a batch (it declares a
  per-call budget, ``BatchPolicy.max_batch_size`` or ``max_tokens``, and is
  ``splittable``: the rule of :mod:`runtime.sched.fanout`), it reads exactly one streaming
  node through non-delayed edges, and each of its other inputs is shared by all samples
  (``None``, not a tensor or list, or a port that :func:`~runtime.sched.fanout.shared_ports`
  names) or, when the stream says its batch size B, holds one entry per sample of that
  batch (length B: it is taken row by row with each piece, as splitting would). Each call
  takes the pieces queued for it, in the order they were produced, fused into one
  (:func:`~yatt_graph.stream.fuse_pieces`) up to its ``max_batch_size`` samples and
  ``max_tokens`` (the scheduler's default costs of the pieces), waiting for more at most
  ``BatchPolicy.max_queue_delay_s`` (0: it takes what is there) unless the budget is full or
  the stream has ended; its calls' pieces are joined into its outputs for the nodes after
  it. On another controller this overlaps the producer: while controller A is still
  generating, controller B already scores what has finished.
* **whole**, otherwise: the pieces are joined first and the consumer runs once, as if the
  producer had not streamed.

Values that travel through delayed edges, and a streaming node's graph outputs, are the
joined pieces. Results differ from an unstreamed run only as splitting does (float rounding
of calls on fewer rows). Which pieces a call fuses depends on when they arrive: in process
the producer has finished before its consumer runs, so each call takes the most the budget
allows; on another controller a call takes what has crossed so far. A consumer that computes
each row alone (the rewards) gives the same values either way; a model forward (the
reference) may differ in the last bits, as splitting does.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.sched.batching import _is_batched, default_costs, take
from runtime.sched.fanout import _splittable, shared_ports
from yatt_graph import NodeExecutionError, NodeOutputError
from yatt_graph.stream import Piece, check_piece, fuse_pieces, join_pieces

__all__ = ["StreamBook", "StreamFeeder", "budget_full", "call_piece", "fusable", "per_piece"]


def _aligned(value: Any, size: int | None) -> bool:
    """A per-sample value of the stream's batch (one entry per row of B = ``size``)."""
    return size is not None and _is_batched(value) and len(value) == size


def per_piece(
    node: Any, stream_ports: Collection[str], inputs: Mapping[str, Any], size: int | None
) -> bool:
    """Whether ``node`` is called on the pieces of the stream that feeds ``stream_ports``;
    ``inputs`` are its other inputs, ``size`` the batch size the stream said (or None); see
    the module docstring."""
    if not _splittable(node):
        return False
    shared = shared_ports(node)
    return all(
        v is None or p in shared or not _is_batched(v) or _aligned(v, size)
        for p, v in inputs.items()
        if p not in stream_ports
    )


def _cost(piece: Piece) -> float:
    try:
        return sum(default_costs(piece.outputs))
    except Exception:  # outputs the default costs cannot read count one per sample
        return float(len(piece.rows))


def fusable(node: Any, queued: Sequence[Piece]) -> int:
    """How many of the ``queued`` pieces (in order) one call of ``node`` takes: the first,
    then more while the samples stay within ``max_batch_size`` and the cost within
    ``max_tokens`` (0: no limit)."""
    policy = node.batch_policy
    rows, cost = len(queued[0].rows), _cost(queued[0]) if policy.max_tokens else 0.0
    n = 1
    for p in queued[1:]:
        rows += len(p.rows)
        cost += _cost(p) if policy.max_tokens else 0.0
        if (policy.max_batch_size and rows > policy.max_batch_size) or (
            policy.max_tokens and cost > policy.max_tokens
        ):
            break
        n += 1
    return n


def budget_full(node: Any, queued: Sequence[Piece]) -> bool:
    """Whether the ``queued`` pieces fill one call of ``node`` (it need not wait for more)."""
    n = fusable(node, queued)
    if n < len(queued):
        return True
    policy = node.batch_policy
    rows = sum(len(p.rows) for p in queued)
    if policy.max_batch_size and rows >= policy.max_batch_size:
        return True
    return bool(policy.max_tokens) and sum(_cost(p) for p in queued) >= policy.max_tokens


def call_piece(
    call: Callable[[dict[str, Any]], dict[str, Any]],
    node: Any,
    inputs: Mapping[str, Any],
    ports: Mapping[str, str],
    piece: Piece,
    index: int,
    seen: set[int],
    step: int = 0,
    controller: int = 0,
    fused: int = 1,
) -> Piece:
    """One call of a consumer on a (fused) piece: ``ports`` maps its input ports to the producer's
    outputs, ``inputs`` are its other inputs (those of the stream's batch size are taken at
    the piece's rows). Returns the consumer's own piece (the same rows), checked; a consumer
    that does not return one entry per row gets a NodeExecutionError naming it and the step.
    ``piece`` may be ``fused`` pieces from ``index`` on."""
    shared = shared_ports(node)
    aligned = [
        p
        for p, v in inputs.items()
        if p not in ports and p not in shared and _aligned(v, piece.size)
    ]
    own = {**inputs, **take({p: inputs[p] for p in aligned}, piece.rows)}
    out = call({**own, **{dst: piece.outputs[src] for dst, src in ports.items()}})
    more = f" (fused with pieces {index + 1}..{index + fused - 1})" if fused > 1 else ""
    where = (
        f"node {node.name!r}, called on piece {index}{more} of a stream ({len(piece.rows)} rows)"
    )
    try:
        return check_piece(
            node.name,
            node.outputs,
            (piece.rows, out, piece.size),
            seen,
            index,
            where=where,
            size=piece.size,
        )
    except NodeOutputError as exc:
        message = (
            f"{exc} (at step {step} on controller {controller}); a node fed per piece must return "
            "one entry per row on every output, or say BatchPolicy(splittable=False) to be "
            "called once on the whole batch"
        )
        raise NodeExecutionError(node.name, message, step=step, controller=controller) from None


class _Stream:
    __slots__ = ("ends", "pieces", "size")

    def __init__(self) -> None:
        self.pieces: dict[str, dict[int, tuple[list[int], Any]]] = {}
        self.ends: dict[str, int] = {}
        self.size: int | None = None


class StreamBook:
    """The pieces of streamed outputs that reached one controller, by (step, producer, port).

    Pieces may arrive in any order across ports; a port's end marker carries its piece count.
    """

    def __init__(self) -> None:
        self._streams: dict[tuple[int, str], _Stream] = {}

    def __bool__(self) -> bool:
        return bool(self._streams)

    def has(self, step: int, src: str) -> bool:
        return (step, src) in self._streams

    def add(
        self,
        step: int,
        src: str,
        port: str,
        index: int,
        rows: list[int],
        value: Any,
        size: int | None = None,
    ) -> bool:
        """Keep a piece (``size``: the batch size the stream said); False (nothing kept) when
        that piece of that port is already here."""
        stream = self._streams.setdefault((step, src), _Stream())
        got = stream.pieces.setdefault(port, {})
        if index in got:
            return False
        got[index] = (rows, value)
        if size is not None:
            stream.size = size
        return True

    def size(self, step: int, src: str) -> int | None:
        """The batch size the stream said, once a piece of it is here."""
        s = self._streams.get((step, src))
        return s.size if s is not None else None

    def end(self, step: int, src: str, port: str, count: int) -> None:
        self._streams.setdefault((step, src), _Stream()).ends[port] = count

    def piece(self, step: int, src: str, index: int, ports: Collection[str]) -> Piece | None:
        """Piece ``index`` on all of ``ports`` (the producer's port names), once all are here."""
        s = self._streams.get((step, src))
        if s is None:
            return None
        values, rows = {}, None
        for port in ports:
            got = s.pieces.get(port, {}).get(index)
            if got is None:
                return None
            rows, values[port] = got
        return Piece(rows or [], values, s.size)

    def count(self, step: int, src: str, ports: Collection[str]) -> int | None:
        """The number of pieces once every one of ``ports`` has ended with all its pieces here."""
        s = self._streams.get((step, src))
        if s is None or any(p not in s.ends for p in ports):
            return None
        counts = {s.ends[p] for p in ports}
        if len(counts) != 1:
            raise ValueError(f"the ports of {src!r} at step {step} ended with {counts} pieces")
        n = counts.pop()
        if any(len(s.pieces.get(p, {})) != n for p in ports):
            return None
        return n

    def joined(self, step: int, src: str, port: str) -> Any:
        """The whole value of ``port`` (a complete stream)."""
        s = self._streams[(step, src)]
        got = s.pieces.get(port, {})
        pieces = [Piece(got[i][0], {port: got[i][1]}, s.size) for i in sorted(got)]
        return join_pieces(pieces, src)[port]

    def ports(self, step: int, src: str) -> set[str]:
        """The ports of the stream seen so far (with a piece or an end)."""
        s = self._streams.get((step, src))
        return set(s.pieces) | set(s.ends) if s is not None else set()

    def streams(self) -> list[tuple[int, str]]:
        return list(self._streams)

    def discard(self, step: int, src: str) -> None:
        self._streams.pop((step, src), None)


@dataclass
class _Consumer:
    """A node fed per piece of a stream at one step: what it has taken so far."""

    src: str
    ports: dict[str, str]
    """Its input port -> the producer's output port."""
    inputs: dict[str, Any]
    """Its other inputs."""
    next: int = 0
    seen: set[int] = field(default_factory=set)
    pieces: list[Piece] = field(default_factory=list)
    seconds: float = 0.0
    start: float = 0.0
    queued_at: float | None = None
    """When a piece was first seen waiting for this consumer (monotonic), while it waits."""

    @property
    def src_ports(self) -> set[str]:
        return set(self.ports.values())


class StreamFeeder:
    """The streams of one :class:`~runtime.engine.engine.StepEngine`: the pieces that reached it
    (``book``), the consumers it feeds per piece (``consumers``) and those it runs whole.

    Args:
        nodes, in_edges: the engine's nodes, and the edges into each, by name.
        pending, next_step: the engine's (shared) inputs that arrived by (step, node), where a
            consumer run whole gets its streams joined, and each node's next step.
        keep_delayed: ``(src, port, step, value)``: keep another process's joined stream for
            the delayed edges here; returns why it was dropped.
        read_delayed: ``(name, step)``: a node's inputs on delayed edges, read as it starts.
        here: this process's controller index (in error messages).
    """

    def __init__(
        self,
        nodes: Mapping[str, Any],
        in_edges: Mapping[str, Sequence[Any]],
        pending: dict[tuple[int, str], dict[str, Any]],
        next_step: Mapping[str, int],
        keep_delayed: Callable[[str, str, int, Any], list[str]],
        read_delayed: Callable[[str, int], dict[str, Any]],
        here: int = 0,
    ):
        self.nodes, self.in_edges, self.here = nodes, in_edges, here
        self.pending, self.next_step = pending, next_step
        self.keep_delayed, self.read_delayed = keep_delayed, read_delayed
        self.readers: dict[str, set[str]] = defaultdict(set)
        """Producer -> the nodes here that read it through a non-delayed edge."""
        self.fed: set[tuple[str, str]] = set()  # (src, port) read here: not delayed
        self.delayed: set[tuple[str, str]] = set()  # (src, port) read here: delayed
        for e in (e for edges in in_edges.values() for e in edges):
            (self.delayed if e.delay else self.fed).add((e.src, e.src_port))
            if not e.delay:
                self.readers[e.src].add(e.dst)
        self.book = StreamBook()
        self.consumers: dict[tuple[int, str], _Consumer] = {}
        self.joined: set[tuple[int, str, str]] = set()
        """(step, src, port) of other processes' streams joined for the delayed edges here."""

    # --- what arrives -------------------------------------------------------------------------
    def add(self, step: int, src: str, port: str, index: int, piece: Piece) -> list[str]:
        """Piece ``index`` of another process's streamed output; returns why it was dropped."""
        if not self.book.add(step, src, port, index, piece.rows, piece.outputs[port], piece.size):
            return [f"piece {index} of {src}.{port} at step {step}: a second copy"]
        return self._join_for_delayed(step, src, port)

    def end(self, step: int, src: str, port: str, count: int) -> list[str]:
        """The end of another process's streamed output: ``count`` pieces in all."""
        self.book.end(step, src, port, count)
        return self._join_for_delayed(step, src, port)

    def _join_for_delayed(self, step: int, src: str, port: str) -> list[str]:
        """Readers here on a delayed edge get the joined value once the stream is complete."""
        dropped = []
        done = (step, src, port) in self.joined
        complete = self.book.count(step, src, {port}) is not None
        if (src, port) in self.delayed and not done and complete:
            self.joined.add((step, src, port))
            dropped = self.keep_delayed(src, port, step, self.book.joined(step, src, port))
        self.prune()
        return dropped

    # --- running streamed calls -----------------------------------------------------------------
    def ready(self, name: str, step: int) -> bool:
        """Whether ``name`` can take a piece (or finish) of the streams it reads, or, when it
        runs whole, whether those streams are complete (then joined into its inputs)."""
        c = self.consumers.get((step, name))
        if c is None:
            have = self.pending.get((step, name), {})
            sources = set()
            for e in self.in_edges[name]:  # delayed inputs: the engine saw they can be read
                if e.delay or e.dst_port in have:
                    continue
                if not self.book.has(step, e.src):
                    return False  # an input that is not streamed has not arrived yet
                sources.add(e.src)
            edges = [e for e in self.in_edges[name] if not e.delay and e.src in sources]
            ports = {e.dst_port: e.src_port for e in edges}
            inputs = {e.dst_port: have.get(e.dst_port) for e in self.in_edges[name] if not e.delay}
            source = next(iter(sources)) if len(sources) == 1 else None
            size = self.book.size(step, source) if source is not None else None
            if source is not None:  # read now: a run whole reads them again when it starts
                inputs.update(self.read_delayed(name, step))
            if source is not None and per_piece(self.nodes[name], ports, inputs, size):
                self.pending.pop((step, name), None)
                for port in ports:
                    inputs.pop(port)
                c = self.consumers[(step, name)] = _Consumer(source, ports, inputs)
            else:
                for src in sources:
                    src_ports = {e.src_port for e in edges if e.src == src}
                    if self.book.count(step, src, src_ports) is None:
                        return False
                slot = self.pending.setdefault((step, name), {})
                for e in edges:
                    slot[e.dst_port] = self.book.joined(step, e.src, e.src_port)
                return True
        count = self.book.count(step, c.src, c.src_ports)
        if count == c.next:
            return True  # every piece taken: the consumer's outputs can be joined
        queued = self._queued(step, c)
        if not queued:
            return False
        delay = self.nodes[name].batch_policy.max_queue_delay_s
        if delay <= 0 or c.next + len(queued) == count or budget_full(self.nodes[name], queued):
            return True
        if c.queued_at is None:
            c.queued_at = time.monotonic()
        return time.monotonic() - c.queued_at >= delay

    def _queued(self, step: int, c: _Consumer) -> list[Piece]:
        """The pieces here that ``c`` takes next, in order (none when the next is missing)."""
        queued = []
        while (p := self.book.piece(step, c.src, c.next + len(queued), c.src_ports)) is not None:
            queued.append(p)
        return queued

    def wake_in(self) -> float | None:
        """Seconds until a consumer that waits for more pieces must run anyway (None: none
        waits), for a loop that sleeps until something arrives."""
        due = [
            c.queued_at + self.nodes[name].batch_policy.max_queue_delay_s
            for (_, name), c in self.consumers.items()
            if c.queued_at is not None
        ]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def run_stream(self, name: str, step: int, pieces: Iterable[Piece]) -> dict[str, Any]:
        """Hand each of ``pieces`` (a streaming call of ``name``) to the readers here as it
        comes; returns the joined outputs."""
        got = []
        for i, piece in enumerate(pieces):
            got.append(piece)
            for port, value in piece.outputs.items():
                if (name, port) in self.fed:
                    self.book.add(step, name, port, i, piece.rows, value, piece.size)
        for port in self.nodes[name].outputs:
            if (name, port) in self.fed:
                self.book.end(step, name, port, len(got))
        return join_pieces(got, name)

    def run_piece(
        self, name: str, step: int, call: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> tuple[dict[str, Any], float, float] | None:
        """Call ``name`` (``call``: one node call on these inputs) on the next pieces queued for
        it, fused; once all are taken, its joined outputs, seconds and start (None before)."""
        c = self.consumers[(step, name)]
        if self.book.count(step, c.src, c.src_ports) == c.next:
            del self.consumers[(step, name)]
            return join_pieces(c.pieces, name), c.seconds, c.start
        queued = self._queued(step, c)
        assert queued  # ready() said so
        node = self.nodes[name]
        fused = fusable(node, queued)
        piece = fuse_pieces(queued[:fused], name)
        if not c.pieces:
            c.start = time.time()
        t0 = time.perf_counter()
        c.pieces.append(
            call_piece(call, node, c.inputs, c.ports, piece, c.next, c.seen, step, self.here, fused)
        )
        c.seconds += time.perf_counter() - t0
        c.next += fused
        c.queued_at = None
        return None

    def prune(self) -> None:
        """Forget the streams that every reader here is done with."""
        for step, src in self.book.streams():
            if (
                all(self.next_step[r] > step for r in self.readers.get(src, ()))
                and self.book.count(step, src, self.book.ports(step, src)) is not None
            ):
                self.book.discard(step, src)
                self.joined = {k for k in self.joined if k[:2] != (step, src)}
