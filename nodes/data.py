"""A synthetic multimodal task that needs the image: coloured shapes drawn with pillow.

Each sample is a small RGB image with one or more shapes of one colour on a plain
background, a prompt asking for the colour, the shape or the count, and the answer in
``meta``. The answer cannot be guessed from the prompt: every prompt of a task reads the
same, so a policy must look at the image to beat chance. Samples are a pure function of
``(seed, index)``, so a run resumed at any position sees exactly the same data.
"""

from __future__ import annotations

import random
from typing import Any

from PIL import Image, ImageDraw

from yatt_graph import ANY, Node, Port

__all__ = [
    "COLORS",
    "COUNTS",
    "SHAPES",
    "TASKS",
    "ShapesSource",
    "answer_reward",
    "make_sample",
    "task_vocabulary",
]

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 40),
}
SHAPES = ("circle", "square", "triangle")
COUNTS = ("one", "two", "three")
TASKS = {
    "color": "what color is the shape ?",
    "shape": "what shape is it ?",
    "count": "how many shapes ?",
}


def _draw_shape(
    draw: ImageDraw.ImageDraw,
    shape: str,
    box: tuple[int, int, int, int],
    fill: tuple[int, int, int],
) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)


def make_sample(
    seed: int, index: int, task: str = "color", size: int = 32, text_hint: bool = False
) -> tuple[Image.Image, str, dict[str, Any]]:
    """The sample at ``index`` of the stream for ``seed``: (image, prompt, meta).

    With ``text_hint`` the prompt also describes the image in words ("it is one red square ."),
    which makes a text-only version of the task.
    """
    if task not in TASKS:
        raise ValueError(f"make_sample: task {task!r} is not one of {sorted(TASKS)}")
    rng = random.Random(seed * 1_000_003 + index)
    color = rng.choice(sorted(COLORS))
    shape = rng.choice(SHAPES)
    count = rng.randrange(1, 4) if task == "count" else 1
    background = tuple(rng.randrange(0, 60) for _ in range(3))
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    cell = size // 2 if count > 1 else size
    spots = rng.sample([(0, 0), (1, 0), (0, 1), (1, 1)], count) if count > 1 else [(0, 0)]
    for cx, cy in spots:
        margin = max(2, cell // 6)
        extent = rng.randrange(cell // 2, cell - margin + 1)
        x0 = cx * cell + rng.randrange(1, max(2, cell - extent))
        y0 = cy * cell + rng.randrange(1, max(2, cell - extent))
        _draw_shape(draw, shape, (x0, y0, x0 + extent - 1, y0 + extent - 1), COLORS[color])
    answer = {"color": color, "shape": shape, "count": COUNTS[count - 1]}[task]
    choices = {"color": sorted(COLORS), "shape": list(SHAPES), "count": list(COUNTS)}[task]
    meta = {
        "answer": answer,
        "choices": choices,
        "color": color,
        "shape": shape,
        "count": count,
        "index": index,
    }
    prompt = TASKS[task]
    if text_hint:
        prompt = f"it is {COUNTS[count - 1]} {color} {shape} . {prompt}"
    return image, prompt, meta


def task_vocabulary() -> list[str]:
    """Every word the prompts and answers use, in a fixed order (a word tokenizer's vocabulary)."""
    words = [w for prompt in TASKS.values() for w in prompt.split()]
    words += ["it", "is", "."] + sorted(COLORS) + list(SHAPES) + list(COUNTS)
    return list(dict.fromkeys(words))


def answer_reward(text: str, meta: dict[str, Any], format_bonus: float = 0.2) -> float:
    """1 when the response begins with the answer; ``format_bonus`` when it begins with another
    valid choice (``meta["choices"]``: an answer of the right kind, but wrong); 0 otherwise.

    Words are compared without case and without the punctuation around them, and numbers by
    value, so ``"Red."`` matches ``"red"``, ``"42"`` matches ``42`` and ``"3.0"`` matches
    ``"3"``; an answer of several words must begin the response word for word.

    With the bonus, a policy that always names some colour scores 0.25 + 0.75 * 0.2 = 0.4 on
    the colour task: that is chance for a policy that ignores the image.
    """
    words = _words(text, keep_empty=True)  # a stray "." first is a wrong first word

    def begins_with(answer: Any) -> bool:
        want = _words(answer)
        return bool(want) and len(words) >= len(want) and all(map(_same, words, want))

    if begins_with(meta["answer"]):
        return 1.0
    return format_bonus if any(begins_with(c) for c in meta.get("choices", ())) else 0.0


answer_reward.reads_meta = ("answer",)  # type: ignore[attr-defined]


def _words(text: Any, keep_empty: bool = False) -> list[str]:
    """The words of ``text`` (any value, as str), lower-cased, without surrounding punctuation
    (a word of punctuation alone is left out, or kept as ``""`` with ``keep_empty``)."""
    words = [w.strip(".,!?").lower() for w in str(text).split()]
    return words if keep_empty else [w for w in words if w]


def _same(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


class ShapesSource(Node):
    """Per step, ``batch_size`` samples of the shapes task, read from a seeded stream.

    Its state is the position in the stream, so checkpoints resume the data exactly.
    ``emit_rows`` adds the ``rows`` output: per prompt ``{"file": "shapes:TASK", "row": i}``,
    ``i`` its index in the stream (``meta["index"]``).
    """

    kind = "data"
    outputs = {"images": ANY, "prompts": ANY, "meta": ANY}

    def __init__(
        self,
        batch_size: int = 8,
        task: str = "color",
        seed: int = 0,
        image_size: int = 32,
        text_hint: bool = False,
        emit_rows: bool = False,
        name: str | None = None,
    ):
        super().__init__(name=name)
        if task not in TASKS:
            raise ValueError(f"node {self.name!r}: task {task!r} is not one of {sorted(TASKS)}")
        if batch_size < 1:
            raise ValueError(f"node {self.name!r}: batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.task, self.seed, self.image_size = batch_size, task, seed, image_size
        self.text_hint, self.emit_rows = text_hint, emit_rows
        if emit_rows:  # where each sample came from, for the run's samples
            self.outputs["rows"] = Port(ANY, doc="[{'file': 'shapes:TASK', 'row': index}]")
        self.position = 0

    def forward(self) -> dict[str, Any]:
        samples = [
            make_sample(self.seed, self.position + i, self.task, self.image_size, self.text_hint)
            for i in range(self.batch_size)
        ]
        self.position += self.batch_size
        images, prompts, meta = (list(x) for x in zip(*samples))
        out = {"images": images, "prompts": prompts, "meta": meta}
        if self.emit_rows:
            out["rows"] = [{"file": f"shapes:{self.task}", "row": m["index"]} for m in meta]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
