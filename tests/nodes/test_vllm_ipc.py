"""Weight updates into the vLLM engine by CUDA IPC through one staging bucket, on a CPU: the
stand-in ``vllm`` (the worker method runs by name after a msgpack round trip, as the V1
engine core does) with the CUDA seam of nodes/models/vllm_ipc.py faked: the "GPU" bucket is a
CPU tensor, sharing it registers it by id and opening it looks it up, so the worker reads the
sender's memory as it would through CUDA IPC, with nothing copied. The real seam (torch's
``_share_cuda_`` and ``rebuild_cuda_tensor``) runs in bench/gpu_check.py's weight-update row.
Also the ``weight_sync`` output every rollout gives, and the metrics it becomes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm_stand_in import install, through_the_engine_core

from nodes.models import vllm_ipc
from nodes.models.vllm_engine import RECEIVE, RECEIVE_IPC
from nodes.models.vllm_names import checkpoint_items
from nodes.rollout import Rollout
from nodes.sync import WeightUpdate

KIB = 2**10


@pytest.fixture
def fake_vllm(monkeypatch):
    return install(monkeypatch)


@pytest.fixture
def gpu(fake_vllm, monkeypatch):
    """The CUDA seam on a CPU; records the buckets made, the fields shared and opened, and
    every argument list of a worker call."""
    seen = SimpleNamespace(made=[], shared={}, opened=[], args=[])
    monkeypatch.setattr(vllm_ipc, "cuda_ready", lambda: True)

    def allocate(nbytes, device):
        assert device.type == "cuda"  # where it would be
        seen.made.append(torch.empty(nbytes, dtype=torch.uint8))
        return seen.made[-1]

    def share_storage(bucket):
        handle = len(seen.shared).to_bytes(8, "little")
        seen.shared[handle] = bucket
        return ["GPU-5e1f", handle, bucket.numel(), 0, b"/torch_1_2", 0, bytes(64), False]

    def open_storage(fields):
        seen.opened.append(fields)
        return seen.shared[fields[1]]

    monkeypatch.setattr(vllm_ipc, "allocate", allocate)
    monkeypatch.setattr(vllm_ipc, "share_storage", share_storage)
    monkeypatch.setattr(vllm_ipc, "open_storage", open_storage)
    rpc = fake_vllm.LLM.collective_rpc

    def recording(llm, method, timeout=None, args=(), kwargs=None):
        seen.args.append((method, list(args)))
        return rpc(llm, method, timeout, args, kwargs)

    monkeypatch.setattr(fake_vllm.LLM, "collective_rpc", recording)
    return seen


def _rollout(**options) -> Rollout:
    node = Rollout(policy="tiny-qwen2", backend="vllm", max_new_tokens=2, vllm_options=options)
    node.setup()
    return node


def _noisy(node: Rollout, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
        for k, v in node.policy.state_dict().items()
    }


def _sent_bytes(node: Rollout, weights: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for _, t in checkpoint_items(node.policy, weights))


def _tensors_in(value) -> bool:
    if isinstance(value, list | tuple):
        return any(_tensors_in(v) for v in value)
    return isinstance(value, torch.Tensor)


def test_an_update_goes_through_one_bucket_in_chunks_and_loads_equal_values(gpu):
    node = _rollout(bucket_mb=128 / KIB)  # 128 KiB a call: the tiny Qwen2 (341 KiB) in 3
    engine, llm = node._vllm, node._vllm.llm
    assert engine.update_path == "ipc"
    for version in (1, 2):
        new = _noisy(node, version)
        node.run(prompts=["ab"], weights=WeightUpdate(new, version=version))
        for name, tensor in checkpoint_items(node.policy, new):
            assert torch.equal(llm.served[name], tensor), name
    calls = [args for method, args in gpu.args if method == RECEIVE_IPC]
    assert RECEIVE not in llm.calls and len(calls) >= 2 * 2  # at least two chunks an update
    assert len(gpu.made) == 1, "one bucket for every chunk of every update"
    assert len(gpu.opened) == 1, "the worker opened it once and kept it"
    assert calls[0][0][1] is not None and all(args[0][1] is None for args in calls[1:])
    bucket = gpu.made[0]
    assert bucket.numel() <= 128 * KIB
    for args in calls:  # plain msgpack values: they cross the engine core as they are
        assert not _tensors_in(args) and through_the_engine_core(args) == args
        for name, dtype, shape, offset in args[1]:
            assert isinstance(name, str) and isinstance(dtype, str) and isinstance(shape, list)
            assert offset % vllm_ipc.ALIGN == 0


def test_a_tensor_larger_than_the_bucket_size_gets_a_bucket_that_holds_it(gpu):
    node = _rollout(bucket_mb=1 / KIB)  # 1 KiB: less than most tensors
    new = _noisy(node, 1)
    node.run(prompts=["ab"], weights=WeightUpdate(new, version=1))
    largest = max(t.nbytes for t in new.values())
    assert len(gpu.made) == 1 and gpu.made[0].numel() >= largest
    for name, tensor in checkpoint_items(node.policy, new):
        assert torch.equal(node._vllm.llm.served[name], tensor), name


def test_tensor_parallel_size_2_takes_the_bytes_path(gpu):
    node = _rollout(tensor_parallel_size=2)
    assert node._vllm.update_path == "bytes"
    new = _noisy(node, 1)
    out = node.run(prompts=["ab"], weights=WeightUpdate(new, version=1))
    assert RECEIVE in node._vllm.llm.calls and RECEIVE_IPC not in node._vllm.llm.calls
    assert not gpu.made and out["weight_sync"]["ipc"] == 0.0
    for name, tensor in checkpoint_items(node.policy, new):
        assert torch.equal(node._vllm.llm.served[name], tensor), name


def test_a_bucket_the_worker_cannot_open_sends_bytes_for_the_engines_life_saying_so_once(
    gpu, monkeypatch, capsys
):
    def cannot(fields):
        raise RuntimeError("CUDA error: invalid resource handle\nmore detail")

    monkeypatch.setattr(vllm_ipc, "open_storage", cannot)
    node = _rollout(bucket_mb=128 / KIB)
    llm = node._vllm.llm
    capsys.readouterr()
    for version in (1, 2):
        new = _noisy(node, version)
        out = node.run(prompts=["ab"], weights=WeightUpdate(new, version=version))
        for name, tensor in checkpoint_items(node.policy, new):
            assert torch.equal(llm.served[name], tensor), name
    assert llm.calls.count(RECEIVE_IPC) == 1 and RECEIVE in llm.calls  # tried once
    assert node._vllm.update_path == "bytes" and out["weight_sync"]["ipc"] == 0.0
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "node 'rollout': weight updates go to vLLM as bytes through the engine core from now "
        "on: CUDA IPC of the staging bucket failed (RuntimeError: CUDA error: invalid "
        "resource handle)"
    ]


def test_no_cuda_in_the_process_takes_the_bytes_path(fake_vllm):
    node = _rollout()  # the stand-in alone: torch sees no CUDA here
    assert node._vllm.update_path == "bytes"


# --- the weight_sync output -------------------------------------------------------------------
def test_a_vllm_rollout_reports_its_weight_loads_a_call(gpu):
    node = _rollout()
    assert node.run(prompts=["ab"])["weight_sync"] == {
        "seconds": 0.0, "bytes": 0, "hf_seconds": 0.0, "engine_seconds": 0.0,
        "engine_bytes": 0, "ipc": 1.0,
    }  # fmt: skip
    new = _noisy(node, 1)
    sync = node.run(prompts=["ab"], weights=WeightUpdate(new, version=1))["weight_sync"]
    assert sync["bytes"] == sum(t.nbytes for t in new.values())
    assert sync["engine_bytes"] == _sent_bytes(node, new) and sync["ipc"] == 1.0
    assert sync["seconds"] == sync["hf_seconds"] + sync["engine_seconds"]
    assert sync["hf_seconds"] > 0 and sync["engine_seconds"] > 0
    again = node.run(prompts=["ab"], weights=WeightUpdate(new, version=1))["weight_sync"]
    assert again["bytes"] == again["engine_bytes"] == 0, "a version not newer loads nothing"


def test_a_sleeping_engine_that_serves_the_policys_own_weights_reports_them(gpu):
    node = _rollout(enable_sleep_mode=True, gpu_memory_utilization=0.3)
    sync = node.run(prompts=["ab"])["weight_sync"]
    assert sync["bytes"] == 0  # no update came in
    assert sync["engine_bytes"] == _sent_bytes(node, node.policy.state_dict()) > 0


def test_an_hf_rollout_reports_its_weight_loads_streamed_or_not():
    from yatt_graph.stream import join_pieces

    for stream in (False, True):
        node = Rollout(policy="tiny-qwen2", max_new_tokens=4, stream=stream, seed=0)
        node.setup()
        new = _noisy(node, 1)
        update = WeightUpdate(new, version=1)
        pieces = list(node.run_stream(prompts=["ab", "c"], weights=update)) if stream else []
        out = join_pieces(pieces) if stream else node.run(prompts=["ab", "c"], weights=update)
        sync = out["weight_sync"]
        assert set(sync) == {"seconds", "bytes", "hf_seconds"}
        assert sync["bytes"] == sum(t.nbytes for t in new.values())
        assert sync["seconds"] == sync["hf_seconds"] > 0
        assert all(p.outputs["weight_sync"] is sync for p in pieces)  # one value a call
        name = next(iter(new))
        assert torch.equal(node.policy.state_dict()[name], new[name])


# --- the seam's pure parts ----------------------------------------------------------------------
def test_a_gpu_is_found_by_its_uuid_whatever_this_process_numbers_it(monkeypatch):
    uuids = ["9a1b-0", "5e1f-1", "77c0-2"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i])
    )
    assert vllm_ipc.local_ordinal("5e1f-1") == 1
    with pytest.raises(RuntimeError, match="no GPU with UUID 0000 among the 3 this process sees"):
        vllm_ipc.local_ordinal("0000")


def test_chunks_start_aligned_and_views_read_back_every_dtype_and_shape(monkeypatch):
    g = torch.Generator().manual_seed(0)
    items = [
        ("a", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(4, 2, generator=g).to(torch.bfloat16)),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.zeros(0, 4)),
        ("strided", torch.randn(4, 6, generator=g).t()),
        ("ints", torch.arange(7)),
    ]
    parts = vllm_ipc.chunks(items, bucket_bytes=1024)
    names = [[name for name, _, _ in chunk] for chunk in parts]
    assert names == [["a", "b", "scalar", "empty", "strided"], ["ints"]]
    assert [offset for _, _, offset in parts[0]] == [0, 256, 512, 768, 768]  # (empty: 0 bytes)
    monkeypatch.setattr(vllm_ipc, "share_storage", lambda bucket: ["the fields"])
    bucket = vllm_ipc.StagingBucket(torch.device("cpu"))
    bucket.reserve(parts)
    got, shared = [], []
    for chunk in parts:
        (_, fields), rows = bucket.fill(chunk)
        shared.append(fields)
        got += [(n, t.clone()) for n, t in vllm_ipc.views(bucket.tensor, rows)]
    assert bucket.allocations == 1 and bucket.tensor.numel() == 1024
    assert shared == [["the fields"], None]  # shared with the worker once
    for (name, want), (name_got, have) in zip(items, got, strict=True):
        assert name == name_got and have.dtype == want.dtype and torch.equal(have, want), name
    with pytest.raises(ValueError, match="ends past the bucket"):
        vllm_ipc.views(bucket.tensor, [["x", "float32", [1000], 0]])
    with pytest.raises(ValueError, match="bad bucket row"):
        vllm_ipc.views(bucket.tensor, [["x", "Tensor", [1], 0]])
