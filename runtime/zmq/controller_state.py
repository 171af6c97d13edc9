"""The controller's part in checkpoints: its nodes' state out, and back in on restore.

:class:`StateMixin` holds what a :class:`runtime.zmq.controller.Controller` does between steps
for :meth:`runtime.zmq.driver.ZmqExecutor.state_dict` / ``load_state_dict``: it answers a
STATE_REQUEST once the step before is done and every delayed value the next steps read has
arrived (nodes' ``state_dict()``, those delayed values, the RNG states), and on a STATE_LOAD
restores them and starts over at the given step and epoch. It uses the controller's own
state (``next_step``, ``pending``, ``order``, ``nodes``, ...).
"""

from __future__ import annotations

from typing import Any

from runtime.engine.rng import rng_state, set_rng_state
from runtime.errors import SendError
from runtime.zmq import messages as m
from runtime.zmq.serial import UnsupportedValueError, encode_value

__all__ = ["StateMixin"]


class StateMixin:
    """Checkpoint and restore for :class:`runtime.zmq.controller.Controller`."""

    def _delayed_slots(self, step: int) -> list[tuple[Any, int]]:
        """(delayed in-edge, producing step) pairs whose values the steps from ``step`` on read."""
        return [
            (e, p) for e in self.delayed_in for p in range(max(0, step - self.lag), step)
        ]  # fmt: skip

    def _send_state(self) -> None:
        """Answer a STATE_REQUEST once every delayed value the next steps read has arrived."""
        step = self._state_wanted
        assert step is not None
        if any(s != step for s in self.next_step.values()) or self.reported != step:
            if all(s <= step for s in self.next_step.values()):
                return  # still finishing the step before
            raise RuntimeError(
                f"state of step {step} requested, but nodes are at steps {self.next_step}"
            )
        values: dict[tuple[str, str, int], Any] = {}
        for e, p in self._delayed_slots(step):
            slot = self.pending.get((p + self.lag, e.dst), {})
            if e.dst_port not in slot:
                return  # a peer's delayed value is still on its way
            values.setdefault((e.src, e.src_port, p), slot[e.dst_port])
        self._state_wanted = None
        nodes = {}
        for name in self.order:
            try:
                nodes[name] = self.nodes[name].state_dict()
            except Exception as exc:
                raise SendError(
                    name, step, f"node {name!r}: state_dict() failed: {type(exc).__name__}: {exc}",
                    "state",
                ) from exc  # fmt: skip
        payload = {
            "nodes": nodes,
            "delayed": [[s, p, k, v] for (s, p, k), v in values.items()],
            "rng": rng_state(),
        }
        where = f"the state of controller {self.index}"
        try:
            frames = encode_value(payload, where=where, any_keys=True)
        except UnsupportedValueError as exc:
            bad = next((n for n in nodes if f"['nodes'][{n!r}]" in str(exc)), "")
            raise SendError(
                bad, step, f"{exc}; a checkpoint of a ZeroMQ run needs node state that the wire "
                "carries (tensors, numbers, strings, lists, tuples, dicts)", "state",
            ) from None  # fmt: skip
        self._to_driver(m.StateReply(self.index, step), frames)

    def _load_state(self, msg: m.StateLoad, state: dict[str, Any]) -> None:
        """Restore nodes, delayed values and RNG; the next step to run is ``msg.step``."""
        step = msg.step
        for name in self.order:
            node_state = state["nodes"].get(name)
            if node_state:
                try:
                    self.nodes[name].load_state_dict(node_state)
                except Exception as exc:
                    raise SendError(
                        name, step, f"node {name!r}: load_state_dict() failed: "
                        f"{type(exc).__name__}: {exc}", "state",
                    ) from exc  # fmt: skip
        self.epoch = msg.epoch
        self.next_step = dict.fromkeys(self.order, step)
        self.reported = self.until = step
        self.pending = {}
        self._clear_streams()
        self.seconds.clear()
        self.starts.clear()
        self.step_outputs.clear()
        given = {(s, p, int(k)): v for s, p, k, v in state["delayed"]}
        for e, p in self._delayed_slots(step):
            # A value the checkpoint lacks reads None, as in LocalExecutor.
            value = given.get((e.src, e.src_port, p))
            self.pending.setdefault((p + self.lag, e.dst), {})[e.dst_port] = value
        set_rng_state(state.get("rng") or {})
        self._to_driver(m.StateLoaded(self.index, step))
