"""The runtime's errors: raised in the driver (re-exported by :mod:`runtime.zmq.driver`),
the one a controller turns into an ERROR message for the driver, and :class:`ProcessFault`,
the one class of "a process of the run died or went silent" that ``--restart on-failure``
restarts from (a controller's :class:`ControllerError`, a replica process's
:class:`~runtime.zmq.replicas.ReplicaDied`, a training rank's
:class:`~runtime.ranks.group.RankError`)."""

from __future__ import annotations

from yatt_graph import NodeExecutionError

__all__ = ["ControllerError", "HandshakeError", "NodeTimeoutError", "ProcessFault", "ProtocolError"]


class ProcessFault(RuntimeError):
    """A process of the run died or went silent (a controller, a replica process, a training
    rank): not the node's logic, so ``--restart on-failure`` restarts the run from its last
    checkpoint. ``controller`` is the controller it concerns (-1: none, or the driver's own
    process) and ``nodes`` the nodes it ran. Told apart from other errors by ``isinstance``
    only, in a :class:`~yatt_graph.NodeExecutionError`'s ``__cause__`` as well."""

    def __init__(self, message: str, controller: int = -1, nodes: list[str] | None = None):
        super().__init__(message)
        self.controller, self.nodes = controller, list(nodes or [])


class ControllerError(ProcessFault):
    """A controller died, went silent, or failed outside a node; names it and its nodes."""


class HandshakeError(ControllerError):
    """A controller that could not join: protocol mismatch, timeout, or exit during start-up.
    The one fault that is never restarted: a second start would fail the same way."""


class ProtocolError(ValueError):
    """A message that does not decode: wrong kind byte or tag, bad header, or a foreign
    sender (the controllers' protocol, :mod:`runtime.zmq.messages`, and the child processes',
    :class:`runtime.children.Messages`)."""


class NodeTimeoutError(NodeExecutionError):
    """A node call ran past its timeout; ``context`` has step, controller, seconds and limit_s."""


class SendError(Exception):
    """In a controller: an output, graph output or state that could not go out (it does not
    encode, or is over ``max_message_bytes``); sent to the driver as an ERROR naming ``node``,
    ``step`` and ``during`` ("send", "state"). Never reaches user code as such."""

    def __init__(self, node: str, step: int, message: str, during: str = "send"):
        super().__init__(message)
        self.node, self.step, self.message, self.during = node, step, message, during
