"""Calling one node inside an executor: failures named, non-finite outputs caught.

Every executor calls a node through :func:`run_node` (or :func:`stream_node` for a streaming
node), so that a failure, wherever it runs, is a :class:`~yatt_graph.NodeExecutionError`
naming the node, its class, the step, the controller and the shapes of its inputs, with the
original traceback. A call, and the state and device operations, of a node trained as a rank
group reach every rank of it (:func:`node_op`).

With ``check_finite``, a float tensor output holding NaN or inf stops the run at the node
that produced it (naming the port, the count and the first sample), instead of a step later
deep inside whatever reads it (sampling's "invalid multinomial distribution").
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import torch

from yatt_graph import NodeExecutionError, NodeUsageError, UsageError
from yatt_graph.errors import build_error
from yatt_graph.stream import Piece

__all__ = [
    "Executor",
    "NodeWorkers",
    "OnStep",
    "Running",
    "StepResult",
    "Stop",
    "TensorMoves",
    "describe",
    "first_non_finite",
    "host_copy",
    "node_devices",
    "node_op",
    "on_cuda",
    "run_node",
    "stream_node",
]


@dataclass(frozen=True)
class Running:
    """The node call in progress, read by a watchdog thread for timeouts and heartbeats."""

    node: str
    step: int
    started: float
    """``time.monotonic()`` at the start of the call."""
    limit_s: float
    """Its time limit; 0: none."""


class StepResult(msgspec.Struct):
    """What one step of a graph produced (or, on a controller, of the nodes it owns)."""

    step: int
    outputs: dict[str, Any]
    """The graph's marked outputs, by name."""
    node_seconds: dict[str, float]
    """Wall time of each node's call."""
    node_start: dict[str, float] = {}
    """When each node's call began (``time.time()``, comparable across processes)."""
    node_controller: dict[str, int] = {}
    """The controller that ran each node."""
    staleness: dict[str, int | None] = {}
    """For each input on a delayed edge (``"dst.port"``), how many versions old the value it
    read was: 0 is the previous step's (on-policy), N the value of step ``step-1-N``; None
    when it read None (nothing produced yet)."""
    sched: dict[str, float] = {}
    """What the executor computed on for this step, as ``sched/*`` metrics (a ZeroMQ run:
    each controller's threads and cores, the adaptive partitioner's changes so far)."""
    switches: list[tuple[str, float, float, int, int]] = []
    """Roles taking turns on a device (:mod:`runtime.engine.switch`): each offload and reload
    of this step as ``(what, start time.time(), seconds, bytes moved, controller)``."""
    replicas: dict[str, list[int]] = {}
    """For each node whose call was cut across replicas, per input row the replica that ran
    it (0: the node itself, i: replica process i)."""


OnStep = Callable[[StepResult], None] | None
"""Called with each step's result as it arrives (the training loop's metrics and checkpoints)."""
Stop = Callable[[], bool] | None
"""Asked after each step; True ends the run early (a SIGTERM)."""


class Executor(Protocol):
    """What the training loop drives: :class:`~runtime.engine.engine.LocalExecutor` and
    ``runtime.zmq.driver.ZmqExecutor`` alike, each made from ``(plan, RunConfig)``."""

    next_step: int

    def step(self) -> StepResult: ...

    def run(self, steps: int = 1, on_step: OnStep = None, stop: Stop = None) -> list[StepResult]:
        """Run ``steps`` steps; their results in step order, each to ``on_step`` where given
        (then none is kept: a long run holds no step's outputs), else returned."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def describe(value: Any) -> str:
    """A short description of a value for error messages: dtype and shape for tensors."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{str(dtype).removeprefix('torch.')}[{', '.join(map(str, shape))}]"
    if isinstance(value, list | tuple):
        return f"{type(value).__name__}[{len(value)}]"
    return type(value).__name__


def _node_error(
    node: Any, inputs: Mapping[str, Any], step: int, controller: int, exc: BaseException
) -> NodeExecutionError:
    tb = traceback.format_exc()
    if isinstance(exc, UsageError) and not isinstance(exc, NodeExecutionError):
        # the user's sample, named by the message: one line
        return NodeUsageError(
            node.name,
            f"node {node.name!r} ({type(node).__name__}) stopped at step {step}: "
            + str(exc).removeprefix(f"node {node.name!r}: "),
            tb,
            step=step,
            controller=controller,
            during="data",
        )
    shapes = ", ".join(f"{k}={describe(v)}" for k, v in inputs.items()) or "no inputs"
    return NodeExecutionError(
        node.name,
        f"node {node.name!r} ({type(node).__name__}) failed at step {step} on controller "
        f"{controller}: {type(exc).__name__}: {exc}\n  inputs: {shapes}\n--- original traceback ---\n{tb}",
        tb,
        step=step,
        controller=controller,
    )


def first_non_finite(outputs: Mapping[str, Any]) -> str | None:
    """Why ``outputs`` fail the finiteness check (the first float tensor with NaN/inf), or None."""
    for port, value in outputs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
            bad = ~torch.isfinite(value)  # same shape as value
            if bool(bad.any()):
                count = int(bad.sum())
                first = [int(i) for i in bad.nonzero()[0]]
                kinds = "NaN" if bool(value.isnan().any()) else "inf"
                return (
                    f"output {port!r} ({describe(value)}) holds {count} non-finite value(s) "
                    f"({kinds}), the first at index {first}"
                )
    return None


def _check_finite(node: Any, out: Mapping[str, Any], step: int, controller: int) -> None:
    why = first_non_finite(out)
    if why is not None:
        raise NodeExecutionError(
            node.name,
            f"node {node.name!r} ({type(node).__name__}) at step {step} on controller "
            f"{controller}: {why}. The run stops here rather than in the node that reads it; "
            "fix the node (or its inputs), or turn the check off (check_finite=False)",
            step=step,
            controller=controller,
        )


def run_node(
    node: Any,
    inputs: dict[str, Any],
    step: int,
    controller: int = 0,
    fanouts: Any = None,
    check_finite: bool = False,
) -> dict[str, Any]:
    """Call one node; any failure becomes a NodeExecutionError naming node, step and input shapes.

    With ``fanouts`` (:class:`runtime.sched.fanout.Fanouts`) the call may be cut into pieces
    across its workers.
    """
    try:
        node.begin_step(step)
        if fanouts is not None and fanouts.fans_out(node.name):
            out = fanouts.call(node.name, inputs)
        else:
            out = node_op(node, "run", inputs, step)
    except NodeExecutionError:
        raise
    except Exception as exc:
        raise _node_error(node, inputs, step, controller, exc) from exc
    if check_finite:
        _check_finite(node, out, step, controller)
    return out


def node_op(node: Any, op: str, value: Any = None, step: int = 0) -> Any:
    """``node.<op>(value)`` (no argument when ``value`` is None): a call (``run``), the
    state's ``state_dict`` and ``load_state_dict``, the device's ``offload`` and ``reload``.
    For a node trained as a rank group, its other ranks run the same operation
    (:func:`runtime.ranks.group.lead`)."""
    if node.rank_group is None:
        return getattr(node, op)(*(() if value is None else (value,)))
    from runtime.ranks.group import lead

    return lead(node, op, value, step)


def stream_node(
    node: Any,
    inputs: dict[str, Any],
    step: int,
    controller: int = 0,
    check_finite: bool = False,
) -> Iterator[Piece]:
    """The checked pieces of one call of a streaming node; failures as in :func:`run_node`."""
    try:
        node.begin_step(step)
        for piece in node.run_stream(inputs):
            if check_finite:
                _check_finite(node, piece.outputs, step, controller)
            yield piece
    except NodeExecutionError:
        raise
    except Exception as exc:
        raise _node_error(node, inputs, step, controller, exc) from exc


@dataclass
class NodeWorkers:
    """What runs a process's nodes besides the process itself: the other ranks of the nodes
    trained as a group, and the :class:`~runtime.sched.fanout.Fanouts` of the nodes whose calls
    fan out (over the slots of ``devices``, or replicas; None: none does). ``close()`` ends
    them all."""

    fanouts: Any
    groups: list[Any]

    def close(self) -> None:
        fanouts, groups = self.fanouts, self.groups
        self.fanouts, self.groups = None, []
        try:
            if fanouts is not None:
                fanouts.close()
        finally:
            for group in groups:
                group.close()


def start_nodes(
    nodes: Mapping[str, Any],
    order: Sequence[str],
    config: Any,
    spawn: Callable[[Any, int, int], Any] | None = None,
    track: Callable[[str], None] | None = None,
    placements: Mapping[str, Any] | None = None,
    here: int = 0,
) -> NodeWorkers:
    """Make ``nodes`` ready to run, in-process or on a controller: start the rank groups of
    grouped nodes (before they build: the update joins its group), and on controller ``here``
    the ranks it holds of groups across hosts (``placements``: node name to
    :class:`runtime.ranks.placement.HostPlacement`), build the nodes
    (``setup()``) in ``order``, telling ``track`` which one is being built, then the fan-outs
    for ``config.slots`` and ``config.replicas`` (``spawn`` starts replica i of a node). A
    failure ends what started; a library node that fails on what the user gave it raises a
    one-line :class:`~yatt_graph.errors.NodeBuildError` (:func:`yatt_graph.errors.build_error`)."""
    from runtime.sched.fanout import slot_pool, start_fanouts

    groups: list[Any] = []
    if placements or any(n.ranks > 1 and n.rank_group is None for n in nodes.values()):
        from runtime.ranks.group import start_groups

        groups = start_groups(nodes, placements, here)
    workers = NodeWorkers(None, groups)
    try:
        for name in [n for n in order if n in nodes]:
            if track is not None:
                track(name)
            try:
                nodes[name].setup()
            except Exception as exc:
                if (error := build_error(nodes[name], exc)) is None:
                    raise
                raise error from exc
        if track is not None:
            track("")
        mine = {n: r for n, r in config.replicas.items() if n in nodes}  # (the others' elsewhere)
        workers.fanouts = start_fanouts(nodes, slot_pool(config.slots), mine, spawn)
    except BaseException:
        workers.close()
        raise
    return workers


def on_cuda(device: Any) -> bool:
    """Whether ``device`` (a torch device or its name) is a CUDA device."""
    return str(device).startswith("cuda")


def node_devices(nodes: Mapping[str, Any]) -> dict[str, str]:
    """Each node's :attr:`~yatt_graph.Node.device`, by name, as a string."""
    return {name: str(node.device) for name, node in nodes.items()}


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("cpu")


def host_copy(value: Any) -> Any:
    """``value`` with every tensor off the host copied to it (in dicts, lists and tuples); the
    value itself when nothing in it is off the host."""
    if isinstance(value, torch.Tensor):
        return value if value.device.type == "cpu" else _to_host(value)
    if isinstance(value, Mapping):
        items = {k: host_copy(v) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    if isinstance(value, list | tuple):
        items = [host_copy(v) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


class TensorMoves:
    """The rule of the module docstring for one graph: ``devices`` holds every node's device
    (:func:`node_devices`), ``edges`` the graph's edges, ``assignment`` each node's
    controller. In a graph with no node on a GPU it leaves every value as it is."""

    def __init__(
        self, devices: Mapping[str, str], edges: Sequence[Any], assignment: Mapping[str, int]
    ):
        self.cuda = {name for name, device in devices.items() if on_cuda(device)}
        self._readers: dict[tuple[str, str], dict[int, set[str]]] = {}
        for e in edges:
            where = self._readers.setdefault((e.src, e.src_port), {})
            where.setdefault(assignment.get(e.dst, 0), set()).add(e.dst)

    def inputs(self, node: Any, inputs: dict[str, Any]) -> dict[str, Any]:
        """What ``node``, a reader in this process, takes of its call's ``inputs``: each
        tensor moved to its GPU (its device as it is now: a rank's own), or host copies for a
        reader off the GPU; ``inputs`` themselves in a graph with no node on a GPU."""
        if not self.cuda:
            return inputs
        if on_cuda(node.device):
            return {p: v.to(node.device) if isinstance(v, torch.Tensor) else v
                    for p, v in inputs.items()}  # fmt: skip
        return {p: host_copy(v) for p, v in inputs.items()}

    def for_host(self, value: Any) -> Any:
        """What the graph's marked outputs hold of ``value``: a host copy."""
        return host_copy(value) if self.cuda else value

    def split(self, src: str, port: str, dests: Sequence[int]) -> list[tuple[list[int], bool]]:
        """``dests`` (controllers reading ``src.port``) as groups ``(controllers, as_is)``:
        those whose readers of it are all on a GPU take the value as it is, the others a host
        copy. Groups with no controller are left out."""
        if not self.cuda:
            return [(list(dests), True)]
        readers = self._readers.get((src, port), {})
        as_is = [c for c in dests if readers.get(c) and readers[c] <= self.cuda]
        copy = [c for c in dests if c not in as_is]
        return [(group, keep) for group, keep in ((as_is, True), (copy, False)) if group]
