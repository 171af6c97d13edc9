"""Executors for yatt-graph plans: in-process (the reference semantics) and ZeroMQ.

Every name loads on first use, so that ``import runtime`` (and the ``yatt-graph`` command
before it knows what to run) stays light: no torch until an executor is needed, and a
controller process started with ``python -m runtime.zmq.controller_main`` is not imported twice.
"""

from typing import Any

__all__ = [
    "ControllerError",
    "HandshakeError",
    "LocalExecutor",
    "ProcessFault",
    "StepResult",
    "ZmqExecutor",
]

_ZMQ = {"ControllerError", "HandshakeError", "ZmqExecutor"}
_LOCAL = {"LocalExecutor", "StepResult"}


def __getattr__(name: str) -> Any:
    if name in _ZMQ:
        from runtime.zmq import driver

        return getattr(driver, name)
    if name == "ProcessFault":
        from runtime.errors import ProcessFault

        return ProcessFault
    if name in _LOCAL:
        from runtime.engine import engine as local

        return getattr(local, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
