"""Nodes: units of work with typed ports and a batch policy, declared cheaply and built in setup().

Two ways to declare one:

* a class, for stateful nodes (models, optimizers)::

    class Scale(Node):
        kind = "function"
        inputs = {"x": Tensor("float32", "B")}
        outputs = {"y": Tensor("float32", "B")}

        def __init__(self, factor: float = 2.0, name: str | None = None):
            super().__init__(name=name)
            self.factor = factor

        def forward(self, x):
            return {"y": x * self.factor}

* the :func:`node` decorator on a plain function::

    @node(outputs={"y": Tensor("float32", "B")})
    def double(x: Tensor("float32", "B")):
        return {"y": 2 * x}

Either is callable alone with :meth:`Node.run` (no graph, no runtime), which checks
the inputs against the ports; that is how nodes are unit-tested.
"""

from __future__ import annotations

import copy
import inspect
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec

from yatt_graph.errors import NodeInputError, NodeOutputError
from yatt_graph.stream import Piece, check_piece, join_pieces
from yatt_graph.types import PortSpec, check_value, spec_of

__all__ = ["BatchPolicy", "Built", "Node", "Port"]


class BatchPolicy(msgspec.Struct, frozen=True, omit_defaults=True):
    """How the scheduler may batch requests for a node (the knobs of a dynamic batcher)."""

    max_batch_size: int = 0
    """Most samples in one call; 0 means no limit."""
    max_tokens: int = 0
    """Most tokens (by the node's cost function) in one call; 0 means no limit."""
    splittable: bool = True
    """Whether a call may be cut into pieces across workers (slots, replicas)."""
    timeout_s: float = 0.0
    """Longest one call may run before it is reported as hung; 0 means no limit."""
    max_queue_delay_s: float = 0.0
    """For a consumer fed piece by piece from a stream (:mod:`yatt_graph.stream`): the longest
    the first queued piece waits for more to fuse with (up to ``max_batch_size`` samples and
    ``max_tokens``) before the node is called on what is there; 0: at once."""
    replicas: int = 1
    """Copies of the node the executor runs, each on its own cores or device; a step's batch
    is cut across them by cost (inference nodes: the rollout and the splittable ones)."""

    def verify(self) -> BatchPolicy:
        for field in ("max_batch_size", "max_tokens", "timeout_s", "max_queue_delay_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"BatchPolicy.{field} must be >= 0, got {getattr(self, field)}")
        if self.replicas < 1:
            raise ValueError(f"BatchPolicy.replicas must be >= 1, got {self.replicas}")
        return self


class Port(msgspec.Struct, frozen=True, omit_defaults=True):
    """A named input or output with a type."""

    spec: PortSpec
    required: bool = True
    """An input that must be connected (outputs are always required to be produced)."""
    doc: str = ""


class Built:
    """A node attribute that :meth:`Node.build` sets; reading it sets the node up first.

    Declare a node's models, optimizers and tokenizers with it (``policy = Built("the
    policy")``): a constructed node then holds none of them, and code that reads
    ``node.policy`` (a test, a notebook, the node's own ``forward``) gets the built one.
    The value lives in the instance's ``__dict__`` under the same name.
    """

    def __init__(self, doc: str = "") -> None:
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        values = obj.__dict__
        if self.name not in values:
            if values.get("_building"):
                raise AttributeError(
                    f"node {obj.name!r}: build() read {self.name!r} before setting it"
                )
            obj.setup()
            if self.name not in values:
                raise AttributeError(f"{type(obj).__name__}.build() did not set {self.name!r}")
        return values[self.name]

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value


# One lock for every node's setup: two threads that run one node at once build it once.
_setup_lock = threading.RLock()


def _as_port(decl: Any) -> Port:
    return decl if isinstance(decl, Port) else Port(spec_of(decl))


def _snake(name: str) -> str:
    """``GAEAdvantage`` -> ``gae_advantage``, ``ToySource`` -> ``toy_source``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


class Node:
    """Base class of every node. Subclasses declare ``inputs``/``outputs`` and ``forward``."""

    kind: str = "function"
    """What the node does, for pictures: data, encoder, rollout, reward, reference, critic,
    advantage, update, sync, function."""
    # Declared on the class as specs or Ports; normalized to Ports per instance.
    inputs: dict[str, Port] = {}
    outputs: dict[str, Port] = {}
    batch_policy: BatchPolicy = BatchPolicy()
    device: Any = "cpu"
    """Where the node computes (a torch device or its name). A node on a GPU sets it and
    returns its outputs there; an executor hands a node CUDA tensors only when this is a CUDA
    device, and host copies otherwise (``runtime/engine/calls.py``)."""
    placement: str | int | None = None
    """A controller hint: an int controller index or a group name; None lets the plan decide."""
    step: int = 0
    """The step being run, set by the executor before each call (seed per-step randomness from it)."""
    left_padded: tuple[str, ...] = ()
    """Outputs padded on the left (prompt ids), for joining the rows of a cut call."""
    ranks: int = 1
    """Processes that run this node together as one SPMD group (torch.distributed). Above 1, the
    executor starts the group (``runtime.ranks``) and sets :attr:`rank_group` before
    :meth:`setup`; each other rank rebuilds the node, and the executor runs every call,
    ``state_dict``, ``load_state_dict``, ``offload`` and ``reload`` on all of them alike, so the
    node's code is SPMD: it calls collectives and commands no process."""
    rank_timeout_s: float = 300.0
    """How long the group's start and each of its collectives may take."""
    rank_with: str | None = None
    """The node whose rank group this one joins (its ``ranks`` the same): the plan puts it
    on that node's controller, and each rank holds a model of both (a reference sharded
    over the update's ranks)."""
    rank_group: Any = None
    """This process's side of the group (rank, world, collectives, sharding), or None."""
    execution_options: tuple[str, ...] = ()
    """Constructor options that choose how the node runs, not what it computes (a run's
    identity leaves them out, so a resume may change them: an update's ``ranks``)."""
    rows_per_input: int = 1
    """Output rows per input row (a rollout's samples per prompt), for cost estimates."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Node:
        self = super().__new__(cls)
        # Remember how the node was made, so that a plan can rebuild it in another process.
        self._init_args = (args, dict(kwargs))
        self.name = _snake(cls.__name__)
        self.inputs = {k: _as_port(v) for k, v in type(self).inputs.items()}
        self.outputs = {k: _as_port(v) for k, v in type(self).outputs.items()}
        return self

    def __init__(
        self,
        name: str | None = None,
        *,
        placement: str | int | None = None,
        batch_policy: BatchPolicy | None = None,
    ) -> None:
        if name is not None:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"node name {name!r} must be a Python identifier")
            self.name = name
        if placement is not None:
            self.placement = placement
        if batch_policy is not None:
            self.batch_policy = batch_policy.verify()

    # --- building -------------------------------------------------------------------
    def setup(self) -> None:
        """Build what the node needs to run (models, optimizers, tokenizers): :meth:`build`.

        Idempotent: the first call builds, later ones return at once. The executor that owns
        the node calls it; :meth:`run`, :meth:`run_stream` and every :class:`Built`
        attribute call it too, so a node made in a test or a notebook runs as it is.
        """
        if self.__dict__.get("_built"):
            return
        with _setup_lock:
            if self.__dict__.get("_built"):
                return
            self._building = True
            try:
                self.build()
            finally:
                del self._building
            self._built = True

    def build(self) -> None:
        """Build the node's models from the configuration ``__init__`` recorded.

        Called once, by :meth:`setup`. A node with models overrides it and keeps ``__init__``
        cheap (record and check the options, build nothing), so that declaring a graph, or
        holding it in a process that runs none of its nodes, costs no model. Nodes without
        models keep this one, which does nothing.
        """

    @property
    def is_set_up(self) -> bool:
        """Whether :meth:`setup` has built the node."""
        return bool(self.__dict__.get("_built"))

    # --- the work -----------------------------------------------------------------
    def forward(self, **inputs: Any) -> Mapping[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must define forward(**inputs)")

    def forward_stream(self, **inputs: Any) -> Iterator[tuple[list[int], Mapping[str, Any]]]:
        """Optional: yield ``(rows, outputs)`` pieces as samples finish (:mod:`yatt_graph.stream`).

        A node that defines it *streams*: executors run it through :meth:`run_stream` and
        hand each piece downstream at once. Its ``forward`` may be left out; ``run`` then
        joins the pieces.
        """
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    @property
    def streaming(self) -> bool:
        """Whether the node defines :meth:`forward_stream`."""
        return type(self).forward_stream is not Node.forward_stream

    def _inputs(self, inputs: Mapping[str, Any] | None, kw: Mapping[str, Any], check: bool):
        """The call's values (missing optional ports as None) and the checked symbol sizes."""
        values = {**(inputs or {}), **kw}
        if not values.keys() <= self.inputs.keys() and (
            unknown := sorted(set(values) - set(self.inputs))
        ):
            raise NodeInputError(
                f"node {self.name!r}: unknown input(s) {unknown}; its inputs are {sorted(self.inputs)}"
            )
        bindings: dict[str, int] = {}
        for port_name, port in self.inputs.items():
            if port_name not in values or values[port_name] is None:
                if port.required:
                    raise NodeInputError(
                        f"node {self.name!r}: required input {port_name!r} ({port.spec}) was not given"
                    )
                values[port_name] = None
                continue
            if check and (why := check_value(port.spec, values[port_name], bindings)):
                raise NodeInputError(f"node {self.name!r}: input {port_name!r}: {why}")
        return values, bindings

    def _call(self, fn: Callable[..., Any], values: dict[str, Any]) -> Any:
        try:
            return fn(**values)
        except ValueError as exc:
            # A check deep in a helper knows the argument, not the node: add the node.
            if type(exc) is ValueError and f"node {self.name!r}" not in str(exc):
                raise ValueError(f"node {self.name!r}: {exc}") from exc
            raise

    def run(
        self, inputs: Mapping[str, Any] | None = None, /, *, check: bool = True, **kw: Any
    ) -> dict[str, Any]:
        """Run the node alone: check inputs against the ports, call forward, check outputs.

        A streaming node without its own ``forward`` runs its stream and joins the pieces.
        """
        self.setup()
        if type(self).forward is Node.forward and self.streaming:
            pieces = list(self.run_stream(inputs, check=check, **kw))
            return self._check_outputs(join_pieces(pieces, self.name), None)
        values, bindings = self._inputs(inputs, kw, check)
        return self._check_outputs(self._call(self.forward, values), bindings if check else None)

    def run_stream(
        self, inputs: Mapping[str, Any] | None = None, /, *, check: bool = True, **kw: Any
    ) -> Iterator[Piece]:
        """Run a streaming node: check the inputs, then yield its checked pieces in order."""
        self.setup()
        values, _ = self._inputs(inputs, kw, check)
        seen: set[int] = set()
        stream = self._call(self.forward_stream, values)
        size = None
        try:
            for index, piece in enumerate(stream):
                checked = check_piece(self.name, self.outputs, piece, seen, index, size=size)
                size = checked.size
                yield checked
        finally:
            close = getattr(stream, "close", None)
            if close is not None:  # stopped early (an error, a consumer that quit): end it now
                close()

    def _check_outputs(self, result: Any, bindings: dict[str, int] | None) -> dict[str, Any]:
        if not isinstance(result, Mapping):
            if len(self.outputs) == 1:
                result = {next(iter(self.outputs)): result}
            else:
                raise NodeOutputError(
                    f"node {self.name!r}: forward returned {type(result).__name__}; "
                    f"return a dict with keys {sorted(self.outputs)}"
                )
        if result.keys() != self.outputs.keys():
            missing = sorted(set(self.outputs) - set(result))
            extra = sorted(set(result) - set(self.outputs))
            raise NodeOutputError(
                f"node {self.name!r}: forward returned keys {sorted(result)}; "
                f"declared outputs are {sorted(self.outputs)} (missing {missing}, unexpected {extra})"
            )
        if bindings is not None:
            for port_name, port in self.outputs.items():
                if why := check_value(port.spec, result[port_name], bindings):
                    raise NodeOutputError(f"node {self.name!r}: output {port_name!r}: {why}")
        return dict(result)

    # --- what the executor's fan-out asks of a node (runtime/sched: splitting, replicas) ------
    def bind_executor(self, *, max_staleness: int, shared: dict[str, Any]) -> None:
        """Told by an in-process executor before :meth:`setup`: the run's staleness and its
        registry of models that nodes may share (nodes/shared_models.py). Nothing by default."""

    def piece_context(self) -> dict[str, int] | None:
        """What every copy of the node needs to run a piece of this step's call as the step's
        own (a rollout: its call count and first group label), or None when a piece is any
        part of a batch (a per-sample scorer). With a context, :meth:`begin_piece` and
        :meth:`end_piece` frame each piece and :meth:`end_pieces` closes the step."""
        return None

    def begin_piece(self, context: Mapping[str, int], rows: Any) -> None:
        """The next call is the piece of the step ``context`` began holding input ``rows``."""

    def end_piece(self) -> None:
        """The piece that :meth:`begin_piece` began is done."""

    def end_pieces(self, context: Mapping[str, int], size: int) -> None:
        """Every piece of the step that ``context`` began (``size`` input rows) is in."""

    def pad_values(self) -> dict[str, float]:
        """Each ragged output's pad value where it is not 0, for joining the rows of a cut call."""
        return {}

    def begin_step(self, step: int) -> None:
        """Called by executors before each call; nodes seed per-step randomness from ``self.step``."""
        self.step = step

    def memory(self, load: Any) -> dict[str, int]:
        """Bytes this node will hold for one step's ``load``, by part (weights, optimizer,
        gradients, activations, ...), before it is built: what a memory plan adds up per
        device (``nodes/memory.py`` defines the load and the parts). Nodes that hold no model
        keep this one, which says nothing."""
        return {}

    # --- the device, when roles take turns on it ---------------------------------------------
    def offload(self) -> int:
        """Move the node's device state (weights, buffers, optimizer state) off its device,
        for another role to use it; returns the bytes moved. Executors call it when roles
        time-share a device (``offload=``), and :meth:`reload` before the node's next call.
        Idempotent. Nodes without device state keep this one, which does nothing."""
        return 0

    def reload(self) -> int:
        """Bring back what :meth:`offload` moved (returns the bytes moved); idempotent."""
        return 0

    def claim(self) -> None:
        """Say, moving nothing, that this node's device state is needed next: state it shares
        with a node offloaded meanwhile (one policy under a rollout and an update) then
        stays, and :meth:`reload` moves only the rest. A no-op by default."""

    # --- state, for checkpoints and weight sync ----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The node's mutable state (weights, optimizer, RNG); empty for stateless nodes."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise NotImplementedError(f"{type(self).__name__} has no state to load")

    # --- declaration in a graph ----------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from yatt_graph.graph import Graph

        graph = Graph.current()
        if graph is None:
            raise RuntimeError(
                f"node {self.name!r} was called outside a graph; declare it inside "
                "`with Graph('name') as g:`, or run it alone with node.run({...})"
            )
        return graph.add(self, *args, **kwargs)

    def renamed(self, name: str) -> Node:
        """A shallow copy under another name (to use the same node twice in a graph)."""
        other = copy.copy(self)
        other.name = name
        other._init_args = (self._init_args[0], {**self._init_args[1], "name": name})
        return other

    def configure(self, **options: Any) -> Node:
        """Set constructor options after construction, as attributes of the same names, and
        record them in :meth:`config` (the node's rebuilds keep them); the node itself."""
        for key, value in options.items():
            setattr(self, key, value)
        self._init_args = (self._init_args[0], {**self._init_args[1], **options})
        return self

    def config(self) -> dict[str, Any]:
        """The constructor arguments, by name, that rebuild this node."""
        args, kwargs = self._init_args
        try:
            bound = inspect.signature(type(self)).bind(*args, **kwargs)
        except TypeError:
            return dict(kwargs)
        config = dict(bound.arguments)
        for key, param in inspect.signature(type(self)).parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD and key in config:
                config.update(config.pop(key))
        config["name"] = self.name
        return config

    @property
    def ref(self) -> str:
        from yatt_graph.refs import ref_of

        return ref_of(type(self))

    @property
    def label(self) -> str:
        """What made the node, for listings and pictures: its class, or @function."""
        return type(self).__name__

    def signature(self) -> str:
        ins = ", ".join(f"{k}: {p.spec}{'' if p.required else '?'}" for k, p in self.inputs.items())
        outs = ", ".join(f"{k}: {p.spec}" for k, p in self.outputs.items())
        return f"({ins}) -> ({outs})"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.kind} {self.signature()}>"
