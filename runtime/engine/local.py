"""The in-process executor: runs a plan's nodes in one process, in topological order.

This is the reference semantics: the ZeroMQ runtime must give the same results. It
runs every node of the plan in the graph's topological order (the plan's controller
assignment only labels errors here) and keeps the values of delayed edges from one
step for the next.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from runtime.engine.rng import rng_state, set_rng_state
from runtime.engine.streams import call_piece, per_piece
from runtime.sched.splitting import NodeSplitter, device_pool
from yatt_graph import Graph, NodeExecutionError, Plan
from yatt_graph.stream import Piece, join_pieces

__all__ = ["LocalExecutor", "StepResult", "describe"]


class StepResult(msgspec.Struct):
    """What one step of a graph produced."""

    step: int
    outputs: dict[str, Any]
    """The graph's marked outputs, by name."""
    node_seconds: dict[str, float]
    """Wall time of each node's call."""
    node_start: dict[str, float] = {}
    """When each node's call began (``time.time()``, comparable across processes)."""
    node_controller: dict[str, int] = {}
    """The controller that ran each node."""


def describe(value: Any) -> str:
    """A short description of a value for error messages: dtype and shape for tensors."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{str(dtype).removeprefix('torch.')}[{', '.join(map(str, shape))}]"
    if isinstance(value, list | tuple):
        return f"{type(value).__name__}[{len(value)}]"
    return type(value).__name__


def _node_error(
    graph: Graph, name: str, inputs: dict[str, Any], step: int, controller: int, exc: Exception
) -> NodeExecutionError:
    shapes = ", ".join(f"{k}={describe(v)}" for k, v in inputs.items()) or "no inputs"
    tb = traceback.format_exc()
    return NodeExecutionError(
        name,
        f"node {name!r} ({type(graph.nodes[name]).__name__}) failed at step {step} on controller "
        f"{controller}: {type(exc).__name__}: {exc}\n  inputs: {shapes}\n--- original traceback ---\n{tb}",
        tb,
        step=step,
        controller=controller,
    )


def run_node(
    graph: Graph,
    name: str,
    inputs: dict[str, Any],
    step: int,
    controller: int = 0,
    splitter: NodeSplitter | None = None,
) -> dict[str, Any]:
    """Call one node; any failure becomes a NodeExecutionError naming node, step and input shapes.

    With a ``splitter`` the call may be cut into micro-batches across its devices
    (:mod:`runtime.sched.splitting`).
    """
    node = graph.nodes[name]
    try:
        node.begin_step(step)
        return splitter.call(name, inputs) if splitter is not None else node.run(inputs)
    except Exception as exc:
        raise _node_error(graph, name, inputs, step, controller, exc) from exc


def stream_node(
    graph: Graph, name: str, inputs: dict[str, Any], step: int, controller: int = 0
) -> Iterator[Piece]:
    """The checked pieces of one call of a streaming node; failures as in :func:`run_node`."""
    try:
        graph.nodes[name].begin_step(step)
        yield from graph.nodes[name].run_stream(inputs)
    except Exception as exc:
        raise _node_error(graph, name, inputs, step, controller, exc) from exc


class LocalExecutor:
    """Run a graph or plan in this process. ``step()`` runs the graph once.

    ``devices`` (None, a CPU slot count, ``"auto"`` or a DevicePool) splits the calls of
    splittable nodes across that many devices (:mod:`runtime.sched.splitting`); ``close()`` (or
    ``with``) stops their worker threads.
    """

    def __init__(self, plan: Plan | Graph, *, devices: Any = None):
        self.plan = plan if isinstance(plan, Plan) else plan.plan(1)
        self.graph = self.plan.graph
        self.graph.validate()
        self.order = self.graph.topological_order()
        pool = device_pool(devices)
        self.splitter = NodeSplitter(self.graph.nodes, pool) if pool is not None else None
        self._delayed: dict[tuple[str, str], Any] = {}
        self.next_step = 0

    def step(self) -> StepResult:
        step = self.next_step
        values: dict[tuple[str, str], Any] = {}
        seconds: dict[str, float] = {}
        starts: dict[str, float] = {}
        streamed: dict[str, list[Piece]] = {}  # this step's pieces of each streaming node
        for name in self.order:
            inputs = {}
            edges = self.graph.inputs_of(name)
            for e in edges:
                key = (e.src, e.src_port)
                inputs[e.dst_port] = self._delayed.get(key) if e.delay else values[key]
            starts[name] = time.time()
            t0 = time.perf_counter()
            controller = self.plan.assignment[name]
            node = self.graph.nodes[name]
            sources = {e.src for e in edges if not e.delay and e.src in streamed}
            ports = {e.dst_port: e.src_port for e in edges if not e.delay and e.src in sources}
            source = next(iter(sources)) if len(sources) == 1 else None
            if node.streaming:
                streamed[name] = list(stream_node(self.graph, name, inputs, step, controller))
                out = join_pieces(streamed[name], name)
            elif source is not None and per_piece(node, ports, inputs, streamed[source][0].size):

                def call(
                    piece_inputs: dict[str, Any], name: str = name, controller: int = controller
                ) -> dict[str, Any]:
                    return run_node(self.graph, name, piece_inputs, step, controller, self.splitter)

                seen: set[int] = set()
                pieces = streamed[source]
                out = join_pieces(
                    [
                        call_piece(call, node, inputs, ports, p, i, seen, step, controller)
                        for i, p in enumerate(pieces)
                    ],
                    name,
                )
            else:
                out = run_node(self.graph, name, inputs, step, controller, self.splitter)
            seconds[name] = time.perf_counter() - t0
            for port, value in out.items():
                values[(name, port)] = value
        self._delayed = {
            (e.src, e.src_port): values[(e.src, e.src_port)] for e in self.graph.edges if e.delay
        }
        self.next_step += 1
        outputs = {k: values[(h.node, h.port)] for k, h in self.graph.graph_outputs.items()}
        return StepResult(step, outputs, seconds, starts, dict(self.plan.assignment))

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: node states, carried values, RNG states, the step."""
        return {
            "step": self.next_step,
            "nodes": {name: node.state_dict() for name, node in self.graph.nodes.items()},
            "delayed": [[src, port, value] for (src, port), value in self._delayed.items()],
            "rng": rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = sorted(set(self.graph.nodes) - set(state["nodes"]))
        if missing:
            raise ValueError(
                f"checkpoint has no state for node(s) {missing}; was it written by this graph?"
            )
        for name, node in self.graph.nodes.items():
            if state["nodes"][name]:
                node.load_state_dict(state["nodes"][name])
        self._delayed = {(src, port): value for src, port, value in state["delayed"]}
        set_rng_state(state["rng"])
        self.next_step = int(state["step"])

    def run(
        self, steps: int = 1, on_step: Callable[[StepResult], None] | None = None
    ) -> list[StepResult]:
        results = []
        for _ in range(steps):
            result = self.step()
            if on_step:
                on_step(result)
            results.append(result)
        return results

    def close(self) -> None:
        """Stop the device workers of ``devices=`` (nothing else holds resources)."""
        if self.splitter is not None:
            self.splitter.close()
            self.splitter = None

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
