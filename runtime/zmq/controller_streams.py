"""The controller's part in streaming (runtime/engine/streams.py): pieces in, consumers fed per piece.

:class:`StreamingMixin` holds what a :class:`runtime.zmq.controller.Controller` does with
streamed outputs: it runs a streaming node (each piece to the readers here and to the
controllers that read it, then an end marker with the piece count), keeps the pieces that
reach it in a :class:`~runtime.engine.streams.StreamBook`, decides per consumer whether it is fed
per piece or gets the joined batch (the rule of runtime/engine/streams.py, the same as in the
in-process executor), feeds it, and forgets a stream once every reader here is done with it.
It uses the controller's own state (``pending``, ``next_step``, ``in_edges``, ...).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from runtime.engine.streams import StreamBook, call_piece, per_piece
from runtime.zmq import messages as m
from yatt_graph.stream import join_pieces

__all__ = ["StreamingMixin"]


class _Consumer:
    """A node fed per piece of a stream at one step: what it has taken so far."""

    def __init__(self, src: str, ports: dict[str, str], inputs: dict[str, Any]):
        self.src = src
        self.ports = ports  # its input port -> the producer's output port
        self.src_ports = set(ports.values())
        self.inputs = inputs  # its other (shared) inputs
        self.next = 0
        self.seen: set[int] = set()
        self.pieces: list[Any] = []
        self.seconds = 0.0
        self.start = 0.0


class StreamingMixin:
    """Streaming for :class:`runtime.zmq.controller.Controller` (see the module docstring)."""

    def _setup_streams(self) -> None:
        """Pieces here, consumers fed per piece, and which nodes here read each producer
        through a non-delayed edge."""
        self.book = StreamBook()
        self.consumers: dict[tuple[int, str], _Consumer] = {}
        self.readers: dict[str, set[str]] = defaultdict(set)
        for e in self.edges:
            if e.dst in self.nodes and not e.delay:
                self.readers[e.src].add(e.dst)
        self._delayed_joined: set[tuple[int, str, str]] = set()

    def _clear_streams(self) -> None:
        self.book.clear()
        self.consumers.clear()
        self._delayed_joined.clear()

    def _stream_ready(self, name: str, step: int) -> bool:
        """Whether ``name`` can take a piece (or finish) of the streams it reads, or, when it
        runs whole, whether those streams are complete (then joined into its inputs)."""
        c = self.consumers.get((step, name))
        if c is None:
            have = self.pending.get((step, name), {})
            sources = set()
            for e in self.in_edges[name]:
                if e.dst_port in have or (e.delay and step < self.lag):
                    continue
                if e.delay or not self.book.has(step, e.src):
                    return False  # an input that is not streamed has not arrived yet
                sources.add(e.src)
            edges = [e for e in self.in_edges[name] if not e.delay and e.src in sources]
            ports = {e.dst_port: e.src_port for e in edges}
            inputs = {e.dst_port: have.get(e.dst_port) for e in self.in_edges[name]}
            source = next(iter(sources)) if len(sources) == 1 else None
            size = self.book.size(step, source) if source is not None else None
            if source is not None and per_piece(self.nodes[name], ports, inputs, size):
                self.pending.pop((step, name), None)
                for port in ports:
                    inputs.pop(port)
                c = self.consumers[(step, name)] = _Consumer(source, ports, inputs)
            else:
                for src in sources:
                    if (
                        self.book.count(step, src, {e.src_port for e in edges if e.src == src})
                        is None
                    ):
                        return False
                slot = self.pending.setdefault((step, name), {})
                for e in edges:
                    slot[e.dst_port] = self.book.joined(step, e.src, e.src_port)
                return True
        if self.book.count(step, c.src, c.src_ports) == c.next:
            return True  # every piece taken: the consumer's outputs can be joined
        return self.book.piece(step, c.src, c.next, c.src_ports) is not None

    def _run_stream(self, name: str, step: int, inputs: dict[str, Any]) -> dict[str, Any]:
        """Run a streaming node: each piece to the readers here and to the controllers that
        read it, as it comes; returns the joined outputs."""
        from runtime.engine.local import stream_node

        pieces = []
        here = {
            port
            for (src, port), edges in self.local_out.items()
            if src == name and any(not e.delay for e in edges)
        }
        for i, piece in enumerate(stream_node(self.shim.nodes[name], inputs, step, self.index)):
            pieces.append(piece)
            for port, value in piece.outputs.items():
                if port in here:
                    self.book.add(step, name, port, i, piece.rows, value, piece.size)
                dests = self.remote_out.get((name, port))
                if dests:
                    self._send_data(step, name, port, value, dests, i, piece.rows, piece.size)
        for port in self.nodes[name].outputs:
            if port in here:
                self.book.end(step, name, port, len(pieces))
            for c in self.remote_out.get((name, port), ()):
                self._send(
                    c, m.Data(step, name, port, self.index, self.epoch, len(pieces), end=True)
                )
        return join_pieces(pieces, name)

    def _run_piece(self, name: str, step: int, c: _Consumer) -> None:
        """The next piece of a per-piece consumer, or, all taken, its joined outputs."""
        if self.book.count(step, c.src, c.src_ports) == c.next:
            del self.consumers[(step, name)]
            self.seconds[step][name] = c.seconds
            self.starts[step][name] = c.start
            self._finish(name, step, join_pieces(c.pieces, name))
            return
        piece = self.book.piece(step, c.src, c.next, c.src_ports)
        assert piece is not None  # _stream_ready said so

        def call(inputs: dict[str, Any]) -> dict[str, Any]:
            return self.run_node(self.shim.nodes[name], inputs, step, self.index, self.splitter)

        if not c.pieces:
            c.start = time.time()
        t0 = time.perf_counter()
        self.current = (name, step, time.monotonic(), self.limits[name])
        try:
            c.pieces.append(
                call_piece(
                    call,
                    self.nodes[name],
                    c.inputs,
                    c.ports,
                    piece,
                    c.next,
                    c.seen,
                    step,
                    self.index,
                )
            )
        finally:
            self.current = None
        c.seconds += time.perf_counter() - t0
        c.next += 1

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

    def _handle_stream(self, event: tuple[Any, ...]) -> None:
        """A piece or the end of a stream from a peer; delayed readers get the joined value."""
        if event[-1] != self.epoch:
            return  # queued before the last restore
        kind, step, src, port = event[:4]
        if kind == "end":
            self.book.end(step, src, port, event[4])
        elif not self.book.add(step, src, port, *event[4:8]):
            self.drops.drop(
                f"controller {self.index}'s data socket",
                f"piece {event[4]} of {src}.{port} at step {step}: a second copy",
            )
            return
        delayed = [e for e in self.remote_in.get((src, port), ()) if e.delay]
        done = (step, src, port) in self._delayed_joined
        if delayed and not done and self.book.count(step, src, {port}) is not None:
            self._delayed_joined.add((step, src, port))
            value = self.book.joined(step, src, port)
            for e in delayed:
                self.pending.setdefault((step + self.lag, e.dst), {})[e.dst_port] = value
        if self.book:
            self._prune_streams()
