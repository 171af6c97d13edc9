"""CUDA tensors between controllers by CUDA IPC (runtime.codec.cuda_ipc).

On a CPU machine: the decision (pure functions and what a controller makes of SETUP), that
CPU values round-trip unchanged with ``cuda_ipc=`` given, the IPC extension's msgpack form
(with a fabricated share tuple: a format test, no GPU memory behind it) and the receiver's
one-line error. The real IPC between two processes is marked ``gpu``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import msgspec
import numpy as np
import pytest
import torch
import zmq

from runtime.codec import DecodeError, cuda_ipc, decode_value, encode_value
from runtime.codec.cuda_ipc import IpcReceive, IpcSend, enabled_from_env, ipc_devices, peer_gpus
from runtime.codec.decode import release_ipc
from runtime.codec.wire import _CUDA_IPC, _STRUCT
from runtime.zmq import messages as m
from runtime.zmq.peers import Peers
from runtime.zmq.transport import Drops, make_socket, send

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- the decision ---------------------------------------------------------------------------
def test_driver_lists_the_gpus_of_controllers_on_its_host():
    # controller 0 owns GPUs 0-1, controller 1 GPU 2, controller 2 joined from another host
    gpus = peer_gpus([(0, 1), (2,), ()], [True, True, False], enabled=True, driver_gpus=4)
    assert gpus == [[0, 1], [2], []]
    # none assigned: it keeps the driver's environment, so it sees every GPU the driver sees
    assert peer_gpus([(), (1,)], [True, True], enabled=True, driver_gpus=2) == [[0, 1], [1]]
    assert peer_gpus([(0,), (0,)], [True, True], enabled=False, driver_gpus=1) == [[], []]


def test_sender_uses_ipc_only_where_every_destination_sees_the_gpu():
    # local ordinal -> physical index: controller 0 sees physical 0 and 1 as local 0 and 1
    gpus = [[0, 1], [1], [0, 1], []]
    assert ipc_devices(gpus, 0, [1]) == {1: 1}  # same host, dest sees GPU 1 only
    assert ipc_devices(gpus, 0, [2]) == {0: 0, 1: 1}
    assert ipc_devices(gpus, 0, [1, 2]) == {1: 1}  # every destination must see it
    assert ipc_devices(gpus, 0, [3]) == {}  # other host (or not started here): host copy
    assert ipc_devices(gpus, 0, [1, 3]) == {}
    assert ipc_devices(gpus, 1, [0]) == {0: 1}  # controller 1's local 0 is physical 1
    assert ipc_devices(gpus, 3, [0]) == {}  # the sender is not on the host
    assert ipc_devices([], 0, [1]) == {}  # IPC off
    assert ipc_devices([[0], [1]], 0, [1]) == {}  # the destination does not see GPU 0


def test_switch_from_keyword_or_environment(monkeypatch):
    monkeypatch.delenv(cuda_ipc.ENV, raising=False)
    assert enabled_from_env(None) is True
    monkeypatch.setenv(cuda_ipc.ENV, "0")
    assert enabled_from_env(None) is False
    assert enabled_from_env(True) is True
    monkeypatch.setenv(cuda_ipc.ENV, "1")
    assert enabled_from_env(False) is False


def test_setup_carries_the_gpus_and_the_protocol_says_so():
    setup = m.Setup(controller=1, plan_json=b"", cuda_ipc_gpus=[[0], [0], []])
    [head] = m.encode_header(setup)
    assert m.decode_header(head)[1].cuda_ipc_gpus == [[0], [0], []]
    assert m.PROTOCOL_VERSION >= 7


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _peers(ctx, tmp_path, name: str) -> Peers:
    return Peers(
        ctx, f"ipc://{tmp_path}/driver", bind=f"ipc://{tmp_path}/{name}", host="", keys=None,
        max_message_bytes=0, drops=Drops("test"),
    )  # fmt: skip


def test_controller_reads_its_choice_from_setup(ctx, tmp_path):
    peers = _peers(ctx, tmp_path, "c0")
    addresses = [f"ipc://{tmp_path}/c{i}" for i in range(3)]
    try:
        peers.connect(m.Setup(0, b"", peers=addresses, cuda_ipc_gpus=[[0], [0], []]))
        assert peers._ipc([1]).devices == {0: 0}
        assert peers._ipc([2]) is None and peers._ipc([1, 2]) is None
        assert peers.ipc_receive is not None and peers.ipc_receive.gpus == [0]
    finally:
        peers.close()
    off = _peers(ctx, tmp_path, "c1")
    try:
        off.connect(m.Setup(1, b"", peers=addresses))  # no cuda_ipc_gpus: IPC off
        assert off._ipc([0]) is None and off.ipc_receive is None
    finally:
        off.close()


# --- values that do not go by IPC -----------------------------------------------------------
def test_cpu_values_round_trip_unchanged_with_ipc_allowed():
    value = {
        "big": torch.arange(300_000, dtype=torch.float32),  # a frame
        "small": torch.tensor([1, 2, 3]),  # inline
        "view": torch.arange(200_000, dtype=torch.int64)[::2],  # non-contiguous
        "arr": np.ones((4, 5)),
        "nested": [("a", 1.5), {"b": None}],
    }
    frames = encode_value(
        value, cuda_ipc=IpcSend({0: 0}, [1], min_bytes=0)
    )  # fmt: skip
    assert not _has_ipc_ext(frames[0])
    out = decode_value(frames, cuda_ipc=IpcReceive(1, [0]))
    assert set(out) == set(value)
    for k in ("big", "small", "view"):
        assert torch.equal(out[k], value[k])
    assert np.array_equal(out["arr"], value["arr"])
    assert out["nested"] == [("a", 1.5), {"b": None}]
    # and the same frames as without the keyword: the CPU path is untouched
    assert encode_value(value)[0] == frames[0]


def _has_ipc_ext(header: bytes) -> bool:
    found = []

    def hook(code, data):
        found.append(code)
        if code != 8:
            msgspec.msgpack.decode(data, ext_hook=hook)
        return None

    msgspec.msgpack.decode(header, ext_hook=hook)
    return _CUDA_IPC in found


# --- the extension's wire format (fabricated handles: no GPU memory behind them) ------------
SHARE = [b"\x01" * 64, 4096, 512, b"/torch_123_456_7", 3, b"\x02" * 64, True]
"""A fabricated ``_share_cuda_()`` tuple less its device: handle, storage bytes, storage
offset, ref-counter handle and offset, event handle, event_sync_required."""


@pytest.fixture
def fake_share(monkeypatch):
    calls = []

    def share(storage, dest):
        calls.append(dest)
        return [dest, *SHARE]

    monkeypatch.setattr(cuda_ipc, "_share", share)
    monkeypatch.setattr(cuda_ipc, "_rebuild", lambda args: args)  # the arguments, not a tensor
    return calls


def _ipc_frames(dests=(1, 2), physical=5) -> list[bytes]:
    t = torch.zeros(4, 6, dtype=torch.bfloat16)[:, 1:4]  # a strided view, offset 1
    ext = IpcSend({0: physical}, dests).ext(t, "bfloat16", physical)
    return [msgspec.msgpack.encode({"t": ext, "n": 1})]


def test_format_ipc_extension_round_trips_its_fields(fake_share):
    frames = _ipc_frames()
    assert fake_share == [1, 2]  # one share (one ref counter) per destination
    for index in (1, 2):
        out = decode_value(frames, cuda_ipc=IpcReceive(index, [7, 5]))
        args = out["t"]
        assert out["n"] == 1
        assert args == dict(
            dtype="bfloat16", size=(4, 3), stride=(6, 1), offset=1, device=1,
            handle=SHARE[0], storage_bytes=4096, storage_offset=512,
            ref_counter=b"/torch_123_456_7", ref_counter_offset=3, event=SHARE[5],
            event_sync=True,
        )  # fmt: skip


def test_format_ipc_extension_refused_where_it_cannot_be_opened(fake_share):
    frames = _ipc_frames()
    with pytest.raises(DecodeError, match="link without CUDA IPC"):
        decode_value(frames)
    with pytest.raises(DecodeError, match="does not see.*YATT_CUDA_IPC=0"):
        decode_value(frames, cuda_ipc=IpcReceive(1, [0]))  # GPU 5 not among its GPUs
    with pytest.raises(DecodeError, match="no share for controller 3"):
        decode_value(frames, cuda_ipc=IpcReceive(3, [5]))


def test_the_receiver_counts_what_it_opened_by_ipc_and_a_sender_reads_the_threshold_when_made(
    fake_share, monkeypatch
):
    monkeypatch.setattr(cuda_ipc, "OPENED", cuda_ipc.Opened())
    frames = _ipc_frames()
    decode_value(frames, cuda_ipc=IpcReceive(1, [7, 5]))
    decode_value(frames, cuda_ipc=IpcReceive(2, [5]))
    # the bytes of the bfloat16[4, 3] view each opened, not of its 4096-byte storage
    assert (cuda_ipc.OPENED.tensors, cuda_ipc.OPENED.bytes) == (2, 2 * 4 * 3 * 2)
    assert IpcSend({0: 0}, [1]).min_bytes == cuda_ipc.MIN_BYTES
    monkeypatch.setattr(cuda_ipc, "MIN_BYTES", 1)
    assert IpcSend({0: 0}, [1]).min_bytes == 1


@pytest.mark.parametrize(
    "bad",
    [b"/../dev/shm/x", b"relative", b"", "/torch_1", b"/torch\x00x"],
)
def test_format_ipc_ref_counter_must_be_one_shm_name(monkeypatch, fake_share, bad):
    monkeypatch.setattr(cuda_ipc, "_share", lambda s, d: [d, SHARE[0], 1, 0, bad, 0, b"", False])
    with pytest.raises(DecodeError, match="ref-counter"):
        decode_value(_ipc_frames(dests=(1,)), cuda_ipc=IpcReceive(1, [5]))


def _receive_ipc(ctx, tmp_path, sent_epoch: int = 0, epoch: int = 0):
    """Controller 1 (GPU 5, at ``epoch``) receives one IPC tensor of step 3 from controller 0
    (sent at ``sent_epoch``); what its ``receive`` returns."""
    receiver = _peers(ctx, tmp_path, "c1")
    push = make_socket(ctx, zmq.PUSH, receiver.address)
    try:
        peers = [f"ipc://{tmp_path}/c0", receiver.address]
        receiver.connect(m.Setup(1, b"", peers=peers, cuda_ipc_gpus=[[5], [5]]))
        receiver.epoch = epoch

        class Engine:
            def reads(self, src, port):
                return True

        send(push, m.Data(3, "rollout", "ids", 0, sent_epoch), _ipc_frames(dests=(1,)))
        assert receiver.inbox.poll(5000)
        return receiver.receive(Engine())
    finally:
        push.close(linger=0)
        receiver.close()


def test_handle_that_does_not_open_is_one_line_naming_data_step_and_fix(
    monkeypatch, fake_share, ctx, tmp_path
):
    def fail(args):
        raise RuntimeError("CUDA error: invalid device context\nCompile with TORCH_USE_CUDA_DSA")

    monkeypatch.setattr(cuda_ipc, "_rebuild", fail)
    error = _receive_ipc(ctx, tmp_path)
    assert error is not None and "\n" not in error.message, error.message
    assert error.node == "rollout" and error.step == 3
    assert "data rollout.ids of step 3 from controller 0" in error.message
    assert "invalid device context" in error.message
    assert "ZmqExecutor(cuda_ipc=False) or YATT_CUDA_IPC=0" in error.message


@pytest.fixture
def releases(monkeypatch):
    calls = []
    monkeypatch.setattr(cuda_ipc, "_release_counter", lambda ref, off: calls.append((ref, off)))
    return calls


def test_a_dropped_message_releases_its_ipc_shares_without_opening_them(fake_share, releases):
    # two IPC tensors, one nested in a tuple inside a list: each gives back this controller's
    # share of the counter; nothing is rebuilt (the fixture's _rebuild would return its args)
    t = torch.zeros(4, 6)
    sender = IpcSend({0: 5}, (1, 2))
    value = {"a": sender.ext(t, "float32", 5), "b": [(1, sender.ext(t, "float32", 5))], "c": "x"}
    frames = [msgspec.msgpack.encode(value)]
    assert release_ipc(frames, IpcReceive(2, [5])) == 2
    assert releases == [(SHARE[3], SHARE[4])] * 2
    releases.clear()
    assert release_ipc([b"\xc1garbage"], IpcReceive(2, [5])) == 0  # garbage: no error
    assert release_ipc(frames, IpcReceive(3, [5])) == 0  # no share for controller 3
    assert releases == []


def test_a_decode_that_fails_part_way_releases_the_shares_it_did_not_open(
    monkeypatch, fake_share, releases
):
    # four IPC tensors around a value that cannot decode (a Struct type no one registered):
    # the first was opened (its storage gives its share back when freed), the other three
    # were not, and their counters would otherwise keep the sender's blocks from being freed
    t = torch.zeros(4, 6)
    sender = IpcSend({0: 5}, (1,))
    nope = msgspec.msgpack.Ext(_STRUCT, msgspec.msgpack.encode(["nowhere:Nope", {}]))
    value = {
        "a": sender.ext(t, "float32", 5), "b": nope, "c": sender.ext(t, "float32", 5),
        "d": [(1, sender.ext(t, "float32", 5))], "e": sender.ext(t, "float32", 5),
    }  # fmt: skip
    frames = [msgspec.msgpack.encode(value)]
    opened = []
    monkeypatch.setattr(cuda_ipc, "_rebuild", lambda args: opened.append(args) or args)
    with pytest.raises(DecodeError, match="nowhere:Nope"):
        decode_value(frames, cuda_ipc=IpcReceive(1, [5]))
    assert len(opened) == 1
    assert releases == [(SHARE[3], SHARE[4])] * 3


def test_a_handle_that_does_not_open_releases_it_and_those_after(monkeypatch, fake_share, releases):
    t = torch.zeros(4, 6)
    sender = IpcSend({0: 5}, (1,))
    frames = [msgspec.msgpack.encode([sender.ext(t, "float32", 5) for _ in range(3)])]
    opened = []

    def rebuild(args):
        if len(opened) == 1:
            raise RuntimeError("CUDA error: invalid resource handle")
        opened.append(args)
        return args

    monkeypatch.setattr(cuda_ipc, "_rebuild", rebuild)
    with pytest.raises(DecodeError, match="invalid resource handle"):
        decode_value(frames, cuda_ipc=IpcReceive(1, [5]))
    assert len(opened) == 1 and releases == [(SHARE[3], SHARE[4])] * 2
    releases.clear()
    with pytest.raises(DecodeError):  # no IPC on this link: nothing to release, nothing opened
        decode_value(frames)
    assert releases == []


def test_data_dropped_for_a_stale_epoch_releases_its_ipc_shares(
    fake_share, releases, ctx, tmp_path
):
    # a restore happened: data of epoch 1 is stale at a controller now at epoch 2
    assert _receive_ipc(ctx, tmp_path, sent_epoch=1, epoch=2) is None
    assert releases == [(SHARE[3], SHARE[4])]


# --- real CUDA IPC between two processes ----------------------------------------------------
CONSUMER = textwrap.dedent(
    """
    import sys, msgspec, torch
    from runtime.codec.cuda_ipc import IpcReceive
    from runtime.codec import decode_value
    frames = msgspec.msgpack.decode(sys.stdin.buffer.read())
    out = decode_value(frames, cuda_ipc=IpcReceive(1, [0]))
    t, host = out["ipc"], out["copy"]
    expect = torch.arange(1 << 20, device="cuda", dtype=torch.float32).reshape(1024, 1024) * 3
    same = bool(torch.equal(t, expect[:, ::2]))
    copied = bool(torch.equal(host.cuda(), expect[:, :4]))
    print(t.device.type, same, tuple(t.stride()) == (1024, 2), copied, flush=True)
    """
)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_crosses_processes_by_ipc():
    base = torch.arange(1 << 20, device="cuda", dtype=torch.float32).reshape(1024, 1024) * 3
    sent = base[:, ::2]  # a strided view of a 4 MiB storage: IPC keeps the strides
    ipc = IpcSend({0: 0}, [1])
    frames = encode_value({"ipc": sent, "copy": base[:, :4].contiguous()}, cuda_ipc=ipc)
    assert ipc.sent == 1  # the 4 KiB tensor is under MIN_BYTES: it took the host copy
    payload = msgspec.msgpack.encode([bytes(f) for f in frames])
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run(
        [sys.executable, "-c", CONSUMER], input=payload, capture_output=True, env=env,
        cwd=ROOT, timeout=90,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split() == ["cuda", "True", "True", "True"]
    del sent, base
    torch.cuda.ipc_collect()  # the consumer has exited: its counter is released
