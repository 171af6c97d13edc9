"""Small module-level nodes for the core tests (module level, so plans can rebuild them)."""

from __future__ import annotations

import msgspec
import torch

from yatt_graph import ANY, BatchPolicy, Graph, Node, Port, Tensor, node


class Prompt(msgspec.Struct):
    text: str


class ImagePrompt(Prompt):
    image_id: int = 0


class Source(Node):
    kind = "data"
    outputs = {"x": Tensor("float32", "B", "T"), "prompt": ImagePrompt}

    def __init__(self, rows: int = 2, cols: int = 3, name: str | None = None):
        super().__init__(name=name)
        self.rows, self.cols = rows, cols

    def forward(self):
        import torch

        return {"x": torch.ones(self.rows, self.cols), "prompt": ImagePrompt("hi", 1)}


class Sum(Node):
    kind = "reward"
    inputs = {"x": Tensor("float32", "B", "T")}
    outputs = {"total": Tensor("float32", "B")}

    def forward(self, x):
        return {"total": x.sum(-1)}


class TakesPrompt(Node):
    inputs = {"prompt": Prompt}
    outputs = {"n": ANY}

    def forward(self, prompt):
        return {"n": len(prompt.text)}


class Loop(Node):
    inputs = {"a": Tensor("float32", "B"), "back": Port(Tensor("float32", "B"), required=False)}
    outputs = {"b": Tensor("float32", "B")}

    def forward(self, a, back):
        return {"b": a if back is None else a + back}


class Fixed(Node):
    inputs = {"x": Tensor("float32", 4, "T")}
    outputs = {"y": Tensor("float32", 4, "T")}

    def forward(self, x):
        return {"y": x}


class Five(Node):
    inputs = {"x": Tensor("float32", 5, "T")}
    outputs = {"y": Tensor("float32", 5, "T")}

    def forward(self, x):
        return {"y": x}


@node(outputs={"y": Tensor("float32", "B")}, kind="advantage")
def scale(x: Tensor("float32", "B"), factor: float = 2.0):
    return {"y": x * factor}


@node(outputs={"y": Tensor("int64", "B")})
def as_int(x: Tensor("int64", "B")):
    return {"y": x}


@node(outputs={"y": Tensor("float32", "B")})
def add(a: Tensor("float32", "B"), b: Tensor("float32", "B")):
    return {"y": a + b}


@node(outputs={"y": Tensor("float32", "B")})
def boom(x: Tensor("float32", "B")):
    raise RuntimeError("exploded on purpose")


class Rows(Node):
    """A data source: ``n`` rows of ``width`` random floats per step, with ragged lengths."""

    kind = "data"
    outputs = {"x": Tensor("float32", "B", "W"), "mask": Tensor("float32", "B", "W")}  # noqa: RUF012

    def __init__(self, n: int = 12, width: int = 16, name: str | None = None, **kw):
        super().__init__(name=name, **kw)
        self.n, self.width = n, width

    def forward(self):
        g = torch.Generator().manual_seed(self.step)
        x = torch.randn(self.n, self.width, generator=g)  # (B, W)
        lengths = torch.randint(1, self.width + 1, (self.n,), generator=g)  # (B,)
        mask = (torch.arange(self.width) < lengths[:, None]).float()  # (B, W)
        return {"x": x, "mask": mask}


class RowWork(Node):
    """Per-row real work (a matmul per row); may be split (it declares a per-call budget).

    ``seen`` records each call's batch size, so a test can tell the call was cut; ``fail_at``
    raises on a row whose first value is above it; ``hang_s`` sleeps that long in each call.
    """

    inputs = {"x": Tensor("float32", "B", "W"), "mask": Tensor("float32", "B", "W")}  # noqa: RUF012
    outputs = {"y": Tensor("float32", "B", "W"), "n": Tensor("int64", "B")}  # noqa: RUF012
    batch_policy = BatchPolicy(max_batch_size=8)

    def __init__(self, fail_at: float = 0.0, hang_s: float = 0.0, name: str | None = None, **kw):
        super().__init__(name=name, **kw)
        self.fail_at, self.hang_s = fail_at, hang_s
        self.weight = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))  # (W, W)
        self.seen: list[int] = []

    def forward(self, x, mask):
        self.seen.append(len(x))
        if self.hang_s:
            import time

            time.sleep(self.hang_s)  # a stuck call
        if self.fail_at and bool((x[:, 0] > self.fail_at).any()):
            raise ValueError(f"a row above {self.fail_at}")
        y = torch.tanh(x @ self.weight) * mask  # (B, W)
        return {"y": y, "n": mask.sum(1).long()}


@node(outputs={"s": Tensor("float32", "B")})
def row_sum(y: Tensor("float32", "B", "W")):
    return {"s": y.sum(1)}


@node(outputs={"v": ANY}, kind="data")
def make_set():
    return {"v": {1, 2}}  # a set: the data plane refuses it (no pickle)


@node(outputs={"n": ANY})
def count(v: ANY):
    return {"n": len(v)}


# --- streaming (runtime/engine/streams.py) ----------------------------------------------------------


class Decode(Node):
    """A streaming rollout stand-in: ``n`` responses of seeded ragged lengths, yielded in
    pieces of finished rows (shortest first), ``pause_s`` of real waiting after the first;
    with ``say_size`` each piece also says the batch size; ``fail_at`` (a step) raises after
    the first piece of that step."""

    kind = "rollout"
    outputs = {
        "ids": Tensor("int64", "B", "T"),
        "length": Tensor("int64", "B"),
        "text": ANY,
    }

    def __init__(
        self,
        n: int = 7,
        pause_s: float = 0.0,
        say_size: bool = False,
        fail_at: int = -1,
        name: str | None = None,
        **kw,
    ):
        super().__init__(name=name, **kw)
        self.n, self.pause_s, self.say_size, self.fail_at = n, pause_s, say_size, fail_at

    def forward_stream(self):
        import time

        g = torch.Generator().manual_seed(self.step)
        lengths = torch.randint(1, 6, (self.n,), generator=g)  # (n,)
        ids = torch.randint(3, 50, (self.n, 5), generator=g)  # (n, 5)
        for t in range(1, 6):
            rows = [i for i in range(self.n) if int(lengths[i]) == t]
            if rows:
                yield (
                    rows,
                    {
                        "ids": ids[rows, :t],  # (r, t)
                        "length": lengths[rows],  # (r,)
                        "text": [f"r{i}:{t}" for i in rows],
                    },
                    *([self.n] if self.say_size else []),  # the batch size, when said
                )
                if self.pause_s:
                    time.sleep(self.pause_s)
                    self.pause_s = 0.0
                if self.step == self.fail_at:
                    raise RuntimeError(f"decode broke mid-stream at step {self.step}")


class Score(Node):
    """Per-sample scores: it may be called on any part of a batch (a per-call budget)."""

    kind = "reward"
    batch_policy = BatchPolicy(max_batch_size=64)
    inputs = {
        "ids": Tensor("int64", "B", "T"),
        "length": Tensor("int64", "B"),
        "text": ANY,
    }
    outputs = {"score": Tensor("float32", "B"), "tag": ANY}
    calls: list[int] = []

    def __init__(self, per_row: bool = True, name: str | None = None, **kw):
        super().__init__(name=name, **kw)
        self.per_row = per_row
        self.calls = []

    def forward(self, ids, length, text):
        self.calls.append(len(text))
        score = ids.sum(-1).float() / length.float()
        tag = [t.upper() for t in text] if self.per_row else "all"
        return {"score": score, "tag": tag}


class Mean(Node):
    """Needs the whole batch."""

    batch_policy = BatchPolicy(splittable=False)
    inputs = {"score": Tensor("float32", "B"), "prev": Port(Tensor("int64", "B"), required=False)}
    outputs = {"mean": Tensor("float32"), "prev_total": ANY}

    def forward(self, score, prev):
        return {"mean": score.mean(), "prev_total": -1 if prev is None else int(prev.sum())}


class LengthScore(Node):
    """A per-sample score of rollout outputs; it may be called on any part of a batch."""

    kind = "reward"
    batch_policy = BatchPolicy(max_batch_size=64)
    inputs = {"response_lengths": Tensor("int64", "B"), "texts": ANY}
    outputs = {"score": Tensor("float32", "B")}

    def __init__(self, name: str | None = None, **kw):
        super().__init__(name=name, **kw)
        self.calls = []

    def forward(self, response_lengths, texts):
        self.calls.append(len(texts))
        chars = torch.tensor([float(len(t)) for t in texts])  # (b,)
        return {"score": chars / response_lengths.float()}


def loop_graph() -> Graph:
    """A source summed into a loop that adds its own value of the step before (a delayed
    edge): step k outputs 3 * (k + 1)."""
    with Graph("acc") as g:
        total = Sum(name="sum")(Source(rows=2, cols=3, name="src")().x)
        loop = Loop(name="loop")
        out = loop(total)
        g.connect(out, loop, "back", delay=1)
        g.output("out", out)
    return g


def scaled_loop(
    name: str, scales: dict[str, float], *, source: dict | None = None, **sum_options
) -> Graph:
    """src -> sum -> one ``scale`` node per entry of ``scales`` (name -> factor) -> a loop fed
    its own output of the step before; the graph outputs ``out`` and the source's ``prompt``."""
    with Graph(name) as g:
        src = Source(name="src", **(source or {}))()
        x = Sum(name="sum", **sum_options)(src.x)
        for step, factor in scales.items():
            x = scale(x, factor=factor, name=step)
        loop = Loop(name="loop")
        out = loop(x)
        g.connect(out, loop, "back", delay=1)
        g.output("out", out)
        g.output("prompt", src.prompt)
    return g
