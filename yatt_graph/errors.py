"""Errors raised while building, checking or running graphs. Each says what, where and how to fix."""

from __future__ import annotations

__all__ = [
    "GraphError",
    "GraphLookupError",
    "GraphValidationError",
    "PortTypeError",
    "CycleError",
    "MissingInputError",
    "DuplicateNodeError",
    "ShapeError",
    "UnusedOutputWarning",
    "NodeInputError",
    "NodeOutputError",
    "NodeExecutionError",
    "NodeBuildError",
    "UsageError",
    "NodeUsageError",
    "build_error",
]


class UsageError(ValueError):
    """What the user gave is wrong: a flag, a folder, a checkpoint, a data row, a prompt too
    long for the model, a reward that is not a number. The message says what, where and how to
    fix it; ``yatt-graph`` shows it as one line with exit code 2 (a traceback is for bugs).
    It is the one class of the user's mistakes: a graph that cannot run as declared
    (:class:`GraphError`), a node that could not be built from what it was given
    (:class:`NodeBuildError`) or stopped on a bad input (:class:`NodeUsageError`, which a
    library node raising it while running becomes) are kinds of it."""


class GraphError(UsageError):
    """A graph that cannot run as declared."""


class GraphLookupError(GraphError, KeyError):
    """A node or port named in a connection does not exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class PortTypeError(GraphError, TypeError):
    """Two connected ports have incompatible types."""


class CycleError(GraphError):
    """The graph has a cycle of non-delayed edges."""

    def __init__(self, message: str, cycle: list[str]):
        super().__init__(message)
        self.cycle = cycle


class MissingInputError(GraphError):
    """A required input port is connected to nothing."""


class DuplicateNodeError(GraphError):
    """Two different nodes share a name."""


class ShapeError(GraphError):
    """Symbolic dimensions cannot be unified across the graph."""


class GraphValidationError(GraphError, ValueError):
    """Every error ``Graph.validate`` found, at once: ``errors`` holds one message each, and
    ``problems`` the errors themselves (a ``PortTypeError``, a ``CycleError``, ...)."""

    def __init__(self, graph: str, problems: list[GraphError]):
        self.graph = graph
        self.problems = list(problems)
        self.errors = [str(p) for p in self.problems]
        count = f"{len(self.errors)} error{'s' if len(self.errors) != 1 else ''}"
        lines = [f"graph {graph!r} has {count}:"]
        lines += [f"  {i}. {msg}" for i, msg in enumerate(self.errors, 1)]
        super().__init__("\n".join(lines))


class UnusedOutputWarning(UserWarning):
    """An output port feeds nothing and is not a graph output."""


class NodeInputError(ValueError):
    """A node was given inputs that do not fit its ports."""


class NodeOutputError(ValueError):
    """A node's forward returned something other than its declared outputs."""


class NodeExecutionError(RuntimeError):
    """A node raised while running; carries the node, its input shapes and the original traceback."""

    def __init__(self, node: str, message: str, remote_traceback: str = "", **context: object):
        super().__init__(message)
        self.node = node
        self.remote_traceback = remote_traceback
        self.context = context


class NodeBuildError(NodeExecutionError, UsageError):
    """A library node could not be built from what the user gave it (an option, a model
    folder, a data file): the user's to fix, reported in one line, in-process as on
    controllers."""


class NodeUsageError(NodeExecutionError, UsageError):
    """A node stopped on a :class:`UsageError`: the user's to fix, reported in one line with no
    traceback, in-process as on controllers."""


_BUG_TYPES = (AttributeError, NameError, AssertionError, IndexError, NotImplementedError,
              RecursionError, ZeroDivisionError, SyntaxError)  # fmt: skip
"""What a build raises when its own code is wrong, not its input."""

_LIBRARY = ("nodes", "graphs", "yatt_graph", "runtime")


def build_error(node: object, exc: BaseException) -> NodeBuildError | None:
    """The one-line :class:`NodeBuildError` for ``exc``, raised while ``node`` was built, when
    it is the input's fault: a library node (the user's own node classes keep their
    traceback) failing with anything but a programming error. None otherwise."""
    name = getattr(node, "name", "?")
    library = type(node).__module__.split(".")[0] in _LIBRARY
    if not library or not isinstance(exc, Exception) or isinstance(exc, _BUG_TYPES):
        return None
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = "; ".join(lines)
    if len(text) > 600:
        text = text[:600] + " ..."
    message = (
        f"node {name!r} ({type(node).__name__}) could not be built: {type(exc).__name__}: {text}"
    )
    return NodeBuildError(str(name), message)
