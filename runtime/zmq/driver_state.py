"""Checkpoints for :class:`runtime.zmq.driver.ZmqExecutor`: node state out of and into the controllers.

Between steps the driver asks every controller for its nodes' ``state_dict()``, the
delayed-edge values it holds and its RNG states (STATE_REQUEST / STATE_REPLY), and sends
such a state back (STATE_LOAD / STATE_LOADED), in the format of
``LocalExecutor.state_dict()``, so a checkpoint of either executor loads into the other.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from runtime.errors import ControllerError
from runtime.zmq import messages as m
from runtime.zmq.serial import DecodeError, UnsupportedValueError, decode_value, encode_value

__all__ = ["StateMixin"]


class StateMixin:
    """``state_dict`` / ``load_state_dict`` for :class:`runtime.zmq.driver.ZmqExecutor`.

    It reads the executor's controllers, graph, order and step counters, and talks to the
    controllers through its ``_send_work`` / ``_next_event`` / ``_other_event`` /
    ``_shutdown``.
    """

    def state_dict(self) -> dict[str, Any]:
        """Every node's state, the delayed-edge values, RNG states and the step, from the controllers.

        The format of ``LocalExecutor.state_dict()``: ``{"step", "nodes", "delayed", "rng"}``;
        ``rng`` holds controller 0's states (what a LocalExecutor restores) and
        ``rng["controllers"]`` each controller's. With ``max_staleness > 0``,
        ``delayed_history`` adds the older values the next steps still read. Tensors arrive
        on the CPU. Call it between steps (after ``step()`` or ``run()`` returned).
        """
        step = self.next_step
        replies = self._exchange({c.index: (m.StateRequest(step), None) for c in self.controllers},
                                 m.Kind.STATE_REPLY, step, "send the state of their nodes")  # fmt: skip
        nodes: dict[str, Any] = {}
        history: dict[tuple[str, str, int], Any] = {}
        rngs: list[dict[str, Any]] = []
        for index in range(len(self.controllers)):
            where = f"the state of controller {index}'s nodes"
            try:
                value = decode_value(replies[index], where=where)
                nodes.update(value["nodes"])
                for src, port, produced, v in value["delayed"]:
                    history.setdefault((src, port, produced), v)
                rngs.append(value["rng"])
            except (DecodeError, KeyError, TypeError, ValueError) as exc:
                self._shutdown("a bad state reply")
                raise ControllerError(f"{where} does not decode: {exc}", index) from None
        state: dict[str, Any] = {
            "step": step,
            "nodes": {n: nodes.get(n, {}) for n in self.order},
            "delayed": [[s, p, v] for (s, p, k), v in history.items() if k == step - 1],
            "rng": {**rngs[0], "controllers": rngs},
            "executor": {
                "kind": "zmq",
                "controllers": len(self.controllers),
                "max_staleness": self.max_staleness,
            },
        }
        if self.max_staleness:
            state["delayed_history"] = [[s, p, k, v] for (s, p, k), v in sorted(
                history.items(), key=lambda kv: kv[0])]  # fmt: skip
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` (of this executor or of a LocalExecutor) into the controllers.

        The next step run is ``state["step"]``. Data still in flight from before is dropped
        (each restore starts a new epoch). Call it between steps.
        """
        missing = sorted(set(self.graph.nodes) - set(state.get("nodes", {})))
        if missing:
            raise ValueError(
                f"checkpoint has no state for node(s) {missing}; was it written by this graph?"
            )
        step = int(state["step"])
        lag = 1 + self.max_staleness
        if "delayed_history" in state:
            entries = [(s, p, int(k), v) for s, p, k, v in state["delayed_history"]]
        else:
            entries = [(s, p, step - 1, v) for s, p, v in state.get("delayed", [])]
            if lag > 1 and step > 1 and entries:
                warnings.warn(
                    f"ZmqExecutor(max_staleness={self.max_staleness}): the checkpoint holds only the "
                    f"delayed values of step {step - 1} (it is from an on-policy run); the next "
                    f"{lag - 1} step(s) read None on their delayed inputs",
                    RuntimeWarning,
                    stacklevel=2,
                )
        entries = [e for e in entries if step - lag <= e[2] < step]
        rng = dict(state.get("rng") or {})
        per_controller = rng.pop("controllers", None)
        if not per_controller or len(per_controller) != len(self.controllers):
            per_controller = [rng] * len(self.controllers)
        self._epoch += 1
        messages = {}
        for c in self.controllers:
            here = {(e.src, e.src_port) for e in self.graph.edges if e.delay and e.dst in c.nodes}
            payload = {
                "nodes": {n: state["nodes"][n] for n in c.nodes},
                "delayed": [[s, p, k, v] for s, p, k, v in entries if (s, p) in here],
                "rng": per_controller[c.index],
            }
            where = f"the checkpoint's state for controller {c.index}"
            try:
                frames = encode_value(payload, where=where, any_keys=True)
            except UnsupportedValueError as exc:
                raise ValueError(str(exc)) from None
            messages[c.index] = (m.StateLoad(step, self._epoch), frames)
        self._exchange(messages, m.Kind.STATE_LOADED, step, "restore the state of their nodes")
        self.next_step = self._until = step

    def _exchange(
        self, messages: dict[int, tuple[Any, list[Any] | None]], reply: m.Kind, step: int, what: str
    ) -> dict[int, list[Any]]:
        """Send each controller its message; wait for every one's ``reply`` (value frames)."""
        if self._closed:
            raise RuntimeError(
                "ZmqExecutor: this executor is closed (after close(), an error or Ctrl-C)"
            )
        if self._until != self.next_step:
            raise RuntimeError("ZmqExecutor: state can move only between steps, not during run()")
        got: dict[int, list[Any]] = {}
        deadline = time.monotonic() + self.state_timeout_s
        try:
            for c in self.controllers:
                msg, value = messages[c.index]
                self._send_work(c, msg, value)
            while len(got) < len(self.controllers):
                event = self._next_event(None, "")
                if event is None:
                    if time.monotonic() > deadline:
                        late = sorted(set(range(len(self.controllers))) - set(got))
                        raise ControllerError(
                            f"controllers {late} did not {what} within {self.state_timeout_s:.0f}s "
                            "(state_timeout_s)",
                            late[0],
                            self.controllers[late[0]].nodes,
                        )
                    continue
                identity, kind, msg, value = event
                index = self._by_identity[identity].index
                if kind is reply and msg.step == step:
                    got[index] = value
                else:
                    self._other_event(identity, kind, msg)
        except BaseException as exc:
            self._shutdown(f"{type(exc).__name__} in the driver")
            raise
        return got
