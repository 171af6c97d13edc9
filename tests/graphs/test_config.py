"""The ready graphs' typed configs: defaults, checks, and every field reaching its node."""

import math
import warnings

import pytest

from graphs.advice import notes
from graphs.config import GRPOConfig, MultimodalPPOConfig, PPOConfig, RLConfig, TextGRPOConfig
from yatt_graph.errors import UnusedOutputWarning
from yatt_graph.options import config_options
from yatt_graph.refs import load_graph

# The defaults the learning tests and the README's figures were measured with (the keyword
# defaults of build_graph before the configs existed).
PPO_DEFAULTS = {
    "batch_size": 32,
    "task": "color",
    "seed": 0,
    "policy": "tiny",
    "reward": "nodes.data:answer_reward",
    "on_bad_sample": "raise",
    "lr": 1e-3,
    "critic_lr": 1e-3,
    "max_new_tokens": 2,
    "max_prompt_tokens": None,
    "temperature": 1.0,
    "kl_coef": 0.05,
    "entropy_coef": 0.01,
    "epochs": 2,
    "gamma": 1.0,
    "lam": 0.95,
    "shard_critic": False,
    "stream": False,
    # how the update steps: off or as the nodes' own defaults
    "mini_batches": 1,
    "micro_batch_tokens": 0,
    "weights_include": [],
    "weights_dtype": None,
    "mixed_precision": "no",
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "clip_eps": 0.2,
    "clip_eps_high": None,
    "dual_clip": None,
    "policy_loss": "ppo",
    "lr_schedule": "constant",
    "lr_warmup_steps": 0,
    "lr_decay_steps": 0,
    "pack_sequences": False,
    "mask_truncated": False,
    "recompute_logprobs": False,
    "tis_cap": 0.0,
    "tis_level": "token",
    "tis_mode": "truncate",
    "top_p": 1.0,
    "top_k": 0,
    "stop": [],
}
# Options that choose data, models and devices: off (the shapes task, tiny models) by default.
SOURCE_DEFAULTS = {
    "data": None,
    "val_data": None,
    "val_every": 10,
    "val_rows": 64,
    "val_samples": 1,
    "val_temperature": 1.0,
    "val_top_p": 1.0,
    "val_pass_threshold": 1.0,
    "prompt_key": "prompt",
    "image_key": "image",
    "answer_key": "answer",
    "dtype": "float32",
    "gradient_checkpointing": False,
    "lora_r": 0,
    "lora_alpha": 16.0,
    "lora_targets": "all-linear",
    "chat_template": True,
    "rollout": "hf",
    "vllm_gpu_memory": None,
    "vllm_tensor_parallel": 1,
    "vllm_dtype": "auto",
    "vllm_eager": False,
    "vllm_sleep": False,
    "device": "auto",
    "train_ranks": 1,
    "train_backend": "fsdp",
    "shard_reference": False,
    # on-policy distillation: off (no teacher)
    "teacher": None,
    "distill_coef": 0.0,
    "distill_mode": "loss",
    "distill_estimator": "k2",
    "reward_coef": 1.0,
}
PPO_DEFAULTS |= SOURCE_DEFAULTS


def as_dict(config) -> dict:
    return {f.name: getattr(config, f.name) for f in config_options(type(config))}


def test_defaults_are_the_measured_ones():
    assert as_dict(PPOConfig()) == PPO_DEFAULTS
    assert as_dict(MultimodalPPOConfig()) == {**PPO_DEFAULTS, "vision": "tiny"}
    ppo_only = ("critic_lr", "gamma", "lam", "shard_critic")
    grpo = {k: v for k, v in PPO_DEFAULTS.items() if k not in ppo_only}
    grpo |= {
        "batch_size": 16,
        "group_size": 4,
        "estimator": "grpo",
        "dynamic_sampling": 0.0,
        "overlong_buffer": 0,
        "overlong_penalty": 1.0,
        "kl_estimator": "k3",
        "aggregation": "seq-mean-token-mean",
    }
    assert as_dict(TextGRPOConfig()) == grpo
    assert as_dict(GRPOConfig()) == {**grpo, "vision": "tiny"}


def test_a_model_directory_gets_defaults_a_real_model_can_live_with(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    config = PPOConfig(policy=str(tmp_path))
    got = {k: getattr(config, k) for k in ("lr", "max_new_tokens", "epochs", "critic_lr")}
    assert got == {"lr": 1e-6, "max_new_tokens": 256, "epochs": 1, "critic_lr": 1e-5}
    assert (config.entropy_coef, config.kl_coef) == (0.0, 0.001)
    assert PPOConfig(policy=str(tmp_path), lr=3e-6).lr == 3e-6  # what is given stays
    said = notes(config)
    assert "max_new_tokens=256" in said[0] and "chat template" in said[1]
    assert "chat_template=false" in notes(PPOConfig(policy=str(tmp_path), chat_template=False))[1]
    assert notes(PPOConfig()) == []  # the tiny policy's defaults are the documented ones


@pytest.mark.parametrize(
    ("flags", "native"),
    [("fpu avx512f avx512_bf16 avx512vl", True), ("fpu amx_bf16 amx_tile", True),
     ("fpu avx2 avx512f avx512bw", False), (None, False)],
)  # fmt: skip
def test_bf16_hardware_is_read_from_the_cpu_flags(tmp_path, flags, native):
    from nodes.models.precision import native_bf16

    cpuinfo = tmp_path / "cpuinfo"
    if flags is not None:  # None: no such file (not Linux)
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\nbugs\t\t: spectre\n")
    assert native_bf16("cpu", str(cpuinfo)) is native


@pytest.mark.parametrize("native", [True, False])
def test_a_model_gets_the_precision_and_budget_measured_for_its_device(
    tmp_path, monkeypatch, native
):
    import graphs.config

    monkeypatch.setattr(graphs.config, "native_bf16", lambda device: native)
    model = TextGRPOConfig(policy=str(tmp_path), device="cpu")
    assert model.mixed_precision == ("bf16" if native else "no")
    assert model.micro_batch_tokens == graphs.config.CPU_BUDGET == 1024
    assert f"mixed_precision={model.mixed_precision}, micro_batch_tokens=1024" in notes(model)[0]
    cuda = TextGRPOConfig(policy=str(tmp_path), device="cuda")
    assert (cuda.mixed_precision, cuda.micro_batch_tokens) == ("bf16" if native else "no", 0)
    assert (TextGRPOConfig().mixed_precision, TextGRPOConfig().micro_batch_tokens) == ("no", 0)
    given = TextGRPOConfig(policy=str(tmp_path), mixed_precision="no", micro_batch_tokens=0)
    assert (given.mixed_precision, given.micro_batch_tokens) == ("no", 0)  # what is given stays
    # the run's note names only the defaults it chose, not what the user set
    note = notes(given, {"mixed_precision", "micro_batch_tokens"})[0]
    assert "lr=1e-06" in note and "mixed_precision" not in note and "micro_batch" not in note


def test_a_saved_tiny_model_keeps_the_shapes_defaults(tmp_path):
    from nodes.models.hf_causal import tiny_causal_lm

    tiny_causal_lm().save_pretrained(tmp_path)  # as a run's --export writes it
    config = TextGRPOConfig(policy=str(tmp_path))
    assert (config.lr, config.max_new_tokens, config.epochs) == (1e-3, 2, 2)
    assert notes(config) == []


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-qwen2"])
def test_a_tiny_model_by_name_keeps_the_shapes_defaults(name):
    config = TextGRPOConfig(policy=name)  # built in code: not a model of the user's
    assert (config.lr, config.max_new_tokens, config.epochs) == (1e-3, 2, 2)


@pytest.mark.parametrize("config", [MultimodalPPOConfig, PPOConfig, GRPOConfig, TextGRPOConfig])
def test_every_field_has_a_docstring(config):
    missing = [o.name for o in config_options(config) if not o.doc]
    assert not missing, f"{config.__name__} fields without a docstring: {missing}"


@pytest.mark.parametrize(
    ("config", "field", "value", "allowed"),
    [
        (RLConfig, "batch_size", 0, ">= 1"),
        (RLConfig, "seed", -1, ">= 0"),
        (RLConfig, "task", "colour", "one of color, shape, count"),
        (RLConfig, "lr", -1e-3, "> 0"),
        (RLConfig, "lr", math.nan, "> 0"),
        (RLConfig, "temperature", 0.0, ">= 0.01"),
        (RLConfig, "kl_coef", -0.1, ">= 0"),
        (RLConfig, "epochs", 0, ">= 1"),
        (RLConfig, "on_bad_sample", "error", "one of raise, skip"),
        (RLConfig, "distill_coef", -0.5, ">= 0"),
        (RLConfig, "reward_coef", -1.0, ">= 0"),
        (RLConfig, "distill_mode", "kl", "one of loss, advantage"),
        (RLConfig, "teacher", "/no/such/teacher", "an existing local model folder"),
        (PPOConfig, "gamma", 1.5, "in [0.0, 1.0]"),
        (PPOConfig, "lam", -0.1, "in [0.0, 1.0]"),
        (PPOConfig, "critic_lr", math.inf, "> 0"),
        (GRPOConfig, "group_size", 1, ">= 2"),
        (
            GRPOConfig,
            "estimator",
            "ppo",
            "one of grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline",
        ),
    ],
)
def test_a_bad_value_names_the_field_the_value_and_what_is_allowed(config, field, value, allowed):
    with pytest.raises(ValueError) as info:
        config(**{field: value})
    message = str(info.value)
    assert f"option {field}={value!r}" in message and allowed in message


def test_build_graph_refuses_unknown_options_and_wrong_types_naming_them():
    with pytest.raises(
        TypeError,
        match=r"unknown option 'batch_sise' for mm_ppo \(did you mean 'batch_size'\?\); valid: ",
    ):
        load_graph("graphs.mm_ppo", batch_sise=4)
    with pytest.raises(TypeError, match=r"unknown option 'vision' for text_ppo"):
        load_graph("graphs.text_ppo", vision="tiny")  # a text graph has no vision tower
    with pytest.raises(TypeError, match=r"unknown option 'critic_lr' for mm_grpo"):
        load_graph("graphs.mm_grpo", critic_lr=1e-3)  # GRPO has no critic
    with pytest.raises(TypeError, match=r"option 'batch_size' of mm_ppo: '4' is not int"):
        load_graph("graphs.mm_ppo", batch_size="4")
    with pytest.raises(TypeError, match=r"option 'stream' of mm_grpo: 'no' is not bool"):
        load_graph("graphs.mm_grpo", stream="no")
    with pytest.raises(ValueError, match=r"mm_grpo: option group_size=1: must be >= 2"):
        load_graph("graphs.mm_grpo", group_size=1)


def test_every_option_reaches_the_node_that_uses_it():
    ppo = load_graph(
        "graphs.mm_ppo",
        batch_size=4,
        seed=3,
        lr=2e-3,
        critic_lr=3e-3,
        max_new_tokens=5,
        temperature=0.7,
        kl_coef=0.2,
        entropy_coef=0.02,
        epochs=3,
        gamma=0.9,
        lam=0.8,
        stream=True,
        task="shape",
    )
    config = {name: node.config() for name, node in ppo.nodes.items()}
    assert config["data"]["batch_size"] == 4 and config["data"]["task"] == "shape"
    assert config["data"]["seed"] == 3
    rollout = config["rollout"]
    assert (rollout["max_new_tokens"], rollout["temperature"], rollout["stream"]) == (5, 0.7, True)
    assert config["gae"] == {"gamma": 0.9, "lam": 0.8, "kl_coef": 0.2, "name": "gae"}
    update = config["ppo"]
    assert (update["lr"], update["critic_lr"], update["entropy_coef"]) == (2e-3, 3e-3, 0.02)
    assert (update["epochs"], update["temperature"], update["seed"]) == (3, 0.7, 3)

    grpo = load_graph("graphs.mm_grpo", batch_size=2, group_size=3, estimator="rloo", lr=5e-4)
    assert grpo.nodes["rollout"].config()["n"] == 3
    assert grpo.nodes["group_advantage"].config()["estimator"] == "rloo"
    assert grpo.nodes["grpo"].config()["lr"] == 5e-4
    drgrpo = load_graph(
        "graphs.text_grpo", aggregation="seq-mean-token-sum-norm", max_new_tokens=6
    ).nodes["grpo"]
    assert (drgrpo.hp.aggregation, drgrpo.hp.horizon) == ("seq-mean-token-sum-norm", 6)
    text = load_graph("graphs.text_ppo", batch_size=2, on_bad_sample="skip")
    assert "vision" not in text.nodes and "bad_samples" in text.graph_outputs


def test_a_python_int_is_accepted_for_a_float_option():
    graph = load_graph("graphs.mm_ppo", batch_size=2, kl_coef=0)
    assert graph.nodes["gae"].config()["kl_coef"] == 0.0


def test_the_trainer_recomputes_logprobs_and_corrects_the_gap_where_the_sampler_differs():
    plain = TextGRPOConfig()
    assert (plain.recompute_logprobs, plain.tis_cap) == (False, 0.0)  # one model samples, trains
    vllm = TextGRPOConfig(rollout="vllm")
    assert (vllm.recompute_logprobs, vllm.tis_cap) == (True, 2.0)
    bf16 = TextGRPOConfig(dtype="bfloat16")
    assert (bf16.recompute_logprobs, bf16.tis_cap) == (True, 0.0)
    assert TextGRPOConfig(dtype="bfloat16", stream=True).recompute_logprobs is False
    with pytest.raises(ValueError, match="tis_cap=2.0 needs recompute_logprobs=true"):
        TextGRPOConfig(tis_cap=2.0, stream=True)
    with pytest.raises(ValueError, match="recompute_logprobs=true and stream=true"):
        TextGRPOConfig(recompute_logprobs=True, stream=True)
    with pytest.raises(ValueError, match="tis_cap"):
        TextGRPOConfig(tis_cap=-1.0)
    with warnings.catch_warnings():  # every output is wired or discarded, either way
        warnings.simplefilter("error", UnusedOutputWarning)
        graph = load_graph("graphs.text_grpo", batch_size=2, tis_cap=1.5)
        plain_graph = load_graph("graphs.text_grpo", batch_size=2)
    assert graph.nodes["rollout"].config()["recompute_logprobs"] is True
    assert graph.nodes["grpo"].config()["tis_cap"] == 1.5
    wired = {e.dst_port for e in graph.edges if e.dst == "grpo"}
    assert "rollout_logprobs" in wired
    assert "rollout_logprobs" not in {e.dst_port for e in plain_graph.edges if e.dst == "grpo"}


def test_vllm_sleeps_between_rollouts_unless_the_run_never_offloads():
    from runtime.cli import parse_run
    from runtime.run import graph_options

    assert TextGRPOConfig(rollout="vllm").vllm_sleep is True
    assert TextGRPOConfig().vllm_sleep is False  # nothing to free without vLLM
    assert TextGRPOConfig(rollout="vllm", vllm_sleep=False).vllm_sleep is False

    def options(*flags):
        spec = parse_run(["text_grpo", *flags])
        return graph_options(spec.graph, spec.engine.offload)

    assert "vllm_sleep" not in options()
    assert options("--offload", "off")["vllm_sleep"] is False
    assert options("--offload", "off", "--set", "vllm_sleep=true")["vllm_sleep"] is True


def test_dynamic_sampling_draws_more_prompts_and_trains_on_the_informative_groups():
    config = TextGRPOConfig(batch_size=4, dynamic_sampling=0.5)
    assert config.prompts_drawn == 6 and TextGRPOConfig(batch_size=4).prompts_drawn == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedOutputWarning)
        graph = load_graph("graphs.mm_grpo", batch_size=4, dynamic_sampling=0.5)
    assert graph.nodes["data"].config()["batch_size"] == 6
    assert graph.nodes["keep_groups"].config()["keep"] == 4
    feeds = {e.src for e in graph.edges if e.dst in ("grpo", "reference", "group_advantage")}
    assert "rollout" not in feeds and "keep_groups" in feeds  # every row they read is kept
    assert "dynamic_sampling" in graph.graph_outputs
    with pytest.raises(ValueError, match="dynamic_sampling and stream=true"):
        TextGRPOConfig(dynamic_sampling=0.5, stream=True)
    with pytest.raises(ValueError, match="dynamic_sampling"):
        TextGRPOConfig(dynamic_sampling=-1.0)


def test_grpo_without_its_kl_term_runs_no_reference():
    assert "reference" in load_graph("graphs.text_grpo", batch_size=2).nodes
    graph = load_graph("graphs.mm_grpo", batch_size=2, kl_coef=0.0)
    assert "reference" not in graph.nodes
    assert "ref_logprobs" not in {e.dst_port for e in graph.edges if e.dst == "grpo"}


def test_chat_template_is_idle_only_for_a_policy_without_one(tmp_path):
    """``chat_template`` matters for a policy folder whose tokenizer has a template (a saved
    tiny model's too), and is listed idle for the built-in tiny policies and a folder without."""
    from nodes.models.hf_causal import tiny_causal_lm

    template = "{% for m in messages %}U:{{ m['content'] }};{% endfor %}A:"
    tiny_causal_lm("llama", chat_template=template).save_pretrained(tmp_path / "chat")
    tiny_causal_lm("llama").save_pretrained(tmp_path / "plain")
    assert "chat_template" not in TextGRPOConfig(policy=str(tmp_path / "chat")).idle_options()
    for policy in ("tiny-llama", str(tmp_path / "plain")):
        assert "chat_template" in TextGRPOConfig(policy=policy).idle_options(), policy
