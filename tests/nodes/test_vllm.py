"""The vLLM backend on a CPU: the names a weight update carries (checked against saved
checkpoints), the payload's trip through msgpack as vLLM's engine core decodes it, the worker
extension, and the engine and Rollout wiring against a stand-in ``vllm`` module (which runs the
worker method by name after a msgpack round trip, as the V1 engine does). vLLM itself runs in
bench/gpu_check.py and the gpu-marked test of tests/nodes/test_rollout.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from vllm_stand_in import FakeLLM, GiB, install, through_the_engine_core

from nodes.models.hf_causal import HFCausalPolicy
from nodes.models.policy import build_policy, char_tokenizer, tiny_prefix_vlm, tiny_qwen2_vl
from nodes.models.vllm_engine import RECEIVE, WeightReceiver, pack_weights, unpack_weights
from nodes.models.vllm_names import checkpoint_items
from nodes.models.vllm_options import check_vllm_options, vllm_unavailable_reason
from nodes.rollout import Rollout
from nodes.sync import WeightUpdate


def _saved_names(path: Path) -> set[str]:
    names: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    return names


def tiny_qwen2(tie: bool) -> HFCausalPolicy:
    """A tiny Qwen2 causal LM built directly from transformers, in the causal policy wrapper."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    return HFCausalPolicy(Qwen2ForCausalLM(config), tokenizer).eval()


POLICIES = {
    "qwen2_vl": lambda: tiny_qwen2_vl(seed=0),
    "qwen2_tied": lambda: tiny_qwen2(tie=True),
    "qwen2_untied": lambda: tiny_qwen2(tie=False),
    "tiny-qwen2 spec": lambda: build_policy("tiny-qwen2"),
}


# --- names ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_update_names_are_exactly_the_saved_checkpoints_names(kind, tmp_path):
    policy = POLICIES[kind]()
    policy.save_pretrained(tmp_path)
    sent = dict(checkpoint_items(policy, policy.state_dict()))
    assert set(sent) == _saved_names(tmp_path)
    saved = {}
    for file in tmp_path.glob("*.safetensors"):
        saved.update(load_file(str(file)))
    for name, tensor in saved.items():
        assert torch.equal(sent[name], tensor), name


def test_a_partial_update_maps_only_what_it_holds():
    policy = tiny_qwen2_vl(seed=0)
    name = next(k for k in policy.state_dict() if k.endswith("lm_head.weight"))
    items = checkpoint_items(policy, {name: policy.state_dict()[name]})
    assert [n for n, _ in items] == ["lm_head.weight"]
    layer = "model.model.language_model.layers.0.mlp.up_proj.weight"
    items = checkpoint_items(policy, {layer: policy.state_dict()[layer]})
    assert [n for n, _ in items] == ["model.layers.0.mlp.up_proj.weight"]


def test_a_tied_head_alone_goes_under_the_embeddings_name():
    policy = tiny_qwen2(tie=True)
    head = policy.state_dict()["model.lm_head.weight"]
    assert [n for n, _ in checkpoint_items(policy, {"model.lm_head.weight": head})] == [
        "model.embed_tokens.weight"
    ]


def test_what_vllm_cannot_serve_is_refused_clearly():
    with pytest.raises(ValueError, match="prefix-VLM puts its own projector"):
        checkpoint_items(tiny_prefix_vlm(seed=0), {})
    lora = build_policy({"name": "tiny-qwen2", "lora": {"r": 2}})
    with pytest.raises(ValueError, match="a LoRA policy's weights are peft's"):
        checkpoint_items(lora, {})
    with pytest.raises(ValueError, match="'head.weight' is not part of the served model"):
        checkpoint_items(tiny_qwen2_vl(seed=0), {"head.weight": torch.zeros(1)})


VLLM_MISSING = vllm_unavailable_reason() is not None and "not installed" in (
    vllm_unavailable_reason() or ""
)


@pytest.mark.skipif(VLLM_MISSING, reason="vllm is not installed here (make install-gpu has it)")
def test_vllm_model_classes_map_the_checkpoint_names_onto_their_modules():
    from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration

    policy = tiny_qwen2_vl(seed=0)
    mapper = Qwen2VLForConditionalGeneration.hf_to_vllm_mapper
    mapped = [n for n, _ in mapper.apply(checkpoint_items(policy, policy.state_dict()))]
    roots = ("language_model.model.", "language_model.lm_head.", "visual.")
    assert mapped and all(n.startswith(roots) for n in mapped), [
        n for n in mapped if not n.startswith(roots)
    ][:5]


# --- the payload ------------------------------------------------------------------------------
def test_weights_survive_msgpack_in_every_dtype_and_shape():
    g = torch.Generator().manual_seed(0)
    items = [
        ("a", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(4, 2, generator=g).to(torch.bfloat16)),
        ("c", torch.randn(7, generator=g).half()),
        ("d", torch.arange(6).reshape(2, 3)),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.zeros(0, 4)),
        ("strided", torch.randn(4, 6, generator=g).t()),
    ]
    buckets = [through_the_engine_core(b) for b in pack_weights(items, 2**20)]
    back = [t for b in buckets for t in unpack_weights(b, "cpu")]
    assert [n for n, _ in back] == [n for n, _ in items]
    for (_, want), (_, got) in zip(items, back):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_buckets_hold_at_most_their_size_and_a_large_tensor_goes_alone():
    items = [(f"w{i}", torch.zeros(256)) for i in range(10)] + [("big", torch.zeros(4096))]
    buckets = list(pack_weights(items, bucket_bytes=3 * 1024))  # 3 float32[256] a bucket
    assert [len(b) for b in buckets] == [3, 3, 3, 1, 1]
    assert [row[0] for row in buckets[-1]] == ["big"]


def test_the_receiver_loads_a_bucket_into_the_workers_model():
    seen = []
    model = torch.nn.Linear(2, 2)

    def load_weights(weights):  # vLLM's model API: the names of the parameters it loaded
        seen.extend(weights)
        return {"weight"}

    model.load_weights = load_weights
    worker = WeightReceiver()
    worker.model_runner = SimpleNamespace(model=model)
    bucket = through_the_engine_core(next(pack_weights([("w", torch.ones(2, 2))], 2**20)))
    assert getattr(worker, RECEIVE)(bucket) == [1, ["weight"]]
    assert seen[0][0] == "w" and torch.equal(seen[0][1], torch.ones(2, 2))
    assert worker.weight_names() == ["bias", "weight"]
    model.load_weights = lambda weights: None  # a vLLM that says nothing: nothing to check
    assert getattr(worker, RECEIVE)(bucket) == [1, None]


def test_engine_options_are_checked_before_anything_starts():
    assert check_vllm_options({"gpu_memory_utilization": 0.3}, "x")["gpu_memory_utilization"] == 0.3
    with pytest.raises(ValueError, match="unknown vllm option"):
        check_vllm_options({"gpu_mem": 0.3}, "x")
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5; it must be in \(0, 1\]"):
        check_vllm_options({"gpu_memory_utilization": 1.5}, "x")
    with pytest.raises(ValueError, match="dtype='fp8'"):
        check_vllm_options({"dtype": "fp8"}, "x")


# --- the engine and the Rollout against a stand-in vllm ----------------------------------------
@pytest.fixture
def fake_vllm(monkeypatch):
    return install(monkeypatch)


def test_a_rollout_samples_with_the_engine_and_takes_its_logprobs(fake_vllm):
    node = Rollout(policy="tiny-qwen2", backend="vllm", max_new_tokens=4, n=2, seed=3)
    out = node.run(prompts=["ab", "c"])
    llm = node._vllm.llm
    assert (llm.path / "config.json").is_file(), "a tiny policy is served from a saved copy"
    assert llm.kwargs["worker_extension_cls"] == "nodes.models.vllm_engine.WeightReceiver"
    # half precision for FlashAttention and CUDA graphs: the trainer recomputes the logprobs
    assert llm.kwargs["dtype"] == "bfloat16" and llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert llm.kwargs["enforce_eager"] is False
    ids, mask = out["prompt_ids"], out["prompt_mask"].bool()
    assert [r["prompt_token_ids"] for r in llm.requests] == [ids[b][mask[b]].tolist() for b in range(4)]  # fmt: skip
    assert [p.seed for p in llm.params] == sorted({p.seed for p in llm.params})
    assert out["response_ids"].tolist() == [[5, 6, 7]] * 4
    assert torch.allclose(out["logprobs"], torch.tensor([[-0.5, -0.6, -0.7]] * 4))
    assert out["truncated"].tolist() == [0.0] * 4  # vLLM said each one stopped ("stop")


def test_top_p_makes_the_rollout_recompute_logprobs_with_the_policy(fake_vllm):
    node = Rollout(policy="tiny-qwen2", backend="vllm", max_new_tokens=4, top_p=0.9)
    out = node.run(prompts=["ab"])
    assert node._vllm.llm.params[0].logprobs is None
    batch = node.policy.prepare(out["prompt_ids"], out["prompt_mask"])
    with torch.no_grad():
        want = node.policy.response_logprobs(batch, out["response_ids"], out["response_mask"])
    assert torch.allclose(out["logprobs"], want, atol=1e-6)


def test_a_weight_update_reaches_the_served_checkpoint_once_per_version(fake_vllm):
    node = Rollout(policy="tiny-qwen2", backend="vllm", max_new_tokens=4)
    node.run(prompts=["ab"])
    llm = node._vllm.llm
    state = node.policy.state_dict()
    new = {k: v + 1 for k, v in state.items() if k.endswith("up_proj.weight")}
    node.run(prompts=["ab"], weights=WeightUpdate(new, version=1, complete=False))
    for name, tensor in checkpoint_items(node.policy, new):
        assert torch.equal(llm.served[name], tensor), name
    assert llm.calls.count(RECEIVE) == 1
    node.run(prompts=["ab"], weights=WeightUpdate(new, version=1, complete=False))
    assert llm.calls.count(RECEIVE) == 1, "a version not newer is skipped"
    node.run(prompts=["ab"], weights=WeightUpdate(state, version=2))
    assert llm.calls.count(RECEIVE) == 2 and node.weights_version == 2


def test_sleep_mode_frees_the_engine_between_calls_and_wakes_weights_first(fake_vllm):
    node = Rollout(
        policy="tiny-qwen2", backend="vllm", max_new_tokens=4,
        vllm_options={"enable_sleep_mode": True, "gpu_memory_utilization": 0.3},
    )  # fmt: skip
    node.run(prompts=["ab"])
    head = {"model.lm_head.weight": node.policy.state_dict()["model.lm_head.weight"] * 0}
    node.run(prompts=["ab"], weights=WeightUpdate(head, version=1, complete=False))
    llm = node._vllm.llm
    assert llm.kwargs["enable_sleep_mode"] and llm.kwargs["gpu_memory_utilization"] == 0.3
    # level 2: the weights are dropped, not copied out, and the update sends them all (it was
    # partial: the engine held nothing to complete), then resets the caches
    # it slept once built (a trainer built after it finds the GPU free), so the first
    # generation sent the policy's weights first
    resets = ["reset prefix", "reset mm", "reset encoder"]
    assert llm.calls == [
        "sleep 2", "wake weights", RECEIVE, "weight_names", *resets, "wake kv_cache",
        "generate", "sleep 2", "wake weights", RECEIVE, *resets, "wake kv_cache", "generate",
        "sleep 2",
    ]  # fmt: skip
    assert torch.equal(llm.served["lm_head.weight"], head["model.lm_head.weight"])
    # a generation with no update since the sleep serves the policy's own weights first
    llm.calls.clear()
    node.run(prompts=["ab"])
    assert llm.calls == ["wake weights", RECEIVE, *resets, "wake kv_cache", "generate", "sleep 2"]


def test_the_engines_share_of_the_gpu_follows_its_placement(fake_vllm):
    from nodes.models.vllm_options import gpu_share

    assert gpu_share(80 * GiB, 80 * GiB, sleeps=False) == 0.9  # a GPU of its own
    assert gpu_share(80 * GiB, 80 * GiB, sleeps=True) == 0.8  # beside a trainer, asleep in turn
    assert gpu_share(40 * GiB, 80 * GiB, sleeps=False) == 0.5  # vLLM refuses more than is free
    assert gpu_share(40 * GiB, 80 * GiB, sleeps=True) == 0.4
    with pytest.raises(ValueError, match=r"2.0 of the GPU's 80.0 GiB are free.*vllm_gpu_memory"):
        gpu_share(2 * GiB, 80 * GiB, sleeps=False)

    def started(**options):
        node = Rollout(policy="tiny-qwen2", backend="vllm", max_new_tokens=4, vllm_options=options)
        node.setup()
        return node._vllm.llm.kwargs["gpu_memory_utilization"]

    assert started() == 0.9
    assert started(enable_sleep_mode=True) == 0.8
    fake_vllm.free[0] = 60 * GiB  # a trainer's state already on the GPU when the engine starts
    assert started(enable_sleep_mode=True) == 0.65
    assert started(gpu_memory_utilization=0.3) == 0.3  # the user's value wins
    assert check_vllm_options({}, "x")["gpu_memory_utilization"] is None


def test_the_engine_starts_on_the_nodes_gpu(fake_vllm, monkeypatch):
    from nodes.models.vllm_engine import VLLMEngine

    policy = build_policy("tiny-qwen2")
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}

    def engine(device, **options):
        return VLLMEngine(policy, None, seed=0, sampling=sampling, options=options, device=device)

    fake_vllm.free[1] = 40 * GiB
    llm = engine("cuda:1").llm
    assert llm.visible == "1" and fake_vllm.asked[-1] == 1
    assert llm.kwargs["gpu_memory_utilization"] == 0.5  # cuda:1's free memory, not cuda:0's
    assert engine("cuda").llm.visible == "0" and engine("cpu").llm.visible == "0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,GPU-abc")
    assert engine("cuda:1").llm.visible == "5"
    assert engine("cuda:1", tensor_parallel_size=2).llm.visible == "5,GPU-abc"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,GPU-abc"  # restored once it started
    with pytest.raises(ValueError, match="GPUs 2..3 are not all among the 3"):
        engine("cuda:2", tensor_parallel_size=2)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(ValueError, match="worker in this process, where it takes cuda:0"):
        engine("cuda:1")


def test_a_weight_update_resets_the_engines_caches_and_checks_what_loaded(fake_vllm):
    node = Rollout(policy="tiny-qwen2", backend="vllm", max_new_tokens=4)
    node.run(prompts=["ab"])
    llm = node._vllm.llm
    state = node.policy.state_dict()
    node.run(prompts=["ab"], weights=WeightUpdate(state, version=1))
    assert llm.calls[1:] == [RECEIVE, "weight_names", "reset prefix", "reset mm", "reset encoder", "generate"]  # fmt: skip
    llm.load_weights = lambda weights: set()  # names that map onto nothing
    with pytest.raises(ValueError, match="loaded none of the"):
        node.run(prompts=["ab"], weights=WeightUpdate(state, version=2))
    some = next(iter(llm.served))
    llm.load_weights = lambda weights: {some}  # a complete update that reached one parameter
    with pytest.raises(ValueError, match="left .* parameters as they were"):
        node.run(prompts=["ab"], weights=WeightUpdate(state, version=3))


def test_a_prompt_vllm_tokenizes_differently_stops_the_rollout(fake_vllm, monkeypatch):
    monkeypatch.setattr(FakeLLM, "prompt_shift", 2)
    node = Rollout(policy="tiny-qwen2", backend="vllm", max_new_tokens=4)
    with pytest.raises(ValueError, match="row 0: vLLM's prompt is .* first differing at token"):
        node.run(prompts=["ab"])


def test_a_quantized_checkpoint_is_refused_before_the_engine_starts(fake_vllm, tmp_path):
    build_policy("tiny-qwen2").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"node 'rollout': the checkpoint .* is quantized \(awq\)"):
        Rollout(policy=str(tmp_path), backend="vllm", max_new_tokens=2)


def test_a_checkpoint_directory_is_served_as_it_is(fake_vllm, tmp_path):
    build_policy("tiny-qwen2").save_pretrained(tmp_path)
    node = Rollout(policy=str(tmp_path), backend="vllm", max_new_tokens=2)
    node.setup()
    assert node._vllm.llm.path == tmp_path


def test_a_prefix_vlm_rollout_is_refused_when_the_engine_starts(fake_vllm):
    node = Rollout(policy="tiny-prefix-vlm", backend="vllm")
    with pytest.raises(ValueError, match="not a transformers model vLLM can serve"):
        node.setup()


def test_a_ready_graph_with_vllm_serves_half_precision_sleeps_and_corrects_the_gap(fake_vllm):
    from yatt_graph.refs import load_graph

    graph = load_graph("graphs.text_grpo", rollout="vllm", batch_size=2)
    rollout = graph.nodes["rollout"]
    options = rollout.vllm_options
    assert (options["dtype"], options["enforce_eager"], options["enable_sleep_mode"]) == ("auto", False, True)  # fmt: skip
    assert rollout.recompute_logprobs and graph.nodes["grpo"].hp.tis_cap == 2.0
    assert "rollout_logprobs" in {e.dst_port for e in graph.edges if e.dst == "grpo"}
    agent = load_graph("graphs.text_agent", rollout="vllm", batch_size=2)
    rollout = agent.nodes["rollout"]
    assert rollout.backend == "vllm" and rollout.vllm_options["enable_sleep_mode"]
    assert rollout.recompute_logprobs and agent.nodes["grpo"].hp.tis_cap == 2.0
    assert "rollout_logprobs" in {e.dst_port for e in agent.edges if e.dst == "grpo"}


class _Twice:
    """An environment that answers every turn, for two turns."""

    max_turns = 2

    def reset(self, row):
        from nodes.agents import Observation

        return Observation(row["prompt"])

    def step(self, action):
        from nodes.agents import Observation

        return Observation("ok"), 1.0, False


def test_an_agent_rollout_sends_each_turn_as_token_ids_and_recomputes_over_the_trajectory(
    fake_vllm,
):
    from nodes.agents import AgentRollout, observation_ids

    node = AgentRollout(
        policy="tiny-qwen2", env=_Twice, backend="vllm", max_new_tokens=4, n=2,
        recompute_logprobs=True, vllm_options={"enable_sleep_mode": True},
    )  # fmt: skip
    out = node.run(prompts=["ab", "c"], meta=None)
    llm = node._vllm.llm
    observed = observation_ids(node.policy, "ok")
    ids, mask = out["prompt_ids"], out["prompt_mask"].bool()
    firsts = [ids[b][mask[b]].tolist() for b in range(4)]
    # turn 2 continues each context token for token: the sampled ids, then the observation's
    assert [r["prompt_token_ids"] for r in llm.requests] == [
        [*p, 5, 6, 7, *observed] for p in firsts
    ]
    assert out["response_ids"][0].tolist() == [5, 6, 7, *observed, 5, 6, 7]
    turns = out["response_mask"] > 0
    assert turns[0].tolist() == [True] * 3 + [False] * len(observed) + [True] * 3
    # the sampler's logprobs beside the trainer's, recomputed over each whole trajectory
    assert torch.allclose(out["rollout_logprobs"][0, :3], torch.tensor([-0.5, -0.6, -0.7]))
    batch = node.policy.prepare(ids, out["prompt_mask"])
    with torch.no_grad():
        want = node.policy.response_logprobs(batch, out["response_ids"], out["context_mask"])
    assert torch.allclose(out["logprobs"][turns], want[turns], atol=1e-6)
    assert torch.all(out["logprobs"][~turns] == 0)
    assert llm.calls.count("generate") == 2 and llm.calls[-1] == "sleep 2"  # once, at the end
    assert llm.calls[llm.calls.index("generate") + 1] == "generate"  # awake between the turns
