"""A call's values reach the other ranks of a group (runtime/ranks/group.py) through the one
codec (runtime/codec/): in a real 2-rank gloo group, rank 1 compares what it received with
what rank 0 sent and leaves its verdict in the group's store."""

from __future__ import annotations

import msgspec
import pytest
import torch
from PIL import Image

from runtime.codec import UnsupportedValueError
from runtime.ranks.group import start_groups
from yatt_graph import Node


class Point(msgspec.Struct):
    x: int
    label: str


def sent() -> dict:
    """A call's values of kinds beyond tensors: built alike on each rank."""
    gray = Image.new("P", (3, 2))
    gray.putpalette([0, 0, 0, 255, 0, 0] * 128)
    return {
        "tensors": {"ids": torch.arange(6).view(2, 3), "big": torch.arange(4096.0).view(64, 64)},
        "bf16": torch.linspace(-1, 1, 1000).to(torch.bfloat16),  # (1000,) 2000 bytes: a frame
        "text": "name the shape",
        "numbers": [3, 0.5, True, None],
        "point": Point(1, "a"),
        "images": [Image.new("RGB", (40, 30), (10, 20, 30)), gray],
    }


def differences(got, want, where: str = "values") -> list[str]:
    """Where ``got`` differs from ``want`` (tensors by dtype, shape and bits; images by mode,
    size, pixels and palette)."""
    if type(got) is not type(want):
        return [f"{where}: a {type(got).__name__}, not a {type(want).__name__}"]
    if isinstance(want, torch.Tensor):
        same = got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        return [] if same else [f"{where}: another tensor ({got.dtype}, {[*got.shape]})"]
    if isinstance(want, Image.Image):
        fields = lambda im: (im.mode, im.size, im.tobytes(), im.getpalette())  # noqa: E731
        return [] if fields(got) == fields(want) else [f"{where}: another image"]
    if isinstance(want, dict):
        if sorted(got) != sorted(want):
            return [f"{where}: keys {sorted(got)} != {sorted(want)}"]
        return [d for k in want for d in differences(got[k], want[k], f"{where}[{k!r}]")]
    if isinstance(want, list) and len(got) == len(want):
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{where}[{i}]")]  # fmt: skip
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


class Echo(Node):
    """A node whose other rank checks each call's values against :func:`sent`."""

    ranks = 2
    rank_timeout_s = 60.0

    def build(self) -> None:
        self.rank_group.join()

    def serve_rank(self, op: str, values: dict, meta: dict) -> None:
        verdict = differences(values, sent()) or ["equal"]
        self.rank_group.store.set(f"test/verdict/{meta['call']}", "; ".join(verdict).encode())


@pytest.mark.timeout(120)
def test_a_calls_values_reach_the_other_rank_equal():
    node = Echo()
    start_groups({node.name: node})
    group = node.rank_group
    try:
        node.setup()
        bad = {"ids": torch.arange(3), "tags": {"a", "b"}}
        with pytest.raises(UnsupportedValueError, match=r"node 'echo' step values\['tags'\]: a builtins.set"):  # fmt: skip
            group.command("step", bad, {"call": -1})  # refused before anything is sent
        for call in range(2):
            with group.guard(f"call {call}"):
                group.command("step", sent(), {"call": call})
            assert group.store.get(f"test/verdict/{call}").decode() == "equal"
    finally:
        group.close()
    assert group.broken is None and group.procs[0].returncode == 0
