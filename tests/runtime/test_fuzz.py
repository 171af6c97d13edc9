"""Fuzzing the control-message decoder (runtime/zmq/messages.py) and the frame checks (transport.py).

Whatever arrives, decoding gives a message Struct or a ProtocolError, nothing else; the
value decoder has its own fuzz test in test_serial.py. Bounded: ~1,100 cases, ~5 s.
"""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.engine.config import RunConfig
from runtime.sched.devices import Resources
from runtime.zmq import messages as m
from runtime.zmq.transport import split

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_SAMPLES = [
    m.Hello(m.PROTOCOL_VERSION, 1, 42, "host", "ipc:///tmp/x", b"w" * 16),
    m.Refused("no"),
    m.Setup(
        0,
        b"{}",
        peers=["ipc://a", "ipc://b"],
        order=["a", "b"],
        config=RunConfig(node_timeout_s=2.0),
    ),
    m.Ready(1, ["a"]),
    m.Run(7),
    m.Data(3, "src", "port", 1, 2),
    m.Release("yatt-x-c0-1"),
    m.StepDone(1, 3, {"a": 0.5}, {"a": 1.0}),
    m.Error(1, "boom", "a", 3, "tb", "timeout", 2.5, 2.0),
    m.Heartbeat(1, 3, "a", 0.2, 3),
    m.Shutdown("bye"),
    m.Goodbye(1),
    m.Warn(0, "node slow has run step 3 for 61.0s", "slow", 3),
    m.StateRequest(4),
    m.StateReply(1, 4),
    m.StateLoad(4, 2),
    m.StateLoaded(1, 4),
    m.SetResources(Resources((0, 1), 2, (0,))),
    m.StepDone(0, 5, resources=Resources((1,), 1)),
]


def _check(head):
    try:
        kind, msg = m.decode_header(head)
    except m.ProtocolError:
        return
    assert isinstance(kind, m.Kind) and type(msg) is m._TYPES[kind]


def test_every_kind_round_trips():
    assert {type(s) for s in _SAMPLES} == set(m._TYPES.values())
    for sample in _SAMPLES:
        [head] = m.encode_header(sample)
        assert m.decode_header(head)[1] == sample


@FUZZ
@given(st.binary(max_size=200))
def test_random_frames(head):
    _check(head)


@FUZZ
@given(st.sampled_from(_SAMPLES), st.integers(0, 10_000), st.integers(0, 255), st.integers(0, 64))
def test_mutated_and_truncated_headers_of_every_kind(sample, position, byte, cut):
    [head] = m.encode_header(sample)
    mutated = bytearray(head)
    mutated[position % len(mutated)] = byte
    _check(bytes(mutated))
    _check(head[: max(0, len(head) - cut)])
    _check(bytes([position % 20]) + head[1:])  # the header under another kind byte


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)  # fmt: skip


@FUZZ
@given(st.sampled_from(list(m.Kind)), _msgpack_values)
def test_well_formed_msgpack_of_the_wrong_shape(kind, value):
    try:
        header = msgspec.msgpack.encode(value)
    except OverflowError:
        return
    _check(kind.frame + header)
    try:
        version = m.hello_protocol(header)
    except m.ProtocolError:
        return
    assert isinstance(version, int)


@FUZZ
@given(st.lists(st.binary(max_size=40), max_size=5), st.integers(0, 3), st.integers(0, 64))
def test_frame_lists_with_prefixes_and_limits(frames, prefix, limit):
    try:
        got_prefix, kind, msg, value = split(frames, prefix=prefix, limit=limit)
    except m.ProtocolError:
        return
    assert len(got_prefix) == prefix and isinstance(kind, m.Kind)
    assert limit == 0 or all(len(f) <= limit for f in frames)
    assert value == frames[prefix + 1 :]


def test_a_header_over_the_limit_is_refused_undecoded():
    big = msgspec.msgpack.encode(["x" * (m.MAX_HEADER_BYTES + 1)])
    try:
        m.decode_header(m.Kind.SHUTDOWN.frame + big)
    except m.ProtocolError as exc:
        assert "over the" in str(exc)
    else:
        raise AssertionError("an oversized header was decoded")
