"""How the ready graphs' options become nodes and specs: data, policy, vision, reward and the
update's options (the graph's front half built from them is :mod:`graphs.front`).

Defaults build tiny models from configs in code (nothing downloads), sized for the
synthetic shapes task; real models and data come from local paths:

* ``data``: a local JSONL, Parquet or CSV file or ``save_to_disk`` folder
  (:class:`nodes.datasets.DatasetSource`); default: the shapes task (:class:`nodes.data.ShapesSource`).
* ``policy``: ``"tiny"`` (a 2-layer GPT-2 prefix-VLM with the task's word vocabulary),
  ``"tiny-gpt2"``, ``"tiny-llama"``, ``"tiny-qwen2"`` (text causal LMs built in code), a
  local directory (a saved prefix-VLM, a Hugging Face causal LM such as GPT-2, Llama or Qwen2,
  or an image-text-to-text VLM such as Qwen2-VL: :func:`nodes.models.families.model_family`
  tells them apart), or a :func:`nodes.models.policy.build_policy` spec dict. A text causal
  LM in a graph with images reads them as prefix embeddings of the vision tower.
* ``vision``: ``"tiny"`` or ``"open_clip:NAME[:WEIGHTS]"`` (weights: a local file). Only a
  prefix-VLM policy uses it; an HF VLM reads the images with its own tower.
* ``reward``: the spellings of :func:`nodes.rewards.reward_from_option` (used by
  :mod:`graphs.front`): ``module:function`` (a rule ``fn(text, meta) -> float``; default
  :func:`nodes.data.answer_reward`), ``clip``, ``model:DIR`` (a sequence classifier) or
  ``judge:DIR`` (a generative judge).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from graphs.config import TINY_TEXT_LMS, VAL_OPTIONS, RLConfig, TextGRPOConfig
from nodes.advantage import GroupAdvantage
from nodes.data import ShapesSource, task_vocabulary
from nodes.vision import TINY_OPEN_CLIP_CFG
from yatt_graph import Handle, Node

__all__ = [
    "data_keys",
    "data_source",
    "group_advantage",
    "is_prefix_policy",
    "policy_spec",
    "resolve_device",
    "rollout_options",
    "sampling_options",
    "shard_beside",
    "teacher_spec",
    "train_group",
    "update_options",
    "vision_kwargs",
    "vllm_options",
]


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a CUDA device, else ``cpu``; ``cuda`` without one is
    a ValueError saying so (and what to pass instead)."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        built = "with" if torch.backends.cuda.is_built() else "without"
        raise ValueError(
            f"device=cuda, but torch {torch.__version__} (built {built} CUDA) sees no CUDA "
            "device on this machine; use --device cpu (or auto: CUDA where present)"
        )
    return device


def _model_options(config: RLConfig) -> dict[str, Any]:
    """The spec keys every copy of the policy is built with (same spec: same weights, names)."""
    options: dict[str, Any] = {}
    if config.dtype != "float32":
        options["dtype"] = config.dtype
    if config.gradient_checkpointing:
        options["gradient_checkpointing"] = True
    if config.lora_r:
        targets = config.lora_targets.strip()
        options["lora"] = {
            "r": config.lora_r,
            "alpha": config.lora_alpha,
            "dropout": 0.0,
            "target_modules": targets if targets == "all-linear" else targets.split(","),
        }
    return options


def policy_spec(config: RLConfig, image_dim: int | None) -> dict[str, Any]:
    """A JSON-able spec that every node holding the policy builds identically."""
    return _model_spec(config, config.policy, image_dim, _model_options(config))


def teacher_spec(config: RLConfig, image_dim: int | None) -> dict[str, Any]:
    """The teacher's spec (``config.teacher``, a folder), loaded as the policy's folder is,
    with the policy's dtype and chat template; nothing of training (LoRA, checkpointing)."""
    assert config.teacher is not None
    options = {"dtype": config.dtype} if config.dtype != "float32" else {}
    return _model_spec(config, config.teacher, image_dim, options, "teacher")


def _model_spec(
    config: RLConfig,
    policy: str | dict[str, Any],
    image_dim: int | None,
    options: dict[str, Any],
    option: str = "policy",
) -> dict[str, Any]:
    """The spec of model ``policy`` (the spellings of the option ``option``) with the spec
    keys ``options``."""
    seed = config.seed
    if isinstance(policy, dict):
        return policy
    if policy == "tiny":
        spec: dict[str, Any] = {"name": "tiny-prefix-vlm", "seed": seed, "words": task_vocabulary()}
        if image_dim is not None:
            spec["image_dim"] = image_dim
        return {**spec, **options}
    if policy in TINY_TEXT_LMS:
        if image_dim is not None:
            raise ValueError(
                f"{option} {policy!r} is a text-only LM; use it with text_ppo or text_grpo, or "
                "'tiny' (a prefix-VLM) with images"
            )
        spec = {"name": policy, "seed": seed, "words": task_vocabulary()}
        return {**spec, **options}
    path = Path(policy)
    if not path.is_dir():
        raise ValueError(
            f"{option} {policy!r} is neither 'tiny', one of {', '.join(TINY_TEXT_LMS)}, nor a "
            "local model directory; models load only from local paths (nothing is downloaded)"
        )
    from nodes.models.families import model_family

    family = model_family(path)
    spec = {"path": str(path), **options}
    if not config.chat_template:
        spec["chat_template"] = False
    if family == "causal-lm" and image_dim is not None:
        spec |= {"image_dim": image_dim, "seed": seed}  # a prefix-VLM around the user's LM
    if family == "vlm" and image_dim is None:
        raise ValueError(
            f"{option} {policy!r} is an image-text-to-text model; a text-only graph cannot give "
            "it images: use mm_ppo or mm_grpo"
        )
    return spec


def update_options(config: RLConfig) -> dict[str, Any]:
    """The update node's options the config sets, PPO's and GRPO's alike: the optimizer, its
    schedule, the loss's clip range and entropy bonus, the passes, and how a step is cut."""
    names = (
        "lr", "weight_decay", "max_grad_norm", "clip_eps", "clip_eps_high", "dual_clip", "policy_loss",
        "entropy_coef",
        "epochs", "mini_batches", "micro_batch_tokens", "pack_sequences", "mask_truncated", "tis_cap",
        "tis_level", "tis_mode", "mixed_precision",
        "lr_schedule",
        "lr_warmup_steps", "lr_decay_steps", "temperature", "seed", "weights_include", "weights_dtype",
        "distill_coef", "distill_mode", "distill_estimator", "reward_coef",
    )  # fmt: skip
    return {name: getattr(config, name) for name in names}


def group_advantage(
    config: TextGRPOConfig, scores: Handle, group_ids: Handle, response_mask: Handle
) -> Any:
    """GRPO's group advantages of ``scores`` by the config's estimator, with DAPO's overlong
    penalty: the node's outputs (``advantages``, ``stats``)."""
    return GroupAdvantage(
        config.estimator,
        name="group_advantage",
        overlong_buffer=config.overlong_buffer,
        max_new_tokens=config.max_new_tokens,
        overlong_penalty=config.overlong_penalty,
    )(scores=scores, group_ids=group_ids, response_mask=response_mask)


def train_group(config: RLConfig, share: str, **more_shares: str) -> dict[str, Any]:
    """The update node's rank-group options (``ranks``, ``train_backend``) and share keys.

    One rank shares its models with the rollout (and critic) on an on-policy executor. A
    group shards its own copies, so it shares none."""
    shares = {"share": share, **more_shares}
    if config.train_ranks > 1:
        shares = dict.fromkeys(shares)
    return {"ranks": config.train_ranks, "train_backend": config.train_backend, **shares}


def shard_beside(reference: Any, config: RLConfig, update: str) -> None:
    """With ``shard_reference`` (and ``train_ranks`` > 1): the reference (a node, or None for
    a graph without one) joins the rank group of the node named ``update``, its own copy
    sharded over those ranks (hsdp where the update's is, else fsdp)."""
    if reference is None or not config.shard_reference or config.train_ranks < 2:
        return
    backend = "hsdp" if config.train_backend == "hsdp" else "fsdp"
    reference.configure(ranks=config.train_ranks, rank_with=update, train_backend=backend)


def is_prefix_policy(spec: dict[str, Any]) -> bool:
    """Whether the policy reads image embeddings from a separate vision encoder."""
    if spec.get("name") == "tiny-prefix-vlm":
        return True
    if "path" not in spec:
        return False
    return (Path(spec["path"]) / "prefix_vlm.json").is_file() or "image_dim" in spec


def vision_kwargs(vision: str, seed: int) -> dict[str, Any]:
    if vision == "tiny":
        return {"model_name": "ViT-S-32", "model_cfg": TINY_OPEN_CLIP_CFG, "seed": seed}
    kind, _, rest = vision.partition(":")
    if kind != "open_clip" or not rest:
        raise ValueError(f"vision {vision!r}: use 'tiny' or 'open_clip:NAME[:WEIGHTS_FILE]'")
    name, _, weights = rest.partition(":")
    return {"model_name": name, "pretrained": weights or None, "seed": seed}


def data_source(config: RLConfig, *, text_only: bool) -> Node:
    """The training data: ``config.data`` read by :class:`nodes.datasets.DatasetSource`, or
    the shapes task, with the ``rows`` output (each prompt's file and row)."""
    if config.data is None:
        return ShapesSource(
            batch_size=config.prompts_drawn,
            task=config.task,
            seed=config.seed,
            text_hint=text_only,
            emit_rows=True,
            name="data",
        )
    from nodes.datasets import DatasetSource

    return DatasetSource(
        config.data,
        batch_size=config.prompts_drawn,
        seed=config.seed,
        images=not text_only,
        on_bad_sample=config.on_bad_sample,
        emit_stats=True,
        emit_rows=True,
        name="data",
        **data_keys(config),
    )


def vllm_options(config: RLConfig) -> dict[str, Any]:
    """The vLLM engine's options the config sets (``Rollout(vllm_options=...)``)."""
    return {
        "gpu_memory_utilization": config.vllm_gpu_memory,
        "tensor_parallel_size": config.vllm_tensor_parallel,
        "dtype": config.vllm_dtype,
        "enforce_eager": config.vllm_eager,
        "enable_sleep_mode": config.vllm_sleep,
    }


def sampling_options(config: RLConfig, *, validation: bool = False) -> dict[str, Any]:
    """How the config samples responses, as a node's options: the rollout's temperature, top-p
    and top-k, or with ``validation`` the validation's options (:data:`graphs.config.VAL_OPTIONS`
    less their ``val_`` prefix); the lengths, the stop strings and the seed."""
    if validation:
        own = {name.removeprefix("val_"): getattr(config, name) for name in VAL_OPTIONS}
    else:
        own = {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k}
    return {
        **own,
        "max_new_tokens": config.max_new_tokens,
        "max_prompt_tokens": config.max_prompt_tokens,
        "stop": config.stop,
        "seed": config.seed,
    }


def rollout_options(config: RLConfig) -> dict[str, Any]:
    """A rollout's options the config sets, :class:`nodes.rollout.Rollout`'s and
    :class:`nodes.agents.AgentRollout`'s alike: how it samples (:func:`sampling_options`), its
    backend (with the vLLM engine's options), the logprob recompute, streaming, precision."""
    return {
        **sampling_options(config),
        "backend": config.rollout,
        "recompute_logprobs": config.recompute_logprobs,
        "stream": config.stream,
        "vllm_options": vllm_options(config) if config.rollout == "vllm" else None,
        "precision": config.mixed_precision,
    }


def data_keys(config: RLConfig) -> dict[str, str]:
    """The columns of a user's data that hold the prompt, the image and the answer."""
    return {
        "prompt_key": config.prompt_key,
        "image_key": config.image_key,
        "answer_key": config.answer_key,
    }
