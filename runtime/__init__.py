"""Executors for yatt-graph plans: in-process (the reference semantics) and ZeroMQ.

The ZeroMQ names load on first use, so that ``import runtime`` stays light and a
controller process started with ``python -m runtime.zmq.controller_main`` is not imported twice.
"""

from typing import Any

from runtime.engine.local import LocalExecutor, StepResult, describe

__all__ = [
    "ControllerError",
    "HandshakeError",
    "LocalExecutor",
    "StepResult",
    "ZmqExecutor",
    "describe",
]

_LAZY = {"ControllerError", "HandshakeError", "ZmqExecutor"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from runtime.zmq import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
