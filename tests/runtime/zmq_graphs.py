"""Graphs for the ZeroMQ runtime tests, at module level so controllers can rebuild them.

``build_graph(kind, **options)`` is what ``load_graph("zmq_graphs", kind=...)`` calls.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import msgspec
import numpy as np
import torch
from PIL import Image

from yatt_graph import ANY, BatchPolicy, Graph, Node, Port, Tensor

__all__ = ["Sample", "build_graph"]


class Sample(msgspec.Struct):
    """A Struct with a tensor inside, to cross controllers."""

    label: str
    score: float
    emb: Any = None


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1234 + step)


class TinySource(Node):
    kind = "data"
    outputs = {"x": Tensor("float32", "B")}

    def __init__(self, size: int = 4, sleep_s: float = 0.0, name: str | None = None, **kw: Any):
        super().__init__(name=name, **kw)
        self.size, self.sleep_s = size, sleep_s

    def forward(self) -> dict[str, Any]:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return {"x": torch.randn(self.size, generator=_gen(self.step))}  # (B,)


class Boom(Node):
    """Fails at step ``fail_at``: raises, exits the process, or stops it (a hang)."""

    inputs = {"x": Tensor("float32", "B")}
    outputs = {"y": Tensor("float32", "B")}

    def __init__(
        self,
        fail_at: int = 1,
        mode: str = "raise",
        sleep_s: float = 0.0,
        name: str | None = None,
        **kw: Any,
    ):
        super().__init__(name=name, **kw)
        self.fail_at, self.mode, self.sleep_s = fail_at, mode, sleep_s

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if self.step == self.fail_at:
            if self.mode == "raise":
                raise ValueError(f"node {self.name!r}: boom at step {self.step}")
            if self.mode == "exit":
                os._exit(7)
            if self.mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if self.mode == "hang":  # a Python-level hang: the timeout report shows this frame
                while True:
                    time.sleep(0.05)
        return {"y": x * 2}  # (B,)


class SetSource(Node):
    """Produces a value the wire cannot carry (a set inside a dict)."""

    kind = "data"
    outputs = {"tags": ANY}

    def forward(self) -> dict[str, Any]:
        return {"tags": {"ok": [1, 2], "bad": [1, {2, 3}]}}


class Echo(Node):
    inputs = {"value": ANY}
    outputs = {"out": ANY}

    def forward(self, value: Any) -> dict[str, Any]:
        return {"out": value}


class BadInit(Node):
    """Builds in the process that declared the graph, fails in a controller."""

    outputs = {"x": Tensor("float32", "B")}

    def __init__(self, home_pid: int = 0, name: str | None = None, **kw: Any):
        super().__init__(name=name, **kw)
        if home_pid and os.getpid() != home_pid:
            raise RuntimeError("cannot open the (pretend) model file in this process")

    def forward(self) -> dict[str, Any]:
        return {"x": torch.zeros(2)}


class RichSource(Node):
    """Every kind of value the data plane carries, deterministic per step."""

    kind = "data"
    outputs = {
        "images": ANY,
        "big": Tensor("float32", "N"),
        "half": Tensor("bfloat16", "B", "D"),
        "strided": Tensor("float32", "D", "B"),
        "meta": ANY,
    }

    def __init__(self, big: int = 600_000, name: str | None = None, **kw: Any):
        super().__init__(name=name, **kw)
        self.big = big

    def forward(self) -> dict[str, Any]:
        g = _gen(self.step)
        pixels = torch.randint(0, 256, (3, 6, 5, 3), generator=g, dtype=torch.uint8).numpy()
        images = [Image.fromarray(p, "RGB") for p in pixels]
        images.append(Image.new("P", (3, 2), 5))
        meta = {
            "ids": (self.step, "x", None),
            "sample": Sample("cat", 0.5 + self.step, torch.arange(3.0)),
            "empty": torch.zeros(0, 3),
            "scalar": torch.tensor(self.step),
            "array": np.arange(6, dtype=np.int16).reshape(2, 3),
            "blob": bytes(range(256)) * 300,
            "flags": torch.tensor([True, False]),
        }
        return {
            "images": images,
            "big": torch.randn(self.big, generator=g),  # (N,) 2.4 MB: shared memory
            "half": torch.randn(4, 8, generator=g).bfloat16(),  # (B, D)
            "strided": torch.randn(4, 8, generator=g).t(),  # (D, B) non-contiguous
            "meta": meta,
        }


class RichSink(Node):
    inputs = {
        "images": ANY,
        "big": Tensor("float32", "N"),
        "half": Tensor("bfloat16", "B", "D"),
        "strided": Tensor("float32", "D", "B"),
        "meta": ANY,
    }
    outputs = {"summary": ANY}

    def forward(self, images, big, half, strided, meta) -> dict[str, Any]:
        return {
            "summary": {
                "pixels": [im.tobytes()[:12] for im in images],
                "modes": [im.mode for im in images],
                "palette": images[-1].getpalette()[:6],
                "big_sum": big.double().sum(),
                "big_head": big[:5].clone(),
                "half": half,
                "strided": strided,
                "meta": meta,
            }
        }


class ScaleBy(Node):
    """Takes a tensor constructor argument, so the plan does not serialize (graph_ref mode)."""

    inputs = {"x": Tensor("float32", "B")}
    outputs = {"y": Tensor("float32", "B")}

    def __init__(self, factor: torch.Tensor, name: str | None = None, **kw: Any):
        super().__init__(name=name, **kw)
        self.factor = factor

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"y": x * self.factor}  # (B,)


class Accumulate(Node):
    """Sums its input into state and feeds the state back next step (a delayed edge)."""

    inputs = {"x": Tensor("float32", "B"), "prev": Port(ANY, required=False)}
    outputs = {"total": Tensor("float32", "B"), "seen": ANY}

    def forward(self, x: torch.Tensor, prev: Any) -> dict[str, Any]:
        base = torch.zeros_like(x) if prev is None else prev["total"]
        total = base + x  # (B,)
        return {"total": total, "seen": {"total": total, "prev_was_none": prev is None}}


class KillOnce(Node):
    """Passes its input on; at ``at_step`` SIGKILLs its own process, once (a marker file says so)."""

    inputs = {"x": ANY}
    outputs = {"x": ANY}

    def __init__(self, marker: str = "", at_step: int = -1, name: str | None = None, **kw: Any):
        super().__init__(name=name, **kw)
        self.marker, self.at_step = marker, at_step

    def forward(self, x: Any) -> dict[str, Any]:
        if self.step == self.at_step and self.marker and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return {"x": x}


class Texts(Node):
    """Four texts per step; sample 1 of odd steps is the one the flaky reward cannot score."""

    kind = "data"
    outputs = {"texts": ANY}

    def forward(self) -> dict[str, Any]:
        return {
            "texts": [
                f"t{self.step}-{i}" + ("!" if i == 1 and self.step % 2 else "") for i in range(4)
            ]
        }


def flaky_reward(text: str, meta: Any) -> float:
    """0.5 per sample, NaN for a text ending in '!' (a reward model that blew up)."""
    return float("nan") if text.endswith("!") else 0.5


def _toy_with_chaos(controllers: int, marker: str, at_step: int, seed: int) -> Graph:
    """graphs/toy.py plus a KillOnce on the scores (it changes no value), nodes spread out."""
    from nodes.toy import FakeEncoder, MatchReward, ToyRollout, ToySource, ToyUpdate, normalize

    with Graph("toy_rlhf") as g:
        batch = ToySource(batch_size=16, classes=4, seed=seed, name="source")()
        emb = FakeEncoder(seed=seed, name="encoder")(batch.images)
        rollout = ToyRollout(vocab=8, seed=seed, name="rollout")
        sample = rollout(emb)
        scores = MatchReward(vocab=8, name="reward")(sample.tokens, batch.labels)
        chaos = KillOnce(marker, at_step, placement=min(1, controllers - 1), name="chaos")(scores)
        adv = normalize(chaos, name="advantage")
        update = ToyUpdate(vocab=8, seed=seed, name="update")(
            emb, sample.tokens, sample.logprobs, adv
        )
        g.connect(update.weights, rollout, "weights", delay=1)
        g.output("scores", scores)
        g.output("metrics", update.metrics)
    where = {"source": 0, "encoder": 0, "rollout": 1, "reward": 1, "advantage": 2, "update": 2}
    for name, c in where.items():
        g.nodes[name].placement = min(c, controllers - 1)
    return g


def build_graph(kind: str = "rich", on_bad_sample: str = "raise", **options: Any) -> Graph:
    if kind == "toy_chaos":
        return _toy_with_chaos(
            options.get("controllers", 3),
            options.get("marker", ""),
            options.get("at_step", -1),
            options.get("seed", 0),
        )
    with Graph(f"zmq_{kind}") as g:
        if kind == "bad_reward":
            from nodes.rewards import RuleReward

            skip = on_bad_sample == "skip"
            reward = RuleReward(
                "zmq_graphs:flaky_reward",
                on_bad_sample="skip" if skip else "raise",
                emit_bad_mask=skip,
                name="reward",
            )
            out = reward(texts=Texts(name="texts")())
            g.output("scores", out.scores if skip else out)
            if skip:
                g.output("bad_samples", out.bad_samples)
        elif kind == "hang":
            x = TinySource(placement=0, name="source")()
            policy = BatchPolicy(timeout_s=options.get("timeout_s", 0.0))
            boom = Boom(
                options.get("fail_at", 1), "hang", placement=1, batch_policy=policy, name="stuck"
            )
            g.output("y", boom(x))
        elif kind == "chain":
            # source (c0) -> middle (c1) -> sink (c2), and the sink's total back to the middle.
            x = TinySource(size=8, placement=0, name="source")()
            acc = Accumulate(placement=1, name="acc")
            out = acc(x)
            mirror = Echo(placement=2, name="mirror")(out.seen)
            g.connect(mirror, acc, "prev", delay=1)
            g.output("total", out.total)
        elif kind == "boom":
            x = TinySource(placement=0, name="source")()
            y = Boom(
                options.get("fail_at", 1), options.get("mode", "raise"), placement=1, name="boom"
            )(x)
            g.output("y", y)
        elif kind == "unsendable":
            tags = SetSource(placement=0, name="set_source")()
            g.output("out", Echo(placement=1, name="echo")(tags))
        elif kind == "bad_init":
            x = BadInit(options.get("home_pid", 0), placement=1, name="bad_init")()
            g.output("y", Boom(fail_at=-1, placement=0, name="after")(x))
        elif kind == "slow":
            sleep_s = options.get("sleep_s", 0.2)
            x = TinySource(sleep_s=sleep_s, placement=0, name="source")()
            sink_sleep_s = options.get("sink_sleep_s", 0.0)
            g.output("y", Boom(fail_at=-1, sleep_s=sink_sleep_s, placement=1, name="double")(x))
        elif kind == "rich":
            src = RichSource(options.get("big", 600_000), placement=0, name="source")()
            g.output("summary", RichSink(placement=1, name="sink")(*src))
        elif kind == "tensor_arg":
            x = TinySource(placement=0, name="source")()
            g.output(
                "y", ScaleBy(torch.tensor(options.get("factor", 3.0)), placement=1, name="scale")(x)
            )
        elif kind == "feedback":
            x = TinySource(placement=0, name="source")()
            acc = Accumulate(placement=1, name="acc")
            out = acc(x)
            mirror = Echo(placement=0, name="mirror")(out.seen)  # back on controller 0
            g.connect(mirror, acc, "prev", delay=1)  # a delayed edge between controllers
            g.output("total", out.total)
        else:
            raise ValueError(f"unknown test graph kind {kind!r}")
    return g


# --- test helpers -----------------------------------------------------------------------------
def default_sigint() -> None:
    """``preexec_fn`` for a child a test sends SIGINT to: Ctrl-C's default action, since a
    process started in the background (``cmd &`` in a script, ``nohup``) inherits SIGINT
    ignored, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def controller_processes() -> list[Any]:
    """Live controller processes started from this process (psutil), zombies excluded."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "runtime.zmq.controller" in " ".join(
                child.cmdline()
            ):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def assert_gone(pids: list[int], run_dir: str | None = None, timeout_s: float = 10.0) -> None:
    """Every pid has exited (or is a zombie), and the run's files are removed."""
    import glob

    import psutil

    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if alive:
            time.sleep(0.05)
    assert not alive, f"controller processes {alive} are still running"
    if run_dir is not None:
        assert not os.path.exists(run_dir), f"run directory {run_dir} was left behind"
        leftovers = glob.glob(f"/dev/shm/{os.path.basename(run_dir)}-*")
        assert not leftovers, f"shared-memory segments left behind: {leftovers}"


def assert_same(a: Any, b: Any, where: str = "value") -> None:
    """Deep equality with tensors compared by torch.equal (and dtype), images by pixels."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (
            f"{where}: tensors differ"
        )
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"{where}: arrays differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, msgspec.Struct):
        for f in a.__struct_fields__:
            assert_same(getattr(a, f), getattr(b, f), f"{where}.{f}")
    elif isinstance(a, Image.Image):
        assert (a.mode, a.size, a.tobytes()) == (b.mode, b.size, b.tobytes()), (
            f"{where}: images differ"
        )
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def in_process_run(ref: str, steps: int, threads: int, **options: Any) -> list[Any]:
    """An in-process run of graph ``ref`` with torch's threads set to ``threads`` (a ZeroMQ run
    whose controllers compute on that many threads splits float reductions alike)."""
    from runtime.engine.engine import LocalExecutor
    from yatt_graph.refs import load_graph

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return LocalExecutor(load_graph(ref, **options)).run(steps)
    finally:
        torch.set_num_threads(before)


def drive(controllers: int = 2, steps: int = 10_000) -> None:
    """A driver for the signal tests: prints its controllers' pids and run dir, then runs slowly."""
    import json
    import sys

    from runtime.zmq.driver import ZmqExecutor

    with ZmqExecutor(build_graph("slow", sleep_s=0.05).plan(controllers)) as ex:
        ex.run(2)
        print(json.dumps({"pids": ex.pids, "run_dir": ex.run_dir}), flush=True)
        sys.stdout.flush()
        ex.run(steps)
