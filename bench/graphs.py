"""Graphs for the runtime benchmarks (module level, so controllers rebuild them from the plan)."""

from __future__ import annotations

import math
from typing import Any

import torch
from PIL import Image

from yatt_graph import ANY, BatchPolicy, Graph, Node, Tensor
from yatt_graph.stream import join_pieces

__all__ = ["build_graph"]


class Tick(Node):
    """An empty data source: a 1-element tensor, the smallest payload there is."""

    kind = "data"
    outputs = {"x": Tensor("int64", 1)}

    def forward(self) -> dict[str, Any]:
        return {"x": torch.tensor([self.step])}  # (1,)


class Pass(Node):
    """Does nothing but hand its input on."""

    inputs = {"x": Tensor("int64", 1)}
    outputs = {"x": Tensor("int64", 1)}

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"x": x}


class Blob(Node):
    """A tensor of ``nbytes``, made once (its pages faulted) and returned every step."""

    kind = "data"
    outputs = {"blob": Tensor("uint8", "N")}

    def __init__(self, nbytes: int = 1 << 20, name: str | None = None, **kw: Any):
        super().__init__(name=name, **kw)
        self.blob = torch.ones(nbytes, dtype=torch.uint8)  # (N,)

    def forward(self) -> dict[str, Any]:
        return {"blob": self.blob}


class Size(Node):
    inputs = {"blob": Tensor("uint8", "N")}
    outputs = {"n": ANY}

    def forward(self, blob: torch.Tensor) -> dict[str, Any]:
        return {"n": int(blob.numel())}


class ImageBatch(Node):
    """``batch`` RGB images of ``size``x``size`` plus per-sample embeddings and token ids."""

    kind = "data"
    outputs = {
        "images": ANY,
        "embeds": Tensor("float32", "B", 1024),
        "ids": Tensor("int64", "B", 256),
    }

    def __init__(self, batch: int = 16, size: int = 224, name: str | None = None, **kw: Any):
        super().__init__(name=name, **kw)
        self.batch, self.size = batch, size
        pixels = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8).numpy()
        self.images = [Image.fromarray(p, "RGB") for p in pixels]

    def forward(self) -> dict[str, Any]:
        return {
            "images": self.images,
            "embeds": torch.randn(self.batch, 1024),  # (B, 1024)
            "ids": torch.randint(0, 32000, (self.batch, 256)),  # (B, 256)
        }


class Consume(Node):
    inputs = {
        "images": ANY,
        "embeds": Tensor("float32", "B", 1024),
        "ids": Tensor("int64", "B", 256),
    }
    outputs = {"summary": ANY}

    def forward(
        self, images: list[Image.Image], embeds: torch.Tensor, ids: torch.Tensor
    ) -> dict[str, Any]:
        return {
            "summary": {
                "images": len(images),
                "embed_sum": float(embeds.sum()),
                "ids": int(ids[0, 0]),
            }
        }


def build_graph(kind: str = "tick", **options: Any) -> Graph:
    with Graph(f"bench_{kind}") as g:
        if kind == "tick":
            g.output("x", Tick(placement=0, name="tick")())
        elif kind == "chain":
            x = Tick(placement=0, name="n0")()
            for i in range(1, options.get("length", 8)):
                x = Pass(placement=i % options.get("controllers", 2), name=f"n{i}")(x)
            g.output("x", x)
        elif kind == "blob":
            blob = Blob(options.get("nbytes", 1 << 20), placement=0, name="source")()
            g.output("n", Size(placement=1, name="sink")(blob))
        elif kind == "images":
            batch = ImageBatch(
                options.get("batch", 16), options.get("size", 224), placement=0, name="source"
            )()
            g.output("summary", Consume(placement=1, name="sink")(*batch))
        elif kind in ("stream", "stream_whole"):
            gen = Generate if kind == "stream" else GenerateWhole
            out = gen(**options.get("generate", {}), placement=0, name="generate")()
            judge = Judge(**options.get("judge", {}), placement=1, name="judge")
            g.output("score", judge(out.state, out.length))
        else:
            raise ValueError(f"unknown benchmark graph {kind!r}")
    return g


class Generate(Node):
    """A decode loop over ``prompts`` rows of seeded ragged lengths (lognormal, median
    ``median_len``, capped at ``max_len``): one ``[active, D] @ [D, D]`` matmul per token over
    the rows still generating. Streams: every ``chunk`` tokens it yields the rows that
    finished since the last piece."""

    kind = "rollout"
    outputs = {"state": Tensor("float32", "B", "D"), "length": Tensor("int64", "B")}

    def __init__(
        self,
        prompts: int = 64,
        dim: int = 512,
        median_len: int = 48,
        max_len: int = 192,
        chunk: int = 16,
        name: str | None = None,
        **kw: Any,
    ):
        super().__init__(name=name, **kw)
        self.prompts, self.dim, self.chunk = prompts, dim, chunk
        self.median_len, self.max_len = median_len, max_len
        g = torch.Generator().manual_seed(1)
        self.weight = torch.randn(dim, dim, generator=g) / dim**0.5  # (D, D)

    def forward_stream(self) -> Any:
        g = torch.Generator().manual_seed(self.step)
        raw = torch.empty(self.prompts).log_normal_(math.log(self.median_len), 0.7, generator=g)
        lengths = raw.round().clamp(1, self.max_len).long()  # (B,)
        h = torch.randn(self.prompts, self.dim, generator=g) / self.dim**0.5  # (B, D)
        active = list(range(self.prompts))
        done: list[int] = []
        for t in range(1, int(lengths.max()) + 1):
            idx = torch.tensor(active)  # (a,)
            h[idx] = torch.tanh(h[idx] @ self.weight)  # (a, D)
            done += [i for i in active if int(lengths[i]) == t]
            active = [i for i in active if int(lengths[i]) > t]
            if done and (t % self.chunk == 0 or not active):
                yield done, {"state": h[done].clone(), "length": lengths[done]}
                done = []


class GenerateWhole(Generate):
    """The same generation, returned whole at the end (no streaming)."""

    streaming = False  # type: ignore[assignment]

    def forward(self) -> dict[str, Any]:
        return join_pieces(list(self.forward_stream()), self.name)


class Judge(Node):
    """A generative reward: reads each response (a ``[L, D] @ [D, D]`` prefill), then decodes
    a ``critique``-token answer for the batch. May be called on any part of a batch."""

    kind = "reward"
    batch_policy = BatchPolicy(max_batch_size=64)
    inputs = {"state": Tensor("float32", "B", "D"), "length": Tensor("int64", "B")}
    outputs = {"score": Tensor("float32", "B")}

    def __init__(self, dim: int = 512, critique: int = 24, name: str | None = None, **kw: Any):
        super().__init__(name=name, **kw)
        self.critique = critique
        g = torch.Generator().manual_seed(2)
        self.weight = torch.randn(dim, dim, generator=g) / dim**0.5  # (D, D)

    def forward(self, state: torch.Tensor, length: torch.Tensor) -> dict[str, Any]:
        g = torch.Generator().manual_seed(int(length.sum()))
        for n in length.tolist():
            torch.tanh(torch.randn(n, state.shape[1], generator=g) @ self.weight)  # (L, D)
        h = state  # (b, D)
        for _ in range(self.critique):
            h = torch.tanh(h @ self.weight)  # (b, D)
        return {"score": h[:, 0].contiguous()}  # (b,)
