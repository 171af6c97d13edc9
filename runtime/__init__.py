"""Executors for yatt-graph plans: in-process (reference semantics) and, later, ZeroMQ."""

from runtime.local import LocalExecutor, StepResult, describe

__all__ = ["LocalExecutor", "StepResult", "describe"]
