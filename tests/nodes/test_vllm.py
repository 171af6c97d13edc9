"""The vLLM backend's parts that need no GPU: the names a weight update carries into the
engine, the engine options, and the refusals. The engine itself runs in bench/gpu_check.py
and in the gpu-marked test of tests/nodes/test_rollout.py."""

import pytest
import torch
from safetensors import safe_open

from nodes.models.policy import tiny_prefix_vlm, tiny_qwen2_vl
from nodes.models.vllm_engine import check_vllm_options, vllm_unavailable_reason
from nodes.models.vllm_names import checkpoint_items


def _saved_names(path) -> set[str]:
    names: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    return names


def _tied(model) -> set[str]:
    """Names save_pretrained leaves out because they share storage with another weight."""
    seen: dict[int, str] = {}
    tied = set()
    for name, tensor in model.state_dict().items():
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            tied.add(name)
        seen.setdefault(key, name)
    return tied


def test_qwen2_vl_update_names_are_the_saved_checkpoints_names(tmp_path):
    policy = tiny_qwen2_vl(seed=0)
    policy.save_pretrained(tmp_path)
    sent = dict(checkpoint_items(policy, policy.state_dict()))
    saved = _saved_names(tmp_path)
    assert saved, "save_pretrained wrote no safetensors file"
    assert saved <= set(sent), f"names vLLM would not get: {sorted(saved - set(sent))[:5]}"
    extra = set(sent) - saved
    assert extra <= {f"{n}" for n in _tied(policy.model)}, sorted(extra)[:5]
    with safe_open(str(next(tmp_path.glob("*.safetensors"))), "pt") as f:
        name = next(iter(f.keys()))
        assert torch.equal(f.get_tensor(name), sent[name])


def test_a_partial_update_maps_only_what_it_holds():
    policy = tiny_qwen2_vl(seed=0)
    name = next(k for k in policy.state_dict() if k.endswith("lm_head.weight"))
    items = list(checkpoint_items(policy, {name: policy.state_dict()[name]}))
    assert [n for n, _ in items] == [name.removeprefix("model.")]


def test_a_prefix_vlm_is_refused_clearly():
    with pytest.raises(ValueError, match="not a transformers model vLLM can serve"):
        list(checkpoint_items(tiny_prefix_vlm(seed=0), {}))


def test_a_name_outside_the_served_model_is_refused():
    policy = tiny_qwen2_vl(seed=0)
    with pytest.raises(ValueError, match="'head.weight' is not part of the served model"):
        list(checkpoint_items(policy, {"head.weight": torch.zeros(1)}))


def test_engine_options_are_checked_before_anything_starts():
    assert check_vllm_options({"gpu_memory_utilization": 0.3}, "x") == {
        "gpu_memory_utilization": 0.3
    }
    with pytest.raises(ValueError, match="unknown vllm option"):
        check_vllm_options({"gpu_mem": 0.3}, "x")
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5; it must be in \(0, 1\]"):
        check_vllm_options({"gpu_memory_utilization": 1.5}, "x")


@pytest.mark.skipif(
    vllm_unavailable_reason() is not None and "not installed" in vllm_unavailable_reason(),
    reason="vllm is not installed here (the GPU install has it: make install-gpu)",
)
def test_the_vllm_model_class_takes_the_checkpoint_names(tmp_path):
    from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration

    mapper = Qwen2VLForConditionalGeneration.hf_to_vllm_mapper
    policy = tiny_qwen2_vl(seed=0)
    mapped = list(mapper.apply(checkpoint_items(policy, policy.state_dict())))
    assert all(not n.startswith("model.model.") for n, _ in mapped)
