"""A grouped node's call reaches its other ranks (runtime/ranks/group.py) through the one codec
(runtime/codec/): in a real 2-rank gloo group, rank 1 compares what it received with what
rank 0 sent and leaves its verdict in the group's store. An error every rank raises leaves
the group in step; one rank's alone breaks it, named."""

from __future__ import annotations

import msgspec
import pytest
import torch
from PIL import Image

from nodes.update.trainer import Trainer
from runtime.codec import UnsupportedValueError
from runtime.engine.calls import node_op
from runtime.ranks.group import RankError, start_groups
from yatt_graph import ANY, Node


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
    """A node whose other rank checks each call's values against :func:`sent`; ``fail`` makes
    every rank (``"all"``) or rank 1 alone (``"rank 1"``) raise before the call's collective."""

    inputs = {"values": ANY, "call": ANY, "fail": ANY}
    outputs = {"ranks": ANY}
    ranks = 2
    rank_timeout_s = 20.0

    def build(self) -> None:
        self.rank_group.join()

    def forward(self, values, call, fail):
        group = self.rank_group
        if group.rank > 0:
            verdict = differences(values, sent()) or ["equal"]
            group.store.set(f"test/verdict/{call}", "; ".join(verdict).encode())
        if fail == "all" or fail == f"rank {group.rank}":
            raise ValueError(f"asked to fail on rank {group.rank}")
        return {"ranks": group.all_sum([1.0])[0]}


def _call(call: int, fail: str = "", values=None) -> dict:
    return {"values": sent() if values is None else values, "call": call, "fail": fail}


@pytest.mark.timeout(120)
def test_a_calls_values_reach_the_other_rank_equal():
    node = Echo()
    start_groups({node.name: node})
    group = node.rank_group
    try:
        node.setup()
        bad = {"ids": torch.arange(3), "tags": {"a", "b"}}
        with pytest.raises(UnsupportedValueError, match=r"node 'echo' run of step 0\['value'\]\['values'\]\['tags'\]: a builtins.set"):  # fmt: skip
            node_op(node, "run", _call(-1, values=bad))  # refused before anything is sent
        for call in range(2):
            assert node_op(node, "run", _call(call)) == {"ranks": 2.0}
            assert group.store.get(f"test/verdict/{call}").decode() == "equal"
        with pytest.raises(ValueError, match="every rank; call it through an executor"):
            Trainer("echo", None, torch.device("cpu"), (), group).call({}, lambda v: {})
    finally:
        group.close()
    assert group.broken is None and group.procs[0].returncode == 0


@pytest.mark.timeout(120)
def test_an_error_every_rank_raises_leaves_the_group_in_step():
    """Bad inputs fail alike on every rank: rank 0's error is the caller's, as it is, and the
    next call runs on the whole group."""
    node = Echo()
    start_groups({node.name: node})
    group = node.rank_group
    try:
        node.setup()
        with pytest.raises(ValueError, match="asked to fail on rank 0"):
            node_op(node, "run", _call(0, fail="all"))
        assert node_op(node, "run", _call(1)) == {"ranks": 2.0}
        assert group.store.get("test/verdict/1").decode() == "equal"
    finally:
        group.close()
    assert group.broken is None and group.procs[0].returncode == 0


@pytest.mark.timeout(120)
def test_a_rank_that_fails_alone_breaks_the_group_with_its_error():
    """Rank 1 raises where rank 0 goes on into a collective it will never join: the call ends
    as a RankError naming rank 1's error and the group as out of step (on gloo when the
    collective times out; on NCCL when the supervisor aborts it, a grace period after the
    report), not as a bare collective timeout."""
    node = Echo()
    start_groups({node.name: node})
    group = node.rank_group
    try:
        node.setup()
        pattern = (
            r"node 'echo': rank 1 failed: ValueError: node 'echo': asked to fail on rank 1, "
            r".*the group is out of step"
        )
        with pytest.raises(RankError, match=pattern):
            node_op(node, "run", _call(0, fail="rank 1"))
        with pytest.raises(RankError, match=pattern):  # broken from then on
            node_op(node, "run", _call(1))
    finally:
        group.close()
