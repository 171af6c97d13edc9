"""The data-plane codec and the message headers: round trips, refusals, garbage. Runs in ~5 s."""

from __future__ import annotations

import collections
import enum
import math

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from runtime.codec import (
    INLINE_BYTES,
    TENSOR_DTYPES,
    DecodeError,
    UnsupportedValueError,
    decode_value,
    encode_value,
    register_struct,
)
from runtime.zmq import messages as m
from runtime.zmq.transport import ShmPool, ShmReader, remove_run_segments


class Point(msgspec.Struct):
    x: int
    t: torch.Tensor | None = None
    tags: list[str] = []


class Packed(msgspec.Struct, array_like=True):
    a: int
    b: str


def _wire(frames):
    """What the receiver sees: bytes per frame (as if sent and received)."""
    return [bytes(memoryview(f).cast("B")) for f in frames]


def roundtrip(value, **kw):
    return decode_value(_wire(encode_value(value, **kw)))


DTYPES = [getattr(torch, n) for n in TENSOR_DTYPES if hasattr(torch, n)]


def _bytes_of(t):
    return t.reshape(-1).view(torch.uint8)  # (numel * itemsize,)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (7, 33), (300, 7)], ids=str)
def test_tensor_roundtrip_is_bitwise(dtype, shape):
    """Every dtype of the codec's table, filled with random bytes (NaN payloads, subnormals,
    signed zeros), comes back bit for bit, inline and in a frame."""
    numel = math.prod(shape)
    itemsize = dtype.itemsize
    gen = torch.Generator().manual_seed(numel)
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, high, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    t = raw.view(dtype).reshape(shape)
    for kw in ({}, {"inline": 0}):
        out = roundtrip(t, **kw)
        assert out.dtype == dtype and out.shape == t.shape
        assert torch.equal(_bytes_of(out), _bytes_of(t))


def test_small_tensors_inline_large_ones_in_frames():
    small, large = torch.ones(INLINE_BYTES // 4), torch.ones(INLINE_BYTES)
    assert len(encode_value(small)) == 1
    frames = encode_value(large)
    assert len(frames) == 2 and memoryview(frames[1]).nbytes == INLINE_BYTES * 4


def test_frames_share_memory_with_the_tensor_on_both_sides():
    t = torch.arange(100_000, dtype=torch.float32)
    frames = encode_value(t)
    assert np.shares_memory(frames[1], t.numpy().view(np.uint8))
    received = bytearray(memoryview(frames[1]).cast("B"))  # writable, like a zmq frame
    out = decode_value([frames[0], received])
    received[:4] = b"\0\0\0\0"
    out[0] = 0.0  # no copy on decode: the tensor is the frame
    assert out[1] == 1.0 and received[4:8] == bytes(memoryview(t[1:2].numpy()).cast("B"))


def test_noncontiguous_conj_and_grad_tensors():
    t = torch.randn(6, 5)
    assert torch.equal(roundtrip(t.t()), t.t())
    assert torch.equal(roundtrip(t[::2, 1:]), t[::2, 1:])
    assert torch.equal(roundtrip(t.expand(2, 6, 5)), t.expand(2, 6, 5))
    c = torch.randn(3, dtype=torch.complex64)
    assert torch.equal(roundtrip(c.conj()), c.conj().resolve_conj())
    neg = c.conj().imag  # a real view with the negative bit set
    assert neg.is_neg() and torch.equal(roundtrip(neg), neg.resolve_neg())
    small = roundtrip(t[:2, :2].t())  # inline (small), non-contiguous: a writable copy
    small[0, 0] = 7.0
    assert torch.equal(small[1:], t[:2, :2].t()[1:]) and t[0, 0] != 7.0
    w = torch.randn(4, requires_grad=True)
    out = roundtrip(w * 2)
    assert not out.requires_grad and torch.equal(out, (w * 2).detach())


def test_large_bounded_tensor():
    t = torch.randn(4, 1024, 1024)  # 16 MB
    out = roundtrip(t)
    assert torch.equal(out, t)


def test_nested_values_round_trip():
    value = {
        "none": None, "bool": True, "int": -(2**63), "uint": 2**64 - 1, "float": float("inf"),
        "str": "héllo", "bytes": b"\x00\xff", "big_bytes": b"x" * 200_000,
        "list": [1, [2, [3, torch.ones(2)]]], "tuple": (1, (2, "3"), []), "empty": {},
        "np": np.arange(12, dtype=np.float64).reshape(3, 4).T, "np_scalar": np.float32(1.5),
        "np_bool": np.array([True, False]),
    }  # fmt: skip
    out = roundtrip(value)
    assert out.keys() == value.keys()
    for k in ("none", "bool", "int", "uint", "float", "str", "bytes", "big_bytes", "empty"):
        assert out[k] == value[k] and type(out[k]) is type(value[k])
    assert out["tuple"] == (1, (2, "3"), []) and isinstance(out["tuple"][1], tuple)
    assert out["list"][1][1][0] == 3 and torch.equal(out["list"][1][1][1], torch.ones(2))
    np.testing.assert_array_equal(out["np"], value["np"])
    assert out["np_scalar"] == np.float32(1.5) and isinstance(out["np_scalar"], np.float32)
    assert out["np_bool"].dtype == np.bool_


def test_structs_by_imported_type_and_registered_type():
    p = Point(3, torch.arange(4), ["a"])
    out = roundtrip([p, Packed(1, "b")])
    assert isinstance(out[0], Point) and out[0].x == 3 and out[0].tags == ["a"]
    assert torch.equal(out[0].t, torch.arange(4))
    assert out[1] == Packed(1, "b")
    register_struct(Point)


def test_unknown_struct_type_is_refused_clearly():
    bad = _ext(3, msgspec.msgpack.encode(["not_imported_module:Thing", {"a": 1}]))
    with pytest.raises(DecodeError, match="neither registered nor imported"):
        decode_value([bad])
    bad = _ext(3, msgspec.msgpack.encode(["os:path", {}]))  # imported, but not a Struct
    with pytest.raises(DecodeError, match="neither registered nor imported"):
        decode_value([bad])


def test_pil_images():
    rgb = Image.fromarray(np.random.randint(0, 256, (40, 30, 3), dtype=np.uint8), "RGB")
    pal = Image.new("P", (4, 4), 7)
    pal.putpalette([i % 256 for i in range(768)])
    for image in (
        rgb,
        rgb.convert("L"),
        rgb.convert("RGBA"),
        rgb.convert("1"),
        pal,
        Image.new("RGB", (0, 0)),
    ):
        out = roundtrip(image)
        assert out.mode == image.mode and out.size == image.size
        assert out.tobytes() == image.tobytes()
        assert out.getpalette() == image.getpalette()


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    ("value", "where", "fragment"),
    [
        ({"a": [1, {2}]}, "['a'][1]", "builtins.set"),
        ({1: "x"}, "", "keys must be str"),
        ([object()], "[0]", "builtins.object"),
        ({"f": lambda: 0}, "['f']", "function"),
        (2**70, "", "64 bits"),
        (torch.ones(2).to_sparse(), "", "to_dense"),
        (np.array(["a"], dtype=object), "", "dtype object"),
        (Point(1, t=[{3}]), ".t[0]", "set"),
    ],
)
def test_unsupported_values_are_refused_with_where(value, where, fragment):
    with pytest.raises(UnsupportedValueError) as info:
        encode_value(value, where="node 'x' output 'y'")
    text = str(info.value)
    assert text.startswith(f"node 'x' output 'y'{where}:"), text
    assert fragment in text and "pickle is off" in text or fragment in text


def test_subclasses_travel_as_their_base_type():
    out = roundtrip(
        {
            "od": collections.OrderedDict(a=1),
            "enum": Color.RED,
            "nt": collections.namedtuple("P", "a")(1),
        }
    )
    assert out == {"od": {"a": 1}, "enum": 1, "nt": (1,)}


def test_shared_memory_path_round_trips_and_releases(tmp_path):
    run_id = f"yatt-test-{tmp_path.name}"
    released = []
    pool = ShmPool(run_id, owner=0, threshold=1 << 16)
    reader = ShmReader(run_id, lambda owner, name: (released.append(name), pool.release(name)))
    try:
        for i in range(3):  # a released segment is reused: one segment for three sends
            t = torch.randn(100_000)
            frames = encode_value({"t": t, "small": torch.ones(3)}, shm=pool)
            assert len(frames) == 1  # the tensor went to shared memory, not into a frame
            out = decode_value(_wire(frames), shm=reader)
            assert torch.equal(out["t"], t)
            out["t"].add_(0)  # writable
            view = out["t"][10:20]
            del out
            assert len(released) == i  # no copy: a view of the segment holds it until freed
            del view
            assert len(released) == i + 1
        assert pool.segments == 1 and len(released) == 3
        with pytest.raises(DecodeError, match="no.*shared memory|without shared memory"):
            decode_value(_wire(encode_value(torch.randn(100_000), shm=pool)))
    finally:
        reader.close()
        pool.close()
        remove_run_segments(run_id)


def test_shared_memory_handles_from_elsewhere_are_refused(tmp_path):
    reader = ShmReader("yatt-mine", lambda *a: None)
    pool = ShmPool("yatt-other", owner=0, threshold=1 << 16)
    try:
        frames = encode_value(torch.randn(100_000), shm=pool)
        with pytest.raises(DecodeError, match="bad shared-memory handle"):
            decode_value(_wire(frames), shm=reader)
    finally:
        pool.close()


# --- garbage ------------------------------------------------------------------------------
_samples = [
    torch.arange(2000.0),
    {"small": torch.arange(6.0).reshape(2, 3), "ids": torch.tensor([3])},  # the inline path
    {"a": (1, torch.ones(3, dtype=torch.bfloat16)), "b": [Point(1)]},
    Image.new("RGB", (30, 20)),
    np.arange(400),
]


def _ext(code, payload):
    return msgspec.msgpack.encode(msgspec.msgpack.Ext(code, payload))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.lists(st.binary(max_size=64), min_size=0, max_size=4),
        st.tuples(st.integers(0, 9), st.binary(max_size=64)).map(lambda cp: [_ext(*cp)]),
        st.tuples(
            st.integers(0, 7),
            st.lists(
                st.integers(-(2**63), 2**63 - 1) | st.text(max_size=4) | st.binary(max_size=8),
                max_size=5,
            ),
            st.binary(max_size=32),
        ).map(lambda c: [_ext(c[0], msgspec.msgpack.encode(c[1])), c[2]]),
        st.tuples(
            st.sampled_from(range(len(_samples))), st.integers(0, 10_000), st.integers(0, 255)
        ).map(lambda c: _mutate(_samples[c[0]], c[1], c[2])),
    )
)
def test_decoder_never_crashes_on_garbage(frames):
    try:
        decode_value(frames, where="fuzz")
    except DecodeError as exc:
        assert str(exc).startswith("fuzz")


def _mutate(sample, position, byte):
    frames = _wire(encode_value(sample))
    header = bytearray(frames[0])
    header[position % len(header)] = byte
    return [bytes(header), *frames[1:]]


def test_truncated_frames_raise_decode_error():
    frames = _wire(encode_value(torch.arange(1000.0)))
    with pytest.raises(DecodeError, match="bytes, the header says"):
        decode_value([frames[0], frames[1][:-4]])
    with pytest.raises(DecodeError, match="frame index"):
        decode_value([frames[0]])
    with pytest.raises(DecodeError, match="no frames"):
        decode_value([])
    [small] = _wire(encode_value(torch.arange(6.0).reshape(2, 3)))  # inline, one frame
    with pytest.raises(DecodeError, match="truncated"):
        decode_value([small[:-4]])  # the extension itself is cut short
    assert torch.equal(decode_value([small]), torch.arange(6.0).reshape(2, 3))


# --- message headers ----------------------------------------------------------------------
def test_message_headers_round_trip_in_one_frame_led_by_the_kind_byte():
    msg = m.StepDone(controller=1, step=3, node_seconds={"a": 0.5})
    [head] = m.encode_header(msg)
    assert head[:1] == bytes([m.Kind.STEP_DONE])
    assert m.decode_header(head) == (m.Kind.STEP_DONE, msg)
    with pytest.raises(m.ProtocolError, match="unknown message kind"):
        m.decode_header(b"\xff" + head[1:])
    with pytest.raises(m.ProtocolError, match="unknown message kind"):
        m.decode_header(b"")
    with pytest.raises(m.ProtocolError, match="cannot decode a HELLO"):
        m.decode_header(m.Kind.HELLO.frame + b"\x93garbage")


def test_hello_protocol_is_readable_across_versions():
    future = msgspec.msgpack.encode([99, 0, 1, "host", "ipc://x", "a field from the future"])
    assert m.hello_protocol(future) == 99
    [head] = m.encode_header(m.Hello(m.PROTOCOL_VERSION, 2))
    assert m.hello_protocol(head[1:]) == m.PROTOCOL_VERSION
