"""SampleBatch: construction checks, select/split/concat/reorder, and the wire round trip."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from nodes.batch import SampleBatch, inverse_permutation


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality, NaN included: same dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def _images_equal(a: Image.Image, b: Image.Image) -> bool:
    return (
        a.mode == b.mode
        and a.size == b.size
        and a.tobytes() == b.tobytes()
        and a.getpalette() == b.getpalette()
    )


def assert_batches_equal(a: SampleBatch, b: SampleBatch) -> None:
    assert len(a) == len(b)
    assert list(a.tensors) == list(b.tensors) and list(a.fields) == list(b.fields)
    for k in a.tensors:
        assert _bytes_equal(a.tensors[k], b.tensors[k]), k
    for k in a.fields:
        assert len(a.fields[k]) == len(b.fields[k])
        for x, y in zip(a.fields[k], b.fields[k]):
            if isinstance(x, Image.Image):
                assert isinstance(y, Image.Image) and _images_equal(x, y), k
            elif isinstance(x, torch.Tensor):
                assert _bytes_equal(x, y), k
            else:
                assert x == y, k


def make_batch(n: int = 5) -> SampleBatch:
    g = torch.Generator().manual_seed(0)
    return SampleBatch(
        {
            "x": torch.randn(n, 3, generator=g),
            "ids": torch.arange(n * 2).reshape(n, 2),
            "mask": torch.arange(n) % 2 == 0,
        },
        {"texts": [f"t{i}" for i in range(n)], "meta": [{"i": i} for i in range(n)]},
    )


# --- construction ---------------------------------------------------------------------------


def test_len_keys_getitem():
    b = make_batch(4)
    assert len(b) == 4
    assert b.keys() == ["x", "ids", "mask", "texts", "meta"]
    assert b["texts"][2] == "t2" and b["x"].shape == (4, 3)
    assert "ids" in b and "nope" not in b
    with pytest.raises(KeyError, match="no 'nope'"):
        b["nope"]
    with pytest.raises(TypeError, match="select"):
        b[0]


def test_length_mismatch_names_the_field():
    with pytest.raises(ValueError, match="field 'texts' has 2 samples but the batch has 3"):
        SampleBatch({"x": torch.zeros(3, 1)}, {"texts": ["a", "b"]})
    with pytest.raises(ValueError, match="tensor 'y' has 4 samples"):
        SampleBatch({"x": torch.zeros(3), "y": torch.zeros(4)})
    with pytest.raises(ValueError, match="length=2"):
        SampleBatch({"x": torch.zeros(3)}, length=2)


def test_construction_refuses_bad_values():
    with pytest.raises(ValueError, match="0-d"):
        SampleBatch({"x": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="field 'texts' must be a list"):
        SampleBatch(fields={"texts": "abc"})
    with pytest.raises(TypeError, match="tensor 'x' is a list"):
        SampleBatch({"x": [1, 2]})
    with pytest.raises(ValueError, match="both a tensor and a field"):
        SampleBatch({"x": torch.zeros(1)}, {"x": [1]})


def test_from_dict_and_to_dict():
    d = {"x": torch.zeros(2, 3), "texts": ["a", "b"]}
    b = SampleBatch.from_dict(d)
    assert list(b.tensors) == ["x"] and list(b.fields) == ["texts"]
    assert b.to_dict().keys() == d.keys()
    with pytest.raises(TypeError, match="'n' is a int"):
        SampleBatch.from_dict({"n": 3})


# --- sample operations ------------------------------------------------------------------------


def test_select_orders_repeats_and_masks():
    b = make_batch(5)
    s = b.select([4, 0, 0, -1])
    assert len(s) == 4
    assert s["texts"] == ["t4", "t0", "t0", "t4"]
    assert torch.equal(s["x"], b["x"][[4, 0, 0, 4]])
    m = b.select(b["mask"])
    assert m["texts"] == ["t0", "t2", "t4"]
    assert len(b.select([])) == 0 and b.select([])["x"].shape == (0, 3)
    assert torch.equal(b.select(torch.tensor([1, 2]))["ids"], b["ids"][1:3])
    with pytest.raises(IndexError, match="index 5 is out of range for a batch of 5"):
        b.select([5])
    with pytest.raises(ValueError, match="bool mask must have shape"):
        b.select(torch.tensor([True, False]))


def test_reorder_and_inverse_permutation():
    b = make_batch(5)
    perm = [2, 0, 3, 4, 1]
    r = b.reorder(perm)
    assert r["texts"] == ["t2", "t0", "t3", "t4", "t1"]
    assert torch.equal(r["x"], b["x"][perm])
    assert inverse_permutation(perm) == [1, 4, 0, 2, 3]
    assert_batches_equal(r.reorder(inverse_permutation(perm)), b)
    assert_batches_equal(r.reorder(inverse_permutation(torch.tensor(perm))), b)
    with pytest.raises(ValueError, match="not a permutation of range\\(5\\)"):
        b.reorder([0, 0, 1, 2, 3])
    with pytest.raises(ValueError, match="not a permutation"):
        inverse_permutation([0, 2])


def test_split_by_count_and_sizes():
    b = make_batch(5)
    parts = b.split(3)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert parts[2]["texts"] == ["t4"]
    assert [len(p) for p in b.split([0, 5, 0])] == [0, 5, 0]
    assert [len(p) for p in b.split(7)] == [1, 1, 1, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="sum to the batch size 5"):
        b.split([2, 2])
    with pytest.raises(ValueError, match=">= 1"):
        b.split(0)


def test_concat_round_trip_and_errors():
    b = make_batch(5)
    assert_batches_equal(SampleBatch.concat(b.split([2, 3])), b)
    with pytest.raises(ValueError, match="no batches"):
        SampleBatch.concat([])
    other = SampleBatch({"x": torch.zeros(1, 3)}, {"texts": ["a"]})
    with pytest.raises(
        ValueError, match=r"batch 1 has tensor keys \['x'\].*missing \['ids', 'mask'\]"
    ):
        SampleBatch.concat([b, other])
    wide = SampleBatch({**b.tensors, "x": torch.zeros(5, 4)}, b.fields)
    with pytest.raises(ValueError, match="tensor 'x' is float32\\[5, 4\\].*pad to a common length"):
        SampleBatch.concat([b, wide])
    ints = SampleBatch({**b.tensors, "x": torch.zeros(5, 3, dtype=torch.int64)}, b.fields)
    with pytest.raises(ValueError, match="dtype, device"):
        SampleBatch.concat([b, ints])


def test_to_device_keeps_fields():
    b = make_batch(2)
    c = b.to("cpu")
    assert c.fields["texts"] is b.fields["texts"]
    assert_batches_equal(b, c)


@st.composite
def batch_and_sizes(draw):
    n = draw(st.integers(0, 12))
    width = draw(st.integers(0, 3))
    cut = draw(st.lists(st.integers(0, n), max_size=4))
    bounds = [0, *sorted(cut), n]
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    values = draw(
        st.lists(st.floats(allow_nan=True, width=32), min_size=n * width, max_size=n * width)
    )
    x = torch.tensor(values, dtype=torch.float32).reshape(n, width)
    texts = draw(st.lists(st.text(max_size=5), min_size=n, max_size=n))
    return SampleBatch({"x": x, "i": torch.arange(n)}, {"texts": texts}), sizes


@settings(max_examples=50, deadline=None)
@given(batch_and_sizes())
def test_property_split_then_concat_is_identity(case):
    batch, sizes = case
    assert_batches_equal(SampleBatch.concat(batch.split(sizes)), batch)
    n = max(1, len(sizes))
    assert_batches_equal(SampleBatch.concat(batch.split(n)), batch)


# --- wire -----------------------------------------------------------------------------------


def _palette_image() -> Image.Image:
    im = Image.new("P", (3, 2))
    im.putpalette(list(range(30)))
    im.putpixel((1, 1), 7)
    return im


def wire_batch() -> SampleBatch:
    g = torch.Generator().manual_seed(1)
    f32 = torch.randn(3, 4, generator=g)
    f32[0, 0] = float("nan")
    f32[1, 1] = float("-inf")
    return SampleBatch(
        {
            "f32": f32,
            "i64": torch.randint(-(2**62), 2**62, (3, 2), generator=g),
            "bool": torch.tensor([True, False, True]),
            "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "strided": torch.randn(4, 3, generator=g).t(),  # (3, 4), not contiguous
            "empty_cols": torch.zeros(3, 0, 2),
            "u8": torch.arange(6, dtype=torch.uint8).reshape(3, 2),
            "f16": torch.randn(3, generator=g).half(),
        },
        {
            "texts": ["a", "ü€", ""],
            "meta": [{"answer": "4", "score": 0.1}, {"nested": [1, [2, None]]}, {}],
            "images": [
                Image.new("RGB", (4, 3), (10, 20, 30)),
                Image.new("L", (2, 5), 200),
                _palette_image(),
            ],
            "ragged": [torch.arange(2), torch.zeros(0), torch.ones(2, 2).bfloat16()],
        },
    )
