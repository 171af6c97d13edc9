"""Streaming between nodes in the executors: a consumer starts on the first finished samples.

A streaming node (one that defines ``forward_stream``, :mod:`yatt_graph.stream`) yields its
outputs in pieces as samples finish. Both executors run it through ``run_stream`` and its
direct consumers then work in one of two modes, chosen by the same rule in both (so that a
ZeroMQ run equals the in-process one):

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

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from runtime.sched.batching import _is_batched, default_costs, take
from runtime.sched.fanout import _splittable, shared_ports
from yatt_graph import NodeExecutionError, NodeOutputError
from yatt_graph.stream import Piece, check_piece, join_pieces

__all__ = ["StreamBook", "budget_full", "call_piece", "fusable", "per_piece"]


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
