"""Every option of the ready graphs reaches the node that uses it, given as a user gives it.

For each ready graph with a typed config, every option of the config (what ``yatt-graph show
GRAPH --options --all`` lists) gets a valid value other than its default, as the words of a
``yatt-graph run`` command line (``--set key=value`` and the flags named after options:
``--policy``, ``--data``, ``--seed``, ...), parsed and built by the code ``yatt-graph run``
builds with. A check per option then reads the attributes of the built nodes: the value must
be where it is used. Values that cannot go together (``stream`` and ``recompute_logprobs``,
``task`` and ``data``) are given in separate scenarios of the same graph.

No node is set up, so no model loads: each model folder holds what building a graph reads of
it (config.json, a weights file's header, the tokenizer's files). The graphs are built as on a
CUDA machine with vLLM installed (``torch.cuda`` and the rollout's vLLM check answer yes), so
that ``device=cuda`` and ``rollout=vllm`` reach the nodes; construction touches no GPU.

An option without a check here fails :func:`test_every_option_has_a_check`;
``tests/mutate_options.py`` removes, one at a time, each place where the graphs hand an option
on, and runs this file against each removal.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from runtime.cli import build_parser, parse_run
from runtime.run import graph_input, graph_options, load
from yatt_graph import UsageError
from yatt_graph.options import config_options, load_graph_module

GRAPHS = ("mm_ppo", "mm_grpo", "text_ppo", "text_grpo", "text_agent", "mm_agent")
"""The ready graphs with a typed config (``toy`` takes its three options by signature)."""

AGENTS = ("text_agent", "mm_agent")
PPO = ("mm_ppo", "text_ppo")


class Files(NamedTuple):
    """A user's files, as the options name them."""

    data: str
    reward: str
    lm: str
    vlm: str
    reward_model: str
    clip_weights: str
    envs: str


class Scenario(NamedTuple):
    values: dict[str, Any]
    """Option -> the value the graph must get (and each check looks for)."""
    flags: bool = False
    """Give the options that have a flag of ``yatt-graph run`` by it, not by ``--set``."""
    extra: tuple[str, ...] = ()
    """More words of the command line."""
    given: frozenset[str] = frozenset()
    """The options that ``extra`` gives (``--reward-model DIR`` is ``reward``)."""


class Built(NamedTuple):
    graph: Any
    values: dict[str, Any]
    options: dict[str, Any]
    """The options as the command line gave them to the graph."""
    spec: Any
    """The run's :class:`runtime.flags.RunSpec`."""

    @property
    def nodes(self) -> dict[str, Any]:
        return self.graph.nodes

    @property
    def edges(self) -> list[Any]:
        return list(self.graph.edges)

    @property
    def outputs(self) -> Any:
        return self.graph.graph_outputs


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    from PIL import Image

    root = tmp_path_factory.mktemp("user")
    Image.new("RGB", (8, 8), "red").save(root / "shape.png")
    row = {"question": "What colour is the shape?", "picture": "shape.png", "label": "red"}
    (root / "rows.jsonl").write_text((json.dumps(row) + "\n") * 4)
    (root / "rewards.py").write_text(
        "def score(text, meta):\n    return float(text.strip() == meta['answer'])\n"
    )
    (root / "envs.py").write_text(
        "from nodes.agents.lookup import LookEnv, LookImageEnv\n\n\n"
        "class WordEnv(LookEnv):\n    max_turns = 4\n    words = ('look', 'peek')\n\n\n"
        "class PictureEnv(LookImageEnv):\n    max_turns = 4\n    words = ('look', 'peek')\n"
    )
    write_models(root)
    (root / "clip.bin").write_bytes(b"")
    return Files(
        data=str(root / "rows.jsonl"),
        reward=f"{root / 'rewards.py'}:score",
        lm=str(root / "lm"),
        vlm=str(root / "vlm"),
        reward_model=str(root / "scorer"),
        clip_weights=str(root / "clip.bin"),
        envs=str(root / "envs.py"),
    )


def write_models(root: Path) -> None:
    """Folders as a user's causal LM, VLM and reward model hold them, with what building a
    graph reads of them (config.json, a weights file's header, the tokenizer's and the image
    processor's files); nothing loads the weights, so one small tensor stands for them."""
    from safetensors.torch import save_file

    from nodes.models.policy_base import char_tokenizer

    configs = {
        "lm": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
        "vlm": {
            "model_type": "qwen2_vl",
            "architectures": ["Qwen2VLForConditionalGeneration"],
            "vision_config": {},
        },
        "scorer": {
            "model_type": "gpt2",
            "architectures": ["GPT2ForSequenceClassification"],
            "num_labels": 1,
        },
    }
    tokenizer = char_tokenizer()
    for folder, config in configs.items():
        (root / folder).mkdir()
        (root / folder / "config.json").write_text(json.dumps(config))
        save_file({"weight": torch.zeros(1)}, str(root / folder / "model.safetensors"))
        tokenizer.save_pretrained(root / folder)
    (root / "vlm" / "preprocessor_config.json").write_text("{}")


@pytest.fixture(autouse=True)
def _cuda_and_vllm(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("nodes.rollout.vllm_unavailable_reason", lambda: None)


def scenarios(graph: str, f: Files) -> dict[str, Scenario]:
    """Every option of ``graph`` set, across scenarios whose values can go together."""
    agent, ppo = graph in AGENTS, graph in PPO
    common: dict[str, Any] = {
        "batch_size": 3, "seed": 7, "lr": 0.002, "max_new_tokens": 7, "max_prompt_tokens": 50,
        "temperature": 0.7, "kl_coef": 0.3, "entropy_coef": 0.02, "epochs": 3,
        "mini_batches": 2, "micro_batch_tokens": 96, "pack_sequences": True,
        "mask_truncated": True, "mixed_precision": "bf16", "weight_decay": 0.01,
        "max_grad_norm": 0.5, "clip_eps": 0.1, "clip_eps_high": 0.28, "dual_clip": 3.0,
        "policy_loss": "gspo",
        "lr_schedule": "cosine", "lr_warmup_steps": 4, "lr_decay_steps": 40, "top_p": 0.9,
        "top_k": 5, "stop": ["</answer>"], "dtype": "bfloat16", "gradient_checkpointing": True,
        "lora_r": 4, "lora_alpha": 8.0, "lora_targets": "q_proj,v_proj", "chat_template": False,
        "train_ranks": 2, "train_backend": "ddp", "shard_reference": True, "on_bad_sample": "skip",
        "policy": f.vlm if graph == "mm_agent" else f.lm,
    }  # fmt: skip
    if ppo:
        common |= {"critic_lr": 0.003, "gamma": 0.9, "lam": 0.8, "shard_critic": True}
    else:
        common |= {"group_size": 3, "estimator": "rloo", "overlong_buffer": 3,
                   "overlong_penalty": 0.5, "kl_estimator": "k2", "aggregation": "token-mean"}  # fmt: skip
    if graph in ("mm_ppo", "mm_grpo"):
        common["vision"] = f"open_clip:ViT-B-32:{f.clip_weights}"
    if agent:
        common["env"] = f"{f.envs}:{'PictureEnv' if graph == 'mm_agent' else 'WordEnv'}"
    # a user's data, vLLM on a GPU (the trainer recomputes the logprobs), by the named flags
    own = common | {
        "data": f.data, "prompt_key": "question", "image_key": "picture", "answer_key": "label",
        "rollout": "vllm", "vllm_gpu_memory": 0.5, "vllm_tensor_parallel": 2,
        "vllm_dtype": "float16", "vllm_eager": True, "vllm_sleep": True,
        "recompute_logprobs": True, "tis_cap": 1.5, "tis_level": "sequence", "tis_mode": "mask",
        "device": "cuda",
        "weights_include": ["lora_", "^head"], "weights_dtype": "bfloat16",
        "teacher": common["policy"], "distill_coef": 0.5, "distill_mode": "advantage",
        "distill_estimator": "k3", "reward_coef": 0.5,
    }  # fmt: skip
    if agent:
        own["max_turns"] = 3
    else:
        own |= {"reward": f.reward, "val_data": f.data, "val_every": 3, "val_rows": 5,
                "val_samples": 4, "val_temperature": 0.6, "val_top_p": 0.8,
                "val_pass_threshold": 0.5}  # fmt: skip
    if not (agent or ppo):
        own["dynamic_sampling"] = 0.5
    # the shapes task, streamed, on the CPU although CUDA is there, all by --set
    shapes = common | {"task": "shape", "stream": True, "device": "cpu"}
    if not ppo:
        shapes["kl_coef"] = 0.0  # GRPO without its KL term: no reference (none to shard)
        del shapes["shard_reference"]
    if agent:  # the tiny policy, whose vocabulary takes the environment's words (an agent
        # graph reads on_bad_sample for the rows of --data, chat_template for a model's own)
        for name in ("on_bad_sample", "policy", "chat_template"):
            del shapes[name]
    out = {  # (with controllers, a run hands the device on in its RunConfig too)
        "own": Scenario(own, flags=True, extra=("--controllers", "2")),
        "shapes": Scenario(shapes),
    }
    if not agent:
        out["reward_model"] = Scenario(  # (on a GPU, its validation scored by the model too)
            {
                "reward": f"model:{f.reward_model}",
                "micro_batch_tokens": 64,
                "device": "cuda",
                "data": f.data,
                "val_data": f.data,
                "prompt_key": "question",
                "image_key": "picture",
                "answer_key": "label",
            },
            extra=("--reward-model", f.reward_model),
            given=frozenset({"reward"}),
        )
        out["judge"] = Scenario(
            {"reward": "judge:tiny", "micro_batch_tokens": 32},
            extra=("--judge", "tiny"),
            given=frozenset({"reward"}),
        )
    return out


def run_flags() -> dict[str, str]:
    """The flags of ``yatt-graph run`` that give a graph option: option -> flag."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a.option_strings[-1] for a in sub.choices["run"]._actions if a.option_strings}


def text(value: Any) -> str:
    """``value`` as a user types it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value)


def words(graph: str, scenario: Scenario) -> list[str]:
    flags, sets, line = run_flags(), [], ["run", f"graphs.{graph}", *scenario.extra]
    for key, value in scenario.values.items():
        if key in scenario.given:
            continue
        if scenario.flags and key in flags:
            line += [flags[key], text(value)]
        else:
            sets.append(f"{key}={text(value)}")
    return [*line, "--set", *sets] if sets else line


def build(graph: str, scenario: Scenario) -> Built:
    """The graph as ``yatt-graph run`` builds it from the scenario's command line."""
    spec = parse_run(words(graph, scenario)[1:])
    with graph_input(spec.graph.ref):
        options = graph_options(spec.graph, spec.engine.offload)
        _, g = load(spec.graph, options)
    return Built(g, scenario.values, options, spec)


def config_of(graph: str) -> Any:
    return load_graph_module(f"graphs.{graph}").CONFIG


# --- where each option must arrive ------------------------------------------------------------


def update(b: Built) -> Any:
    return b.nodes["ppo" if "ppo" in b.nodes else "grpo"]


def inputs(b: Built, node: str) -> set[str]:
    """The input ports of ``node`` that an edge feeds."""
    return {e.dst_port for e in b.edges if e.dst == node}


def specs(b: Built) -> list[dict[str, Any]]:
    """The specs of every copy of the policy (and of the critic, built from it)."""
    n = b.nodes
    out = [n["rollout"].policy_spec, update(b).policy_spec]
    for name in ("reference", "validation"):
        if name in n:
            out.append(n[name].policy_spec)
    if "critic" in n:
        out += [n["critic"].critic_spec, n["ppo"].critic_spec]
    return out


def has_validation(b: Built) -> bool:
    present = "validation" in b.nodes
    assert present == ("val_data" in b.values), "a validation node exactly where val_data is set"
    return present


def is_reward(node: Any, value: str) -> None:
    from nodes.rewards import JudgeReward, RewardModel

    kind, _, rest = value.partition(":")
    if kind == "model":
        assert isinstance(node, RewardModel) and node.path == rest
    elif kind == "judge":
        assert isinstance(node, JudgeReward) and node.model_source == rest
    else:
        file, _, name = value.rpartition(":")
        assert node.fn.__name__ == name
        assert Path(inspect.getfile(node.fn)).resolve() == Path(file).resolve()


def check_batch_size(b: Built, v: int) -> None:
    drawn = math.ceil(v * (1 + b.values.get("dynamic_sampling", 0.0)))
    assert b.nodes["data"].batch_size == drawn
    assert ("keep_groups" in b.nodes) == ("dynamic_sampling" in b.values)
    if "dynamic_sampling" in b.values:
        assert b.nodes["keep_groups"].keep == v
    if has_validation(b):
        assert b.nodes["validation"].batch_size == v


def check_task(b: Built, v: str) -> None:
    from nodes.data import ShapesSource

    assert isinstance(b.nodes["data"], ShapesSource) and b.nodes["data"].task == v


def check_seed(b: Built, v: int) -> None:
    n, spec = b.nodes, b.nodes["rollout"].policy_spec
    assert (n["data"].seed, n["rollout"].seed, update(b).hp.seed) == (v, v, v)
    if "vision" in n:
        assert n["vision"].seed == v
    if "path" not in spec or "image_dim" in spec:  # a tiny policy, a prefix-VLM around an LM
        assert spec["seed"] == v
    if "critic" in n:
        assert (n["critic"].head_seed, n["ppo"].head_seed) == (v, v)
        if "seed" in spec:
            assert n["critic"].critic_spec["seed"] == v + 1


def check_policy(b: Built, v: str) -> None:
    assert all(spec["path"] == v for spec in specs(b)), specs(b)


def check_reward(b: Built, v: str) -> None:
    is_reward(b.nodes["reward"], v)
    if has_validation(b):
        is_reward(b.nodes["validation"].reward, v)


def check_on_bad_sample(b: Built, v: str) -> None:
    from nodes.datasets import DatasetSource

    data, places = b.nodes["data"], 0
    if "reward" in b.nodes:
        assert b.nodes["reward"].on_bad_sample == v
        assert ("bad_samples" in b.outputs) == (v == "skip")
        places += 1
    if isinstance(data, DatasetSource):
        assert data.on_bad_sample == v
        places += 1
    if has_validation(b):
        validation = b.nodes["validation"]
        assert (validation.source.on_bad_sample, validation.reward.on_bad_sample) == (v, v)
    assert places, "no node reads on_bad_sample here: the scenario must not set it"


def check_max_new_tokens(b: Built, v: int) -> None:
    rollout = b.nodes["rollout"]
    assert rollout.sampling["max_new_tokens"] == v
    if has_validation(b):
        assert b.nodes["validation"].max_new_tokens == v
    if "grpo" in b.nodes:  # Dr.GRPO's constant normaliser, and the overlong penalty's end
        assert b.nodes["grpo"].hp.horizon == v * getattr(rollout, "max_turns", 1)
        assert b.nodes["group_advantage"].overlong[1] == v


def check_max_prompt_tokens(b: Built, v: int) -> None:
    assert b.nodes["rollout"].max_prompt_tokens == v
    if has_validation(b):
        assert b.nodes["validation"].max_prompt_tokens == v


def check_temperature(b: Built, v: float) -> None:
    assert b.nodes["rollout"].sampling["temperature"] == v
    assert update(b).hp.temperature == v
    if "reference" in b.nodes:
        assert b.nodes["reference"].temperature == v


def check_kl_coef(b: Built, v: float) -> None:
    if "gae" in b.nodes:  # PPO: a penalty in the reward
        assert b.nodes["gae"].kl_coef == v
        assert "ref_logprobs" in inputs(b, "gae")
        return
    assert update(b).hp.kl_coef == v
    assert ("reference" in b.nodes) == (v > 0)  # GRPO reads the reference for its KL term only
    assert ("ref_logprobs" in inputs(b, "grpo")) == (v > 0)


def check_micro_batch_tokens(b: Built, v: int) -> None:
    assert update(b).hp.micro_batch_tokens == v
    for name in ("reference", "critic"):
        if name in b.nodes:
            assert b.nodes[name].micro_batch_tokens == v, name
    for reward in model_rewards(b):
        assert reward.micro_batch_tokens == v, reward.name


def check_mixed_precision(b: Built, v: str) -> None:
    """The update trains, and the rollout samples and the reference and critic score, in it."""
    assert update(b).hp.mixed_precision == v
    assert b.nodes["rollout"].precision == v
    for name in ("reference", "critic"):
        if name in b.nodes:
            assert b.nodes[name].precision == v, name


def model_rewards(b: Built) -> list[Any]:
    """The reward nodes that run a model: the run's and the validation's own."""
    from nodes.rewards import ClipScoreReward, JudgeReward, RewardModel

    rewards = [b.nodes.get("reward")]
    if has_validation(b):
        rewards.append(b.nodes["validation"].reward)
    return [r for r in rewards if isinstance(r, RewardModel | JudgeReward | ClipScoreReward)]


def check_stop(b: Built, v: list[str]) -> None:
    assert b.nodes["rollout"].sampling["stop_strings"] == v
    if has_validation(b):
        assert b.nodes["validation"].stop == v


def check_recompute_logprobs(b: Built, v: bool) -> None:
    assert b.nodes["rollout"].recompute_logprobs is v
    discarded = {(h.node, h.port) for h in b.graph.discarded}  # what the graph marks unused
    assert (("rollout", "rollout_logprobs") in discarded) is not v
    assert ("rollout_logprobs" in inputs(b, update(b).name)) == v
    assert ("rollout_logprobs" in inputs(b, "sample_stats")) == v
    if "keep_groups" in b.nodes:
        assert ("rollout_logprobs" in b.nodes["keep_groups"].rows) == v


def check_data(b: Built, v: str) -> None:
    from nodes.datasets import DatasetSource

    data = b.nodes["data"]
    assert isinstance(data, DatasetSource) and data.path == v
    assert "data" in b.outputs  # its epoch and skipped rows, in the metrics


def check_val_data(b: Built, v: str) -> None:
    assert has_validation(b) and b.nodes["validation"].source.path == v
    assert "val" in b.outputs
    assert {e.src for e in b.edges if e.dst == "validation" and e.dst_port == "weights"} == {
        update(b).name
    }


def check_data_key(key: str) -> Callable[[Built, str], None]:
    def check(b: Built, v: str) -> None:
        assert getattr(b.nodes["data"], key) == v
        if has_validation(b):
            assert getattr(b.nodes["validation"].source, key) == v

    return check


def check_spec(key: str, want: Callable[[Any], Any] = lambda v: v) -> Callable[[Built, Any], None]:
    def check(b: Built, v: Any) -> None:
        assert all(spec.get(key) == want(v) for spec in specs(b)), specs(b)

    return check


def check_lora(key: str, want: Callable[[Any], Any] = lambda v: v) -> Callable[[Built, Any], None]:
    def check(b: Built, v: Any) -> None:
        assert all(spec["lora"][key] == want(v) for spec in specs(b)), specs(b)

    return check


def check_vllm(key: str) -> Callable[[Built, Any], None]:
    def check(b: Built, v: Any) -> None:
        assert b.nodes["rollout"].vllm_options[key] == v

    return check


def check_device(b: Built, v: str) -> None:
    want = torch.device(v)
    for name in ("vision", "rollout", "reference", "critic"):
        if name in b.nodes:
            assert b.nodes[name].device == want, name
    assert update(b).device == want
    if has_validation(b):
        assert torch.device(b.nodes["validation"].device) == want
    for reward in model_rewards(b):
        assert torch.device(reward.device) == want, reward.name
    if b.spec.launch.distributed:  # the run's controllers take it from the RunConfig
        assert b.spec.engine.device == v


def check_train_ranks(b: Built, v: int) -> None:
    trainer = update(b)
    assert trainer.ranks == v
    if v > 1:  # a rank group trains its own copies: it shares no model with the rollout
        assert trainer.share is None
        assert getattr(trainer, "critic_share", None) is None


def check_shard_reference(b: Built, v: bool) -> None:
    """The reference joins the update's rank group: as many ranks, its own copy sharded."""
    reference = b.nodes["reference"]
    assert v and (reference.ranks, reference.rank_with) == (b.values["train_ranks"], update(b).name)
    assert reference.config()["ranks"] == reference.ranks  # each rank rebuilds it so
    assert reference.train_backend == "fsdp"  # (the update's ddp would hold whole copies)


def check_shard_critic(b: Built, v: bool) -> None:
    """The critic scores on the update's ranks, with the value model the update trains."""
    critic = b.nodes["critic"]
    assert v and (critic.ranks, critic.rank_with) == (b.values["train_ranks"], update(b).name)
    assert critic.config()["rank_with"] == update(b).name  # each rank rebuilds it so


def check_vision(b: Built, v: str) -> None:
    _, name, weights = v.split(":", 2)
    vision = b.nodes["vision"]
    assert (vision.model_name, vision.pretrained, vision.overrides) == (name, weights, {})
    assert b.nodes["rollout"].policy_spec["image_dim"] == vision.embed_dim
    if has_validation(b):
        assert b.nodes["validation"].vision["model_name"] == name


def check_dynamic_sampling(b: Built, v: float) -> None:
    batch = b.values["batch_size"]
    assert b.nodes["data"].batch_size == math.ceil(batch * (1 + v))
    assert b.nodes["keep_groups"].keep == batch
    assert "dynamic_sampling" in b.outputs
    assert {e.src for e in b.edges if e.dst == "grpo"} & {"rollout", "reward"} == set()


def check_env(b: Built, v: str) -> None:
    rollout = b.nodes["rollout"]
    assert rollout.env == v and rollout.env_class.__name__ == v.rpartition(":")[2]
    if "policy" not in b.values:  # the tiny policy's vocabulary has the environment's words
        assert set(rollout.env_class.words) <= set(rollout.policy_spec["words"])
    if "max_turns" not in b.values:
        assert rollout.max_turns == rollout.env_class.max_turns


def check_max_turns(b: Built, v: int) -> None:
    rollout = b.nodes["rollout"]
    assert rollout.max_turns == v
    assert b.nodes["grpo"].hp.horizon == rollout.sampling["max_new_tokens"] * v


def node_attribute(node: str, attribute: str) -> Callable[[Built, Any], None]:
    def check(b: Built, v: Any) -> None:
        assert getattr(b.nodes[node], attribute) == v

    return check


def update_attribute(attribute: str) -> Callable[[Built, Any], None]:
    def check(b: Built, v: Any) -> None:  # a hyper-parameter, or the node's own option
        node = update(b)
        assert getattr(node.hp if attribute in node.hp.__struct_fields__ else node, attribute) == v

    return check


def check_teacher(b: Built, v: str) -> None:
    """The teacher scores the rollout's responses and the update reads its logprobs."""
    assert b.nodes["teacher"].policy_spec["path"] == v
    assert "teacher_logprobs" in inputs(b, update(b).name)


def check_weights_include(b: Built, v: Any) -> None:
    assert [p.pattern for p in update(b).weights_include] == v


def check_weights_dtype(b: Built, v: Any) -> None:
    assert update(b).weights_dtype == getattr(torch, v)


def sampling(key: str, want: Callable[[Any], Any] = lambda v: v) -> Callable[[Built, Any], None]:
    def check(b: Built, v: Any) -> None:
        assert b.nodes["rollout"].sampling[key] == want(v)

    return check


def overlong(index: int) -> Callable[[Built, Any], None]:
    def check(b: Built, v: Any) -> None:  # (buffer, max_new_tokens, penalty)
        assert b.nodes["group_advantage"].overlong[index] == v

    return check


def check_clip(index: int) -> Callable[[Built, Any], None]:
    def check(b: Built, v: float) -> None:  # (below 1, above 1, dual clip) of the ratio
        assert update(b).hp.clip[index] == v

    return check


CHECKS: dict[str, Callable[[Built, Any], None]] = {
    "batch_size": check_batch_size,
    "task": check_task,
    "seed": check_seed,
    "policy": check_policy,
    "reward": check_reward,
    "on_bad_sample": check_on_bad_sample,
    "lr": update_attribute("lr"),
    "max_new_tokens": check_max_new_tokens,
    "max_prompt_tokens": check_max_prompt_tokens,
    "temperature": check_temperature,
    "kl_coef": check_kl_coef,
    "entropy_coef": update_attribute("entropy_coef"),
    "epochs": update_attribute("epochs"),
    "mini_batches": update_attribute("mini_batches"),
    "micro_batch_tokens": check_micro_batch_tokens,
    "pack_sequences": update_attribute("pack_sequences"),
    "mask_truncated": update_attribute("mask_truncated"),
    "recompute_logprobs": check_recompute_logprobs,
    "tis_cap": update_attribute("tis_cap"),
    "tis_level": update_attribute("tis_level"),
    "tis_mode": update_attribute("tis_mode"),
    "weights_include": check_weights_include,
    "weights_dtype": check_weights_dtype,
    "mixed_precision": check_mixed_precision,
    "weight_decay": update_attribute("weight_decay"),
    "max_grad_norm": update_attribute("max_grad_norm"),
    "clip_eps": check_clip(0),
    "clip_eps_high": check_clip(1),
    "dual_clip": check_clip(2),
    "policy_loss": update_attribute("policy_loss"),
    "lr_schedule": update_attribute("lr_schedule"),
    "lr_warmup_steps": update_attribute("lr_warmup_steps"),
    "lr_decay_steps": update_attribute("lr_decay_steps"),
    "top_p": sampling("top_p"),
    "top_k": sampling("top_k"),
    "stop": check_stop,
    "stream": node_attribute("rollout", "stream"),
    "data": check_data,
    "val_data": check_val_data,
    "val_every": node_attribute("validation", "every"),
    "val_rows": node_attribute("validation", "rows"),
    "val_samples": node_attribute("validation", "samples"),
    "val_temperature": node_attribute("validation", "temperature"),
    "val_top_p": node_attribute("validation", "top_p"),
    "val_pass_threshold": node_attribute("validation", "pass_threshold"),
    "prompt_key": check_data_key("prompt_key"),
    "image_key": check_data_key("image_key"),
    "answer_key": check_data_key("answer_key"),
    "dtype": check_spec("dtype"),
    "gradient_checkpointing": check_spec("gradient_checkpointing"),
    "lora_r": check_lora("r"),
    "lora_alpha": check_lora("alpha"),
    "lora_targets": check_lora("target_modules", lambda v: v.split(",")),
    "chat_template": check_spec("chat_template"),
    "rollout": node_attribute("rollout", "backend"),
    "vllm_gpu_memory": check_vllm("gpu_memory_utilization"),
    "vllm_tensor_parallel": check_vllm("tensor_parallel_size"),
    "vllm_dtype": check_vllm("dtype"),
    "vllm_eager": check_vllm("enforce_eager"),
    "vllm_sleep": check_vllm("enable_sleep_mode"),
    "device": check_device,
    "train_ranks": check_train_ranks,
    "train_backend": update_attribute("train_backend"),
    "shard_reference": check_shard_reference,
    "shard_critic": check_shard_critic,
    "teacher": check_teacher,
    "distill_coef": update_attribute("distill_coef"),
    "distill_mode": update_attribute("distill_mode"),
    "distill_estimator": update_attribute("distill_estimator"),
    "reward_coef": update_attribute("reward_coef"),
    # PPO
    "critic_lr": update_attribute("critic_lr"),
    "gamma": node_attribute("gae", "gamma"),
    "lam": node_attribute("gae", "lam"),
    # a vision tower in front of a prefix-VLM
    "vision": check_vision,
    # GRPO
    "group_size": node_attribute("rollout", "n"),
    "estimator": node_attribute("group_advantage", "estimator"),
    "dynamic_sampling": check_dynamic_sampling,
    "overlong_buffer": overlong(0),
    "overlong_penalty": overlong(2),
    "kl_estimator": update_attribute("kl_estimator"),
    "aggregation": update_attribute("aggregation"),
    # agents
    "env": check_env,
    "max_turns": check_max_turns,
}
"""Option -> check(built graph, value): the value is where the graph's nodes use it."""


NOT_IN_NODES: dict[str, dict[str, str]] = {
    agent: {
        "reward": "refused: the environment scores each trajectory",
        "dynamic_sampling": "refused: the environment scores each trajectory whole",
        "val_data": "refused: an agent graph has no validation",
        **dict.fromkeys(
            (
                "val_every",
                "val_rows",
                "val_samples",
                "val_temperature",
                "val_top_p",
                "val_pass_threshold",
            ),
            "idle: an agent graph has no validation (idle_options says so)",
        ),  # fmt: skip
    }
    for agent in AGENTS
}
"""Graph -> option -> why no node of the graph holds it; each is checked where it is read
(:func:`test_what_no_node_holds_is_refused_or_listed_as_idle`)."""


# --- the tests --------------------------------------------------------------------------------


def test_every_ready_graph_with_a_config_is_checked_here():
    folder = Path(load_graph_module("graphs.toy").__file__).parent
    ready = [p.stem for p in folder.glob("*.py") if "\ndef build_graph(" in p.read_text()]
    typed = {g for g in ready if hasattr(load_graph_module(f"graphs.{g}"), "CONFIG")}
    assert "toy" in ready and typed == set(GRAPHS)


@pytest.mark.parametrize("graph", GRAPHS)
def test_every_option_has_a_check(graph, files):
    """Every option of the config has a check, or a reason why no node holds it, and some
    scenario gives it a value other than its default (a named flag, by that flag)."""
    config, cases = config_of(graph), scenarios(graph, files)
    names = [o.name for o in config_options(config)]
    exempt = NOT_IN_NODES.get(graph, {})
    assert set(exempt) <= set(names), f"{graph}: NOT_IN_NODES names what it does not take"
    missing = [n for n in names if n not in CHECKS and n not in exempt]
    assert not missing, (
        f"{graph}: options without a check of where they arrive: {missing}; add one to CHECKS "
        "in tests/graphs/test_option_wiring.py (or, where no node holds the option, to "
        "NOT_IN_NODES with the reason and a check where it is read)"
    )
    default = config()
    unset = [
        n
        for n in names
        if n not in exempt
        and not any(n in c.values and c.values[n] != getattr(default, n) for c in cases.values())
    ]
    assert not unset, f"{graph}: no scenario gives these a value other than the default: {unset}"
    by_flag = {k for c in cases.values() if c.flags for k in c.values} | {
        k for c in cases.values() for k in c.given
    }
    flags = set(run_flags()) & set(names)
    assert flags - by_flag - set(exempt) == set(), "every flag of an option is given in a scenario"


@pytest.mark.parametrize(
    ("graph", "case"),
    [
        (g, c)
        for g in GRAPHS
        for c in ("own", "shapes", "reward_model", "judge")
        if g not in AGENTS or c in ("own", "shapes")
    ],  # fmt: skip
)
def test_every_option_reaches_the_node_that_uses_it(graph, case, files):
    scenario = scenarios(graph, files)[case]
    b = build(graph, scenario)
    given = {k: b.options.get(k, "(not given)") for k in scenario.values}
    wrong = {k: v for k, v in given.items() if v != scenario.values[k]}
    assert not wrong, f"{graph} ({case}): the command line gave the graph {wrong}"
    failed = []
    for name, value in scenario.values.items():
        try:
            CHECKS[name](b, value)
        except Exception as exc:  # (a KeyError: a spec without the key, ...)
            failed.append(f"{name}={value!r}: {type(exc).__name__}: {exc}")
    assert not failed, f"{graph} ({case}): options that did not reach their nodes:\n" + "\n".join(
        failed
    )


@pytest.mark.parametrize("graph", AGENTS)
def test_what_no_node_holds_is_refused_or_listed_as_idle(graph, files):
    """Given a value a GRPO graph takes, what an agent graph refuses is one line naming the
    option; what it takes and no node reads, ``show --options`` lists as idle."""
    flags, grpo = run_flags(), scenarios("text_grpo", files)["own"].values
    idle = config_of(graph)().idle_options()
    for name, why in NOT_IN_NODES[graph].items():
        if why.startswith("refused"):
            scenario = Scenario({name: grpo[name]}, flags=name in flags)
            with pytest.raises(UsageError, match=rf"option {name}=.*left at its default"):
                build(graph, scenario)
        else:
            assert name in idle, f"{graph}: {name} is taken, used by no node, and not listed idle"
    # on_bad_sample skips bad rows of --data: without data it is idle, with data it is not
    assert "on_bad_sample" in idle
    assert "on_bad_sample" not in config_of(graph)(data=str(files.data)).idle_options()


def test_the_memory_plan_reads_the_step_options():
    """``show --memory`` plans one step of the options given: the prompts drawn (more with
    dynamic sampling), the responses, and the prompt and response lengths."""
    from graphs.advice import step_load

    values = {"batch_size": 3, "dynamic_sampling": 0.5, "group_size": 3, "max_prompt_tokens": 2,
              "max_new_tokens": 7}  # fmt: skip
    b = build("text_grpo", Scenario(values))
    step = step_load(config_of("text_grpo").from_options("text_grpo", b.options), b.graph)
    assert (step.prompts, step.responses) == (5, 15)
    assert (step.prompt_tokens, step.response_tokens) == (2, 7)
