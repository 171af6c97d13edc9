"""Small module-level nodes for the core tests (module level, so plans can rebuild them)."""

from __future__ import annotations

import msgspec

from yatt_graph import ANY, Node, Port, Tensor, node


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
