"""Graphs for the runtime benchmarks (module level, so controllers rebuild them from the plan)."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from yatt_graph import ANY, Graph, Node, Tensor

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
        else:
            raise ValueError(f"unknown benchmark graph {kind!r}")
    return g
