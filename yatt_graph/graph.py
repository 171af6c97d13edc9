"""Graph: a typed DAG of nodes, declared in Python and checked before anything runs.

::

    with Graph("toy") as g:
        batch = source()
        emb = encoder(batch.images)
        ...
        g.output("metrics", update(...).metrics)

Calling a node inside the ``with`` block adds it and returns a :class:`Handle` (one
output) or an :class:`Outputs` (several). Leaving the block validates the graph.

Edges may carry a ``delay`` of one step: the value produced at step k is consumed at
step k+1 (weight sync from the update back to the rollout is the usual case). Delayed
edges are drawn but are not part of the DAG, so they do not form cycles, and their
input must be optional (it is None at step 0).
"""

from __future__ import annotations

import contextvars
import hashlib
import warnings
from collections.abc import Iterator
from typing import Any

import msgspec
import networkx as nx

from yatt_graph import checks
from yatt_graph.errors import (
    DuplicateNodeError,
    GraphError,
    GraphValidationError,
    UnusedOutputWarning,
)
from yatt_graph.node import Node
from yatt_graph.types import PortSpec

__all__ = ["Edge", "Graph", "Handle", "Outputs"]

_current: contextvars.ContextVar[tuple[Graph, ...]] = contextvars.ContextVar(
    "yatt_graph_stack", default=()
)


class Handle(msgspec.Struct, frozen=True):
    """One output port of one node in a graph: what node calls return and take."""

    node: str
    port: str
    spec: PortSpec

    def __repr__(self) -> str:
        return f"Handle({self.node}.{self.port}: {self.spec})"


class Outputs:
    """The outputs of a node with several: ``out.logprobs``, ``out["logprobs"]``, or unpacking."""

    def __init__(self, handles: dict[str, Handle]):
        self._handles = handles

    def __getattr__(self, name: str) -> Handle:
        try:
            return self._handles[name]
        except KeyError:
            raise AttributeError(
                f"node {next(iter(self._handles.values())).node!r} has no output {name!r}; "
                f"its outputs are {sorted(self._handles)}"
            ) from None

    __getitem__ = __getattr__

    def __iter__(self) -> Iterator[Handle]:
        return iter(self._handles.values())

    def __len__(self) -> int:
        return len(self._handles)

    def __repr__(self) -> str:
        return f"Outputs({', '.join(map(repr, self._handles.values()))})"


class Edge(msgspec.Struct, frozen=True, omit_defaults=True):
    """A connection from one node's output port to another node's input port."""

    src: str
    src_port: str
    dst: str
    dst_port: str
    delay: int = 0
    """0: same step. 1: the value from step k feeds step k+1."""


class _Shown:
    """What a graph and a plan share: JSON, equality by :meth:`spec`, a text listing, Mermaid
    and pictures, each of :meth:`_drawn` (the graph, and the plan or None)."""

    def to_json(self) -> bytes:
        from yatt_graph.serialize import encode

        return encode(self.spec())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, type(self)) and self.spec() == other.spec()

    __hash__ = None  # type: ignore[assignment]

    def to_text(self) -> str:
        from yatt_graph.render import to_text

        return to_text(*self._drawn())

    def to_mermaid(self) -> str:
        from yatt_graph.render import to_mermaid

        return to_mermaid(*self._drawn())

    def __str__(self) -> str:
        return self.to_text()

    def draw(self, path: str | None = None, fmt: str | None = None) -> bytes:
        """Render to SVG or PNG bytes (and write them to ``path`` if given)."""
        from yatt_graph.render import draw

        return draw(*self._drawn(), path=path, fmt=fmt)

    def _repr_svg_(self) -> str:
        return self.draw(fmt="svg").decode()


class Graph(_Shown):
    """A typed dataflow graph, backed by a networkx ``MultiDiGraph`` (one edge per port pair)."""

    def __init__(self, name: str = "graph"):
        self.name = name
        self.nodes: dict[str, Node] = {}
        self.dag = nx.MultiDiGraph()
        self.graph_outputs: dict[str, Handle] = {}
        self.discarded: list[Handle] = []
        self._token: contextvars.Token[tuple[Graph, ...]] | None = None
        # Connections refused while declaring, kept for validate() to report all at once:
        # (the error, the input it was meant to feed).
        self._refused: list[tuple[GraphError, tuple[str, str]]] = []

    # --- declaration ----------------------------------------------------------------
    @staticmethod
    def current() -> Graph | None:
        stack = _current.get()
        return stack[-1] if stack else None

    def __enter__(self) -> Graph:
        self._token = _current.set((*_current.get(), self))
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self._token is not None
        _current.reset(self._token)
        self._token = None
        if exc_type is None:
            self.validate()

    def add(self, node: Node, *args: Any, **kwargs: Any) -> Handle | Outputs:
        """Add a node and connect the handles given for its inputs (positionally, or by name)."""
        if not isinstance(node, Node):
            raise TypeError(f"Graph.add expects a Node, got {type(node).__name__}")
        existing = self.nodes.get(node.name)
        if existing is not None:
            what = "is already in" if existing is node else "has the same name as another node in"
            raise DuplicateNodeError(
                f"node {node.name!r} ({type(node).__name__}) {what} graph {self.name!r} "
                f"(first: {type(existing).__name__}); give it another name, e.g. "
                f"node.renamed('{node.name}_2') or fn(..., name='{node.name}_2')"
            )
        names = list(node.inputs)
        if len(args) > len(names):
            raise TypeError(
                f"node {node.name!r} takes {len(names)} inputs {names}, {len(args)} were given"
            )
        bound = dict(zip(names, args))
        unknown = []
        for key, value in kwargs.items():
            if key not in node.inputs:
                if not (self._declaring and isinstance(value, Handle)):
                    raise TypeError(
                        f"node {node.name!r} has no input {key!r}; its inputs are {names}"
                    )
                unknown.append((value, key))
                continue
            if key in bound:
                raise TypeError(f"node {node.name!r}: input {key!r} given twice")
            bound[key] = value
        self.nodes[node.name] = node
        self.dag.add_node(node.name)
        try:
            for port, handle in bound.items():
                if handle is not None:
                    self.connect(handle, node, port)
        except Exception:
            self.remove(node.name)
            raise
        for handle, key in unknown:
            self._refuse(checks.connection_problem(self, handle, node.name, key, 0), node.name, key)
        handles = {p: Handle(node.name, p, port.spec) for p, port in node.outputs.items()}
        if len(handles) == 1:
            return next(iter(handles.values()))
        return Outputs(handles)

    def remove(self, name: str) -> None:
        self.nodes.pop(name, None)
        if name in self.dag:
            self.dag.remove_node(name)

    def connect(self, src: Handle, dst: Node | str, port: str, *, delay: int = 0) -> Edge | None:
        """Connect an output handle to ``dst``'s input ``port``.

        Outside a ``with`` block a bad connection raises at once. Inside one it is refused
        (None is returned) and reported by ``validate()`` with every other error of the graph.
        """
        if not isinstance(src, Handle):
            raise TypeError(
                f"input {port!r} of node {getattr(dst, 'name', dst)!r} must be a Handle returned by "
                f"a node call in this graph, got {type(src).__name__}"
            )
        dst_name = dst if isinstance(dst, str) else dst.name
        if delay not in (0, 1):
            raise ValueError(f"edge delay must be 0 or 1, got {delay}")
        problem = checks.connection_problem(self, src, dst_name, port, delay)
        if problem is not None:
            if not self._declaring:
                raise problem
            self._refuse(problem, dst_name, port)
            return None
        edge = Edge(src.node, src.port, dst_name, port, delay)
        self.dag.add_edge(src.node, dst_name, key=(src.port, port), edge=edge)
        return edge

    def output(self, name: str, handle: Handle) -> None:
        """Mark a handle as a result of the graph (returned by executors, and not 'unused')."""
        if name in self.graph_outputs:
            raise ValueError(f"graph {self.name!r} already has an output named {name!r}")
        self.graph_outputs[name] = handle

    def discard(self, *handles: Handle) -> None:
        """Mark outputs as deliberately unused, so validation does not warn about them."""
        for handle in handles:
            if not isinstance(handle, Handle):
                raise TypeError(f"Graph.discard takes handles, got {type(handle).__name__}")
            if handle not in self.discarded:
                self.discarded.append(handle)

    # --- queries ------------------------------------------------------------------------
    @property
    def edges(self) -> list[Edge]:
        return [data["edge"] for _, _, data in self.dag.edges(data=True)]

    def step_dag(self) -> nx.MultiDiGraph:
        """The graph without delayed edges: what must be acyclic within one step."""
        view = nx.MultiDiGraph()
        view.add_nodes_from(self.dag.nodes)
        view.add_edges_from(
            (u, v, k, d)
            for u, v, k, d in self.dag.edges(keys=True, data=True)
            if not d["edge"].delay
        )
        return view

    def topological_order(self) -> list[str]:
        """Node names in an order where every producer comes before its consumers (stable)."""
        self._check_acyclic()
        index = {name: i for i, name in enumerate(self.nodes)}
        return list(nx.lexicographical_topological_sort(self.step_dag(), key=index.__getitem__))

    def inputs_of(self, name: str) -> list[Edge]:
        return [d["edge"] for _, _, d in self.dag.in_edges(name, data=True)]

    def outputs_of(self, name: str) -> list[Edge]:
        return [d["edge"] for _, _, d in self.dag.out_edges(name, data=True)]

    # --- validation -----------------------------------------------------------------------
    def _check_acyclic(self) -> None:
        cycles = checks.find_cycles(self)
        if cycles:
            raise cycles[0]

    @property
    def _declaring(self) -> bool:
        return self._token is not None

    def _refuse(self, problem: GraphError | None, dst: str, port: str) -> None:
        if problem is not None:
            self._refused.append((problem, (dst, port)))

    def problems(self) -> list[GraphError]:
        """Every error of the graph, in declaration order: refused connections, cycles without a
        delay, required inputs fed by nothing, and shape conflicts."""
        refused = [p for p, _ in self._refused]
        skip = {where for _, where in self._refused}
        return [
            *refused,
            *checks.find_cycles(self),
            *checks.find_missing_inputs(self, skip),
            *checks.find_shape_conflicts(self),
        ]

    def validate(self) -> list[str]:
        """Check the whole graph and raise one ``GraphValidationError`` listing every error;
        warn about (and return) the outputs that feed nothing."""
        problems = self.problems()
        if problems:
            raise GraphValidationError(self.name, problems)
        messages = checks.unused_outputs(self)
        for msg in messages:
            warnings.warn(msg, UnusedOutputWarning, stacklevel=3)
        return messages

    # --- planning, pictures, serialization -------------------------------------------------
    def wiring_digest(self) -> str:
        """A hash of the graph's edges and outputs: a graph rebuilt in another process must
        give the same one (node classes and configurations are not part of it)."""
        wiring = sorted((e.src, e.src_port, e.dst, e.dst_port, e.delay) for e in self.edges)
        outs = sorted((k, h.node, h.port) for k, h in self.graph_outputs.items())
        return hashlib.sha256(msgspec.json.encode([wiring, outs])).hexdigest()[:16]

    def plan(self, controllers: int = 1, placement: dict[str, int | str] | None = None) -> Any:
        """Partition the graph into ``controllers`` subgraphs (see :class:`yatt_graph.plan.Plan`)."""
        from yatt_graph.plan import Plan

        return Plan.build(self, controllers, placement)

    def spec(self) -> Any:
        from yatt_graph.serialize import graph_spec

        return graph_spec(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> Graph:
        from yatt_graph.serialize import graph_from_json

        return graph_from_json(data)

    def _drawn(self) -> tuple[Graph, Any]:
        return self, None

    def __repr__(self) -> str:
        return f"<Graph {self.name!r}: {len(self.nodes)} nodes, {self.dag.number_of_edges()} edges>"
