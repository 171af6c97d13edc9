"""Two step engines wired by hand, with every message between them delivered in a random order.

No processes, no sockets, no sleeps: :func:`simulate` plays the driver (RUN messages that may
arrive late, up to ``depth`` steps in flight) and the data plane (values, pieces and stream
ends, each delivered when a seeded random choice says so), so a test can try many timings of
one graph and check what every read was. The nodes say what they read: each output row holds
the node's step, a value computed from its inputs, the steps of its inputs and, for a delayed
input, the producing step and value it got.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from runtime.engine.engine import StepEngine
from yatt_graph import ANY, Graph, Node, Port

ROWS = 2
"""Rows per output: a streaming node yields them one piece each."""


class Mix(Node):
    """Reads ``n_inputs`` values of this step and, with ``delayed``, one ``prev`` from earlier."""

    outputs = {"out": ANY}

    def __init__(self, n_inputs: int = 0, delayed: bool = False, name: str | None = None):
        super().__init__(name=name)
        self.n_inputs, self.delayed = n_inputs, delayed
        self.inputs = {f"in{i}": Port(ANY) for i in range(n_inputs)}
        if delayed:
            self.inputs["prev"] = Port(ANY, required=False)
        self.calls: list[int] = []

    def _row(self, inputs: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(self.step)
        ins = [inputs[f"in{i}"][0] for i in range(self.n_inputs)]
        prev = inputs.get("prev")
        prev_row = prev[0] if prev is not None else None
        val = self.step * 31 + 7 * sum(x["val"] for x in ins)
        if prev_row is not None:
            val += 3 * prev_row["val"]
        return {
            "step": self.step,
            "val": val % 1_000_003,
            "ins": [x["step"] for x in ins],
            "read": None if prev_row is None else prev_row["step"],
            "read_val": None if prev_row is None else prev_row["val"],
        }

    def forward(self, **inputs: Any) -> dict[str, Any]:
        return {"out": [self._row(inputs)] * ROWS}


class StreamMix(Mix):
    """A :class:`Mix` that streams: one row per piece."""

    def forward_stream(self, **inputs: Any) -> Iterator[tuple[list[int], dict[str, Any]]]:
        row = self._row(inputs)
        for i in range(ROWS):
            yield [i], {"out": [row]}


@dataclass(frozen=True)
class Spec:
    """A graph: per node its inputs (earlier nodes), whether it streams, its controller; and
    the delayed edges (src, dst), at most one into each dst (its ``prev`` port)."""

    inputs: tuple[tuple[int, ...], ...]
    streaming: tuple[bool, ...]
    place: tuple[int, ...]
    delayed: tuple[tuple[int, int], ...]


def build(spec: Spec) -> Graph:
    dsts = {d for _, d in spec.delayed}
    with Graph("staleness_sim") as g:
        nodes: list[Mix] = []
        handles: list[Any] = []
        for i, ins in enumerate(spec.inputs):
            cls = StreamMix if spec.streaming[i] else Mix
            node = cls(len(ins), delayed=i in dsts, name=f"n{i}")
            handles.append(node(**{f"in{j}": handles[s] for j, s in enumerate(ins)}))
            nodes.append(node)
        for src, dst in spec.delayed:
            g.connect(handles[src], nodes[dst], "prev", delay=1)
        for i, h in enumerate(handles):
            g.output(f"n{i}", h)
    return g


class Wire:
    """An engine's outbox: every message goes into the shared list of messages in flight."""

    def __init__(self, inflight: list[tuple[Any, ...]]):
        self.inflight = inflight

    def value(self, step: int, src: str, port: str, value: Any, dests: list[int]) -> None:
        self.inflight += [(d, "value", step, src, port, value) for d in dests]

    def piece(self, step: int, src: str, port: str, index: int, piece: Any, dests: list[int]):
        self.inflight += [(d, "piece", step, src, port, index, piece) for d in dests]

    def end(self, step: int, src: str, port: str, count: int, dests: list[int]) -> None:
        self.inflight += [(d, "end", step, src, port, count) for d in dests]


@dataclass
class Run:
    """What :func:`simulate` saw: per step the merged outputs and staleness reports, the
    order each engine reported steps in, each node's calls and the states at the end."""

    outputs: dict[int, dict[str, Any]] = field(default_factory=dict)
    staleness: dict[int, dict[str, int | None]] = field(default_factory=dict)
    reported: list[list[int]] = field(default_factory=lambda: [[], []])
    calls: dict[str, list[int]] = field(default_factory=dict)
    state: dict[str, Any] | None = None
    drops: list[str] = field(default_factory=list)
    most_delayed: int = 0
    """The most delayed values one engine held at once."""


def _deliver(engine: StepEngine, msg: tuple[Any, ...]) -> list[str]:
    kind, rest = msg[1], msg[2:]
    if kind == "run":
        engine.allow(rest[0])
        return []
    if kind == "value":
        return engine.deliver(*rest)
    if kind == "piece":
        return engine.deliver_piece(*rest)
    return engine.end_stream(*rest)


def simulate(
    spec: Spec,
    max_staleness: int,
    mode: str,
    depth: int,
    rng: random.Random,
    start: int = 0,
    stop: int = 8,
    state: dict[str, Any] | None = None,
    memory_bound: int | None = None,
) -> Run:
    """Run steps ``[start, stop)`` on two engines (restored from ``state`` when given), at the
    timing ``rng`` draws, then take their state at ``stop`` (see :class:`Run`)."""
    graph = build(spec)
    assignment = {f"n{i}": c for i, c in enumerate(spec.place)}
    inflight: list[tuple[Any, ...]] = []
    engines = [
        StepEngine(
            {n: graph.nodes[n] for n in graph.nodes if assignment[n] == c},
            graph.edges,
            graph.graph_outputs,
            graph.topological_order(),
            assignment,
            here=c,
            max_staleness=max_staleness,
            staleness=mode,
            window=depth,
            outbox=Wire(inflight),
        )
        for c in (0, 1)
    ]
    for e in engines:
        if state is not None:
            e.restore(start, state)
        else:
            e.reset(start)
    run = Run()
    collected, until = start, start
    stuck: set[int] = set()

    def allow_more() -> None:
        nonlocal until
        want = min(stop, collected + depth)
        if want > until:
            until = want
            inflight.extend((c, "run", want) for c in (0, 1))

    allow_more()
    while collected < stop:
        options = [("run", c) for c in (0, 1) if c not in stuck]
        options += [("msg", i) for i in range(len(inflight))]
        assert options, f"deadlock at step {collected}: nothing can run and nothing is in flight"
        kind, x = rng.choice(options)
        if kind == "run":
            if not engines[x].run_one():
                stuck.add(x)
            for result in engines[x].finished():
                run.reported[x].append(result.step)
                run.outputs.setdefault(result.step, {}).update(result.outputs)
                run.staleness.setdefault(result.step, {}).update(result.staleness)
        else:
            msg = inflight.pop(x)
            run.drops += _deliver(engines[msg[0]], msg)
            stuck.discard(msg[0])
        for e in engines:
            run.most_delayed = max(run.most_delayed, e.delayed.count())
            if memory_bound is not None:
                assert e.delayed.count() <= memory_bound, "delayed values pile up"
                assert len(e.pending) <= len(graph.nodes) * (depth + 1), "inputs pile up"
        while all(collected in r for r in run.reported):
            collected += 1
            allow_more()
    states = [e.state(stop) for e in engines]
    while inflight:  # what is still on its way (values the state may need)
        msg = inflight.pop(rng.randrange(len(inflight)))
        run.drops += _deliver(engines[msg[0]], msg)
        states = [e.state(stop) for e in engines]
    assert all(s is not None for s in states), "a delayed value never reached its reader"
    run.state = merge(states)
    run.calls = {n: list(graph.nodes[n].calls) for n in graph.nodes}
    return run


def merge(states: list[Any]) -> dict[str, Any]:
    """One state from the engines' states (as the ZeroMQ driver merges controllers')."""
    nodes: dict[str, Any] = {}
    delayed: dict[tuple[str, str, int], Any] = {}
    for s in states:
        nodes.update(s["nodes"])
        for src, port, k, v in s["delayed"]:
            delayed.setdefault((src, port, k), v)
    return {"nodes": nodes, "delayed": [[*k, v] for k, v in sorted(delayed.items())]}
