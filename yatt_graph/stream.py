"""Streaming nodes: outputs that come out in pieces, as samples finish.

A node streams when it defines ``forward_stream(**inputs)``, a generator of ``(rows,
outputs)`` pieces: ``rows`` are the positions, in the node's whole output batch, of the
samples that just finished, and ``outputs`` hold one entry per row on every output port
(a tensor's first axis, a list's items). Over the call the rows of all pieces must be
``0..B-1``, each once. A piece may also say B, as ``(rows, outputs, size)``, the same in
every piece: a consumer can then take its other per-sample inputs of that length (say,
per-prompt data next to the responses) row by row with the piece. A mapping on an output port
is a value of the call, not of its rows (a metric, such as the weights a rollout loaded before
sampling): every piece holds the same one, and it is the joined output. An executor hands
each piece downstream at once, so a consumer that may be called on any part of a batch (see
:mod:`runtime.engine.streams`) starts on the first finished samples while the slowest are
still being produced.

:func:`join_pieces` puts pieces back into whole-batch outputs (rows in order; tensors whose
trailing sizes differ between pieces are zero-padded to the largest, as a ragged batch is).
:func:`fuse_pieces` makes one piece of several (their rows one after another), which is how
a consumer takes the pieces queued for it in one call.
It uses only the values' own methods, so this package still does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from yatt_graph.errors import NodeOutputError

__all__ = ["Piece", "check_piece", "fuse_pieces", "join_pieces"]


class Piece(NamedTuple):
    """One streamed piece of a node call."""

    rows: list[int]
    """Positions of the piece's samples in the call's whole output batch."""
    outputs: dict[str, Any]
    """One entry per row on every output port."""
    size: int | None = None
    """The whole batch's row count, when the node says it."""


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "new_zeros")


def check_piece(
    node: str,
    ports: Mapping[str, Any],
    piece: Any,
    seen: set[int],
    index: int,
    where: str = "",
    size: int | None = None,
) -> Piece:
    """A yielded ``(rows, outputs[, size])`` as a checked :class:`Piece`: the node's output
    ports exactly, one entry per row on each, rows that are new non-negative ints (below the
    size, when given). ``seen`` collects the rows; ``size`` is what an earlier piece said;
    ``where`` replaces the start of the error messages."""
    where = where or f"node {node!r}: forward_stream piece {index}"
    if not (isinstance(piece, tuple | list) and len(piece) in (2, 3)):
        raise NodeOutputError(
            f"{where} is a {type(piece).__name__}; yield (rows, outputs) pairs: rows a list of "
            "output positions, outputs a dict with one entry per row on each output port "
            "(and optionally the batch size as a third item)"
        )
    rows, outputs = piece[0], piece[1]
    said = piece[2] if len(piece) == 3 else None
    if said is not None and (type(said) is not int or said < 0):
        raise NodeOutputError(f"{where}: the batch size must be a non-negative int, got {said!r}")
    if index > 0 and said != size:
        raise NodeOutputError(
            f"{where}: says batch size {said}, an earlier piece said {size}; say it in every "
            "piece or in none"
        )
    if _is_tensor(rows):
        rows = rows.tolist()
    if not isinstance(rows, list | tuple | range) or not all(
        type(r) is int and r >= 0 and (said is None or r < said) for r in rows
    ):
        limit = f" below the batch size {said}" if said is not None else ""
        raise NodeOutputError(
            f"{where}: rows must be a list of non-negative ints{limit}, got {rows!r}"
        )
    rows = list(rows)
    again = sorted(seen.intersection(rows))
    if again or len(set(rows)) != len(rows):
        raise NodeOutputError(
            f"{where}: rows {again or rows} were already yielded; each sample finishes once"
        )
    if not isinstance(outputs, Mapping) or outputs.keys() != ports.keys():
        got = sorted(outputs) if isinstance(outputs, Mapping) else type(outputs).__name__
        raise NodeOutputError(
            f"{where}: outputs {got}; a piece holds every declared output {sorted(ports)}"
        )
    for port, value in outputs.items():
        if isinstance(value, Mapping):  # the call's value, not a row's
            continue
        try:
            n = len(value)
        except TypeError:
            n = None
        if n != len(rows):
            raise NodeOutputError(
                f"{where}: output {port!r} has {n if n is not None else 'no'} entries for "
                f"{len(rows)} rows; every output of a piece holds one entry per row"
            )
    seen.update(rows)
    return Piece(rows, dict(outputs), said)


def join_pieces(pieces: Sequence[Piece], node: str = "") -> dict[str, Any]:
    """Whole-batch outputs from checked pieces, each row in its place (see the module doc)."""
    who = f"node {node!r}: " if node else ""
    if not pieces:
        raise NodeOutputError(
            f"{who}forward_stream yielded nothing; for an empty batch yield ([], outputs) "
            "with empty values, so that the outputs' types are known"
        )
    total = sum(len(p[0]) for p in pieces)
    rows_seen = sorted(r for p in pieces for r in p[0])
    size = pieces[0][2] if len(pieces[0]) > 2 else None
    if size is not None and total != size:
        raise NodeOutputError(
            f"{who}the stream said its batch has {size} rows but yielded {total}; every sample "
            "of the batch must finish once"
        )
    if rows_seen != list(range(total)):
        missing = sorted(set(range(total)) - set(rows_seen))[:8]
        raise NodeOutputError(
            f"{who}the streamed rows are not 0..{total - 1}: missing {missing}, largest "
            f"{rows_seen[-1] if rows_seen else None}; every sample of the batch must finish once"
        )
    out: dict[str, Any] = {}
    for port in pieces[0][1]:
        values = [(p[0], p[1][port]) for p in pieces]
        first = values[0][1]
        if isinstance(first, Mapping):
            if not all(v is first or _equal(v, first) for _, v in values):
                raise NodeOutputError(
                    f"{who}output {port!r} is a mapping (a value of the whole call) that "
                    "differs between pieces; give every piece the same one, or one entry per row"
                )
            out[port] = first
        elif _is_tensor(first):
            dims = len(first.shape)
            widths = [max(v.shape[d] for _, v in values) for d in range(1, dims)]
            joined = first.new_zeros((total, *widths))
            for rows, v in values:
                if len(v.shape) != dims:
                    raise NodeOutputError(
                        f"{who}output {port!r} has rank {len(v.shape)} in one piece and "
                        f"{dims} in another"
                    )
                if rows:  # (a piece that came through host memory joins one on a GPU)
                    joined[(rows, *[slice(0, s) for s in v.shape[1:]])] = v.to(joined.device)
            out[port] = joined
        else:
            joined_list: list[Any] = [None] * total
            for rows, v in values:
                for r, x in zip(rows, v):
                    joined_list[r] = x
            out[port] = tuple(joined_list) if isinstance(first, tuple) else joined_list
    return out


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values that compare elementwise (tensors) count as different
        return False


def fuse_pieces(pieces: Sequence[Piece], node: str = "") -> Piece:
    """One piece holding the rows of ``pieces`` one after another (checked pieces of one
    stream: disjoint rows, the same ports); tensors are zero-padded as :func:`join_pieces`
    pads them."""
    if len(pieces) == 1:
        return pieces[0]
    local, start = [], 0
    for p in pieces:  # renumber the rows 0..n-1 in order, so join_pieces lays them end to end
        local.append(Piece(list(range(start, start + len(p.rows))), p.outputs))
        start += len(p.rows)
    rows = [r for p in pieces for r in p.rows]
    return Piece(rows, join_pieces(local, node), pieces[0].size)
