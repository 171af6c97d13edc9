"""Checkpoint state of a ZeroMQ run: the controllers' replies merged into one, and one split back.

Between steps the driver asks every controller for its nodes' ``state_dict()``, the
delayed-edge values it holds and its RNG states (STATE_REQUEST / STATE_REPLY), and sends
such a state back (STATE_LOAD / STATE_LOADED). The merged state has the format of
``LocalExecutor.state_dict()`` (``{"step", "nodes", "delayed", "rng"}``), so a checkpoint of
either executor loads into the other. These functions are the format; the exchange is the
driver's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.codec import DecodeError, UnsupportedValueError, decode_value, encode_value
from runtime.engine.engine import delayed_entries
from runtime.errors import ControllerError

__all__ = ["merge_replies", "state_frames"]


def merge_replies(
    replies: dict[int, list[Any]], step: int, order: Sequence[str], executor: dict[str, Any]
) -> dict[str, Any]:
    """One state from each controller's STATE_REPLY value frames (by controller index).

    ``rng`` holds controller 0's states (what a LocalExecutor restores) and
    ``rng["controllers"]`` each controller's.
    """
    nodes: dict[str, Any] = {}
    delayed: dict[tuple[str, str, int], Any] = {}
    rngs: list[dict[str, Any]] = []
    for index in sorted(replies):
        where = f"the state of controller {index}'s nodes"
        try:
            value = decode_value(replies[index], where=where)
            nodes.update(value["nodes"])
            for src, port, produced, v in value["delayed"]:
                delayed.setdefault((src, port, int(produced)), v)
            rngs.append(value["rng"])
        except (DecodeError, KeyError, TypeError, ValueError) as exc:
            raise ControllerError(f"{where} does not decode: {exc}", index) from None
    return {
        "step": step,
        "nodes": {n: nodes.get(n, {}) for n in order},
        "delayed": [[s, p, k, v] for (s, p, k), v in sorted(delayed.items(), key=lambda kv: kv[0])],
        "rng": {**rngs[0], "controllers": rngs},
        "executor": executor,
    }


def state_frames(
    state: dict[str, Any], graph: Any, owned: list[list[str]], keep: int
) -> list[list[Any]]:
    """A ``state_dict()`` of ``graph`` (of a ZeroMQ run or a LocalExecutor) as each controller's
    STATE_LOAD value frames; a ValueError when the state lacks a node of the graph.

    ``owned[c]``: controller c's nodes. Only the delayed values its nodes read in the next
    ``keep`` steps are sent. A state without per-controller RNG states gives every controller
    the same ones.
    """
    missing = sorted(set(graph.nodes) - set(state.get("nodes", {})))
    if missing:
        raise ValueError(
            f"checkpoint has no state for node(s) {missing}; was it written by this graph?"
        )
    step = int(state["step"])
    entries = [
        (s, p, int(k), v)
        for s, p, k, v in delayed_entries(state, step) + state.get("delayed_history", [])
        if step - keep <= int(k) < step
    ]
    rng = dict(state.get("rng") or {})
    per_controller = rng.pop("controllers", None)
    if not per_controller or len(per_controller) != len(owned):
        per_controller = [rng] * len(owned)
    out = []
    for c, names in enumerate(owned):
        read = {(e.src, e.src_port) for e in graph.edges if e.delay and e.dst in names}
        payload = {
            "nodes": {n: state["nodes"][n] for n in names},
            "delayed": [[s, p, k, v] for s, p, k, v in entries if (s, p) in read],
            "rng": per_controller[c],
        }
        where = f"the checkpoint's state for controller {c}"
        try:
            out.append(encode_value(payload, where=where, any_keys=True))
        except UnsupportedValueError as exc:
            raise ValueError(str(exc)) from None
    return out
