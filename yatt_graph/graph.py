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

The checks behind :meth:`Graph.validate` each return every problem they find, none stopping
at the first; every message starts with the edge it is about (``src.port -> dst.port``;
``? -> dst.port`` for an input that nothing feeds), then says what is wrong and how to fix it.
"""

from __future__ import annotations

import contextvars
import hashlib
import warnings
from collections.abc import Iterator
from typing import Any

import msgspec
import networkx as nx

from yatt_graph.errors import (
    CycleError,
    DuplicateNodeError,
    GraphError,
    GraphLookupError,
    GraphValidationError,
    MissingInputError,
    PortTypeError,
    ShapeError,
    UnusedOutputWarning,
)
from yatt_graph.node import Node
from yatt_graph.types import PortSpec, TensorSpec, compatible

__all__ = [
    "Edge",
    "Graph",
    "Handle",
    "Outputs",
    "connection_problem",
    "find_cycles",
    "find_missing_inputs",
    "find_shape_conflicts",
    "unused_outputs",
]

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
            self._refuse(connection_problem(self, handle, node.name, key, 0), node.name, key)
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
        problem = connection_problem(self, src, dst_name, port, delay)
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
        cycles = find_cycles(self)
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
            *find_cycles(self),
            *find_missing_inputs(self, skip),
            *find_shape_conflicts(self),
        ]

    def validate(self) -> list[str]:
        """Check the whole graph and raise one ``GraphValidationError`` listing every error;
        warn about (and return) the outputs that feed nothing."""
        problems = self.problems()
        if problems:
            raise GraphValidationError(self.name, problems)
        messages = unused_outputs(self)
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


def _kind(why: str) -> str:
    """The word for what ``types.compatible`` found: dtype, shape or type."""
    if why.startswith("dtype"):
        return "dtype"
    if why.startswith(("rank", "dimension")):
        return "shape"
    return "type"


def connection_problem(
    graph: Graph, src: Handle, dst_name: str, port: str, delay: int
) -> GraphError | None:
    """Why ``src`` cannot feed ``dst_name.port``, or None when it can."""
    edge = f"{src.node}.{src.port} -> {dst_name}.{port}"
    if src.node not in graph.nodes:
        return GraphLookupError(
            f"{edge}: unknown node: node {src.node!r} is not in graph {graph.name!r}. "
            "Fix: declare it in this graph (inside its `with` block) before using its outputs"
        )
    if dst_name not in graph.nodes:
        return GraphLookupError(
            f"{edge}: unknown node: node {dst_name!r} is not in graph {graph.name!r}; add it first"
        )
    dst_node = graph.nodes[dst_name]
    if port not in dst_node.inputs:
        return GraphLookupError(
            f"{edge}: unknown port: node {dst_name!r} has no input {port!r}; its inputs are "
            f"{sorted(dst_node.inputs)}. Fix: use one of those names"
        )
    src_port = graph.nodes[src.node].outputs.get(src.port)
    if src_port is None:
        return GraphLookupError(
            f"{edge}: unknown port: node {src.node!r} has no output {src.port!r}; its outputs are "
            f"{sorted(graph.nodes[src.node].outputs)}"
        )
    dst_port = dst_node.inputs[port]
    why = compatible(src_port.spec, dst_port.spec)
    if why:
        return PortTypeError(
            f"{src.node}.{src.port} ({src_port.spec}) -> {dst_name}.{port} ({dst_port.spec}): "
            f"{_kind(why)} mismatch: {why}. Fix: make {src.node!r} produce {dst_port.spec}, "
            "or convert the value with a node in between"
        )
    for other in graph.inputs_of(dst_name):
        if other.dst_port == port:
            return PortTypeError(
                f"{edge}: input {dst_name}.{port} is already fed by {other.src}.{other.src_port}; "
                f"an input takes one edge, so {src.node}.{src.port} cannot feed it too"
            )
    if delay and dst_port.required:
        return MissingInputError(
            f"delayed edge {edge}: the input is empty at step 0, so {dst_name}.{port} must be "
            "optional (Port(spec, required=False))"
        )
    return None


def find_cycles(graph: Graph) -> list[CycleError]:
    """One cycle of non-delayed edges per strongly connected part of the step DAG."""
    step = graph.step_dag()
    index = {name: i for i, name in enumerate(graph.nodes)}
    problems = []
    parts = [sorted(p, key=index.__getitem__) for p in nx.strongly_connected_components(step)]
    for part in sorted(parts, key=lambda p: index[p[0]]):
        if len(part) == 1 and not step.has_edge(part[0], part[0]):
            continue
        cycle = nx.find_cycle(step.subgraph(part), source=part[0])
        names = [u for u, *_ in cycle] + [cycle[0][0]]
        edges = ", ".join(
            f"{e.src}.{e.src_port} -> {e.dst}.{e.dst_port}"
            for u, v, k in cycle
            for e in [step.get_edge_data(u, v, k)["edge"]]
        )
        problems.append(
            CycleError(
                f"{edges}: cycle without a delay: {' -> '.join(names)}. Fix: remove one edge, "
                "or mark the feedback edge as delayed: g.connect(handle, node, port, delay=1)",
                names,
            )
        )
    return problems


def _candidates(graph: Graph, name: str, spec: PortSpec) -> list[str]:
    """Outputs of other nodes that could feed an input of this spec (for the fix)."""
    found = []
    for other, node in graph.nodes.items():
        if other == name:
            continue
        for port, out in node.outputs.items():
            if compatible(out.spec, spec) is None:
                found.append(f"{other}.{port}")
    return found[:3]


def find_missing_inputs(graph: Graph, skip: set[tuple[str, str]]) -> list[MissingInputError]:
    """Required inputs that no edge feeds (``skip``: inputs whose edge was refused already)."""
    problems = []
    for name, node in graph.nodes.items():
        fed = {e.dst_port for e in graph.inputs_of(name)}
        for port, spec in node.inputs.items():
            if not spec.required or port in fed or (name, port) in skip:
                continue
            options = _candidates(graph, name, spec.spec)
            hint = f", e.g. {name}({port}={options[0]})" if options else ""
            problems.append(
                MissingInputError(
                    f"? -> {name}.{port}: missing required input: node {name!r}: required input "
                    f"{port!r} ({spec.spec}) is not connected. Fix: pass a handle for it{hint}, "
                    "or make it optional"
                )
            )
    return problems


def find_shape_conflicts(graph: Graph) -> list[ShapeError]:
    """Union-find over (node, symbol) with concrete sizes: a symbol may bind one int only."""
    parent: dict[tuple[str, str], tuple[str, str]] = {}
    size: dict[tuple[str, str], tuple[int, str]] = {}
    problems: list[ShapeError] = []

    def find(x: tuple[str, str]) -> tuple[str, str]:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def bind(sym: tuple[str, str], value: int, where: str) -> None:
        root = find(sym)
        if root in size and size[root][0] != value:
            problems.append(
                ShapeError(
                    f"{where}: shape mismatch: dimension {sym[1]} of node {sym[0]!r} is {value} "
                    f"here but {size[root][0]} at {size[root][1]}. Fix: make the shapes agree"
                )
            )
            return
        size.setdefault(root, (value, where))

    def union(a: tuple[str, str], b: tuple[str, str], where: str) -> None:
        ra, rb = find(a), find(b)
        if ra == rb:
            return
        parent[ra] = rb
        if ra not in size:
            return
        if rb in size and size[rb][0] != size[ra][0]:
            problems.append(
                ShapeError(
                    f"{where}: shape mismatch: it joins dimension {a[1]} of node {a[0]!r} "
                    f"({size[ra][0]}, set at {size[ra][1]}) with dimension {b[1]} of node "
                    f"{b[0]!r} ({size[rb][0]}, set at {size[rb][1]}). Fix: make the shapes agree"
                )
            )
            return
        size.setdefault(rb, size[ra])

    for e in graph.edges:
        s = graph.nodes[e.src].outputs[e.src_port].spec
        d = graph.nodes[e.dst].inputs[e.dst_port].spec
        if not (isinstance(s, TensorSpec) and isinstance(d, TensorSpec)):
            continue
        where = f"{e.src}.{e.src_port} -> {e.dst}.{e.dst_port}"
        for a, b in zip(s.shape, d.shape):
            if a == "*" or b == "*":
                continue
            if isinstance(a, str) and isinstance(b, str):
                union((e.src, a), (e.dst, b), where)
            elif isinstance(a, str):
                bind((e.src, a), b, where)  # type: ignore[arg-type]
            elif isinstance(b, str):
                bind((e.dst, b), a, where)
    return problems


def unused_outputs(graph: Graph) -> list[str]:
    """A message for each output that feeds nothing, is no graph output and was not discarded."""
    consumed = {(e.src, e.src_port) for e in graph.edges}
    consumed |= {(h.node, h.port) for h in graph.graph_outputs.values()}
    consumed |= {(h.node, h.port) for h in graph.discarded}
    messages = []
    for name, node in graph.nodes.items():
        for port, spec in node.outputs.items():
            if (name, port) not in consumed:
                messages.append(
                    f"graph {graph.name!r}: output {name}.{port} ({spec.spec}) is consumed by "
                    f"nothing; connect it, mark it with g.output('{port}', handle), or "
                    "g.discard(handle)"
                )
    return messages
