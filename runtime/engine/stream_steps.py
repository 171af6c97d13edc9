"""The part of the step engine that runs streams: pieces in, consumers fed the pieces queued
for them (fused up to their budget), pieces out.

:class:`StreamSteps` is a base of :class:`~runtime.engine.engine.StepEngine` and works on its
state (the pending inputs, the :class:`~runtime.engine.streams.StreamBook` of pieces, the
consumers fed per piece); it is kept apart so that each module reads in one sitting. The rule
it applies (which consumer takes pieces, which runs whole) is :mod:`runtime.engine.streams`'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from runtime.engine.calls import Running, run_node, stream_node
from runtime.engine.streams import StreamBook, budget_full, call_piece, fusable, per_piece
from runtime.engine.tensor_moves import host_copy
from yatt_graph.stream import Piece, fuse_pieces, join_pieces

__all__ = ["StreamSteps"]


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


class StreamSteps:
    """Streams in a :class:`~runtime.engine.engine.StepEngine` (see the module docstring)."""

    book: StreamBook
    consumers: dict[tuple[int, str], _Consumer]
    _delayed_joined: set[tuple[int, str, str]]
    nodes: dict[str, Any]
    pending: dict[tuple[int, str], dict[str, Any]]
    in_edges: dict[str, list[Any]]
    remote_in: dict[tuple[str, str], list[Any]]
    local_out: dict[tuple[str, str], list[Any]]
    remote_out: dict[tuple[str, str], list[int]]
    readers: dict[str, set[str]]
    delayed_keys: dict[tuple[str, str], list[Any]]
    next_step: dict[str, int]
    seconds: dict[int, dict[str, float]]
    starts: dict[int, dict[str, float]]
    running: Running | None
    limits: dict[str, float]
    here: int
    outbox: Any
    fanouts: Any
    check_finite: bool
    moves: Any

    # StepEngine's, called from here
    def _keep_delayed(self, src: str, port: str, step: int, value: Any) -> list[str]:
        raise NotImplementedError

    def _read_delayed(self, name: str, step: int) -> dict[str, Any]:
        raise NotImplementedError

    def _finish(self, name: str, step: int, out: dict[str, Any], streamed: bool = False) -> None:
        raise NotImplementedError

    # --- what arrives -------------------------------------------------------------------------
    def deliver_piece(self, step: int, src: str, port: str, index: int, piece: Piece) -> list[str]:
        """Piece ``index`` of another process's streamed output; returns why it was dropped."""
        if not self.remote_in.get((src, port)):
            return [f"data for {src}.{port}, which no node here reads"]
        if not self.book.add(step, src, port, index, piece.rows, piece.outputs[port], piece.size):
            return [f"piece {index} of {src}.{port} at step {step}: a second copy"]
        return self._join_for_delayed(step, src, port)

    def end_stream(self, step: int, src: str, port: str, count: int) -> list[str]:
        """The end of another process's streamed output: ``count`` pieces in all."""
        if not self.remote_in.get((src, port)):
            return [f"data for {src}.{port}, which no node here reads"]
        self.book.end(step, src, port, count)
        return self._join_for_delayed(step, src, port)

    def _join_for_delayed(self, step: int, src: str, port: str) -> list[str]:
        """Readers here on a delayed edge get the joined value once the stream is complete."""
        dropped = []
        done = (step, src, port) in self._delayed_joined
        complete = self.book.count(step, src, {port}) is not None
        if (src, port) in self.delayed_keys and not done and complete:
            self._delayed_joined.add((step, src, port))
            dropped = self._keep_delayed(src, port, step, self.book.joined(step, src, port))
        if self.book:
            self._prune_streams()
        return dropped

    # --- running streamed calls -----------------------------------------------------------------
    def _stream_ready(self, name: str, step: int) -> bool:
        """Whether ``name`` can take a piece (or finish) of the streams it reads, or, when it
        runs whole, whether those streams are complete (then joined into its inputs)."""
        c = self.consumers.get((step, name))
        if c is None:
            have = self.pending.get((step, name), {})
            sources = set()
            for e in self.in_edges[name]:  # delayed inputs: _ready saw they can be read
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
                inputs.update(self._read_delayed(name, step))
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

    def _run_stream(self, name: str, step: int, inputs: dict[str, Any]) -> dict[str, Any]:
        """Run a streaming node: each piece to the readers here and to the processes that
        read it, as it comes; returns the joined outputs."""
        pieces = []
        here = {
            port
            for (src, port), edges in self.local_out.items()
            if src == name and any(not e.delay for e in edges)
        }
        node = self.nodes[name]
        for i, piece in enumerate(stream_node(node, inputs, step, self.here, self.check_finite)):
            pieces.append(piece)
            for port, value in piece.outputs.items():
                if port in here:
                    self.book.add(step, name, port, i, piece.rows, value, piece.size)
                dests = self.remote_out.get((name, port))
                if dests and self.outbox is not None:
                    for group, as_is in self.moves.split(name, port, dests):
                        sent = piece if as_is else piece._replace(outputs={port: host_copy(value)})
                        self.outbox.piece(step, name, port, i, sent, group)
        for port in node.outputs:
            if port in here:
                self.book.end(step, name, port, len(pieces))
            dests = self.remote_out.get((name, port))
            if dests and self.outbox is not None:
                self.outbox.end(step, name, port, len(pieces), dests)
        return join_pieces(pieces, name)

    def _run_piece(self, name: str, step: int, c: _Consumer) -> None:
        """The next piece of a per-piece consumer, or, all taken, its joined outputs."""
        if self.book.count(step, c.src, c.src_ports) == c.next:
            del self.consumers[(step, name)]
            self.seconds[step][name] = c.seconds
            self.starts[step][name] = c.start
            self._finish(name, step, join_pieces(c.pieces, name))
            return
        queued = self._queued(step, c)
        assert queued  # _stream_ready said so
        node = self.nodes[name]
        fused = fusable(node, queued)
        piece = fuse_pieces(queued[:fused], name)

        def call(inputs: dict[str, Any]) -> dict[str, Any]:
            return run_node(
                node, self.moves.inputs(node, inputs), step, self.here, self.fanouts,
                self.check_finite,
            )  # fmt: skip

        if not c.pieces:
            c.start = time.time()
        t0 = time.perf_counter()
        self.running = Running(name, step, time.monotonic(), self.limits[name])
        try:
            c.pieces.append(
                call_piece(
                    call, node, c.inputs, c.ports, piece, c.next, c.seen, step, self.here, fused
                )
            )
        finally:
            self.running = None
        c.seconds += time.perf_counter() - t0
        c.next += fused
        c.queued_at = None

    def _prune_streams(self) -> None:
        """Forget the streams that every reader here is done with."""
        for step, src in self.book.streams():
            readers = self.readers.get(src, ())
            if (
                all(self.next_step[r] > step for r in readers)
                and self.book.count(step, src, self.book.ports(step, src)) is not None
            ):
                self.book.discard(step, src)
                self._delayed_joined = {k for k in self._delayed_joined if k[:2] != (step, src)}
