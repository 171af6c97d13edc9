"""The ZeroMQ runtime's errors: raised in the driver (re-exported by :mod:`runtime.zmq.driver`),
and the one a controller turns into an ERROR message for the driver."""

from __future__ import annotations

from yatt_graph import NodeExecutionError

__all__ = ["ControllerError", "HandshakeError", "NodeTimeoutError"]


class ControllerError(RuntimeError):
    """A controller died, went silent, or failed outside a node; names it and its nodes."""

    def __init__(self, message: str, controller: int = -1, nodes: list[str] | None = None):
        super().__init__(message)
        self.controller, self.nodes = controller, list(nodes or [])


class HandshakeError(ControllerError):
    """A controller that could not join: protocol mismatch, timeout, or exit during start-up."""


class NodeTimeoutError(NodeExecutionError):
    """A node call ran past its timeout; ``context`` has step, controller, seconds and limit_s."""


class SendError(Exception):
    """In a controller: an output, graph output or state that could not go out (it does not
    encode, or is over ``max_message_bytes``); sent to the driver as an ERROR naming ``node``,
    ``step`` and ``during`` ("send", "state"). Never reaches user code as such."""

    def __init__(self, node: str, step: int, message: str, during: str = "send"):
        super().__init__(message)
        self.node, self.step, self.message, self.during = node, step, message, during
