"""The typed options of the ready graphs: one msgspec Struct per graph, shared fields in a base.

``RLConfig`` holds what every ready graph takes (data, models, reward, optimizer, sampling);
``PPOConfig`` adds the critic and GAE (``text_ppo``); ``MultimodalPPOConfig`` adds the vision
tower (``mm_ppo``); ``TextGRPOConfig`` adds the groups (``text_grpo``) and ``GRPOConfig`` the
vision tower too (``mm_grpo``).

Each graph module names its config as ``CONFIG``, and its ``build_graph(**options)`` builds
it with :meth:`RLConfig.from_options`: an unknown option or a value of the wrong type is a
TypeError, a value out of range a ValueError, each naming the option, the value and what is
allowed. ``yatt-graph ... --set key=value`` parses text by these fields' types, and
``yatt-graph show GRAPH --options`` lists them with their defaults and the first line of the
docstring under each.

The defaults are the ones the learning tests and the README's figures were measured with.
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal, Self

import msgspec

from nodes.data import TASKS
from nodes.models.sampling import MIN_TEMPERATURE, temperature_problem
from nodes.rl.advantages import GROUP_ESTIMATORS
from yatt_graph.options import check_options, config_options

__all__ = ["GRPOConfig", "MultimodalPPOConfig", "PPOConfig", "RLConfig", "TextGRPOConfig"]


Estimator = GROUP_ESTIMATORS.literal()
"""The names of :data:`nodes.rl.advantages.GROUP_ESTIMATORS` (an ``estimator`` option)."""


class RLConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The options every ready graph takes."""

    batch_size: int = 32
    """Prompts per step (>= 1); the README's figures for the PPO graphs were measured at 32."""
    task: str = "color"
    """The shapes question: color, shape or count; color is the one the figures are for."""
    seed: int = 0
    """Seed (>= 0) of the data, the models' weights and the sampling; runs with one seed repeat."""
    policy: str | dict[str, Any] = "tiny"
    """'tiny' (a 2-layer prefix-VLM built in code), a local model directory, or a policy spec.

    A directory holds a saved prefix-VLM or a Hugging Face image-text-to-text checkpoint;
    nothing is downloaded. A spec is a :func:`nodes.models.policy.build_policy` dict."""
    reward: str = "nodes.data:answer_reward"
    """A rule reward fn(text, meta) -> float, as module:function or path/to/file.py:function."""
    on_bad_sample: Literal["raise", "skip"] = "raise"
    """A NaN/inf/non-number score: raise (stop the run, naming the sample) or skip (score 0).

    With skip the graph also outputs ``bad_samples`` and the metrics count them; raise is
    the default because a reward that breaks should be seen, not averaged away."""
    lr: float = 1e-3
    """The policy's Adam learning rate (> 0); the figures were measured at 1e-3."""
    max_new_tokens: int = 2
    """Longest response in tokens (>= 1); the shapes answers are one word and an end token."""
    max_prompt_tokens: int | None = None
    """A longer prompt keeps its last this many tokens (>= 1); none: a prompt that leaves no
    room for max_new_tokens in the model's context stops the run, naming it."""
    temperature: float = 1.0
    """Sampling temperature (> 0), also used for the logprobs of the update and the reference."""
    kl_coef: float = 0.05
    """Weight (>= 0) of the KL penalty to the reference policy; 0 turns it off.

    With 0.05 the ready graphs ended higher and closer together across seeds than without
    the penalty (README)."""
    entropy_coef: float = 0.01
    """Weight (>= 0) of the entropy bonus in the policy loss; the figures were measured at 0.01."""
    epochs: int = 2
    """Optimizer passes over each step's batch (>= 1); the figures were measured at 2."""
    stream: bool = False
    """Hand out each response as it ends, so later nodes take them piece by piece.

    Off by default: with the tiny CPU models it costs more than it overlaps
    (docs/PERFORMANCE.md, "Streaming between controllers")."""
    data: str | None = None
    """A local dataset: a JSONL, Parquet or CSV file, or a ``save_to_disk`` folder; none: shapes.

    Columns ``prompt``, ``image`` (a path relative to the file, or bytes) and ``answer``
    (see prompt_key, image_key, answer_key); the reward's ``meta`` holds every other column.
    Rows are shuffled with the seed, epoch after epoch, and the position is checkpointed."""
    val_data: str | None = None
    """A local validation dataset (the forms of ``data``), scored greedily every val_every steps.

    Its metrics are ``val/reward`` and ``val/samples``; the training data is not touched."""
    val_every: int = 10
    """Steps between two validation passes (>= 1), counted from step 0."""
    val_rows: int = 64
    """Rows of val_data each validation pass scores (>= 1; the first ones, in file order)."""
    prompt_key: str = "prompt"
    """The data column holding the prompt text."""
    image_key: str = "image"
    """The data column holding the image: a path relative to the data file, bytes, or a list."""
    answer_key: str = "answer"
    """The data column the reward reads as ``meta['answer']``."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights' dtype of the policy's copies (a local model's, or the tiny one's). Not float16:
    the policy is trained in it, and AdamW on float16 weights overflows without a loss scaler."""
    gradient_checkpointing: bool = False
    """Recompute activations in the update's backward pass (less memory, more time)."""
    lora_r: int = 0
    """LoRA rank (peft) of the trained policy; 0 trains every weight."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (> 0); the adapter's update is scaled by lora_alpha / lora_r."""
    lora_targets: str = "all-linear"
    """peft target_modules: 'all-linear' or comma-separated module names (c_attn,q_proj,...)."""
    chat_template: bool = True
    """Format prompts with the tokenizer's or processor's chat template when it has one."""
    rollout: Literal["hf", "vllm"] = "hf"
    """The rollout backend: hf (transformers generate, any device) or vllm (CUDA, vllm extra)."""
    vllm_gpu_memory: float = 0.5
    """With rollout=vllm: the share of GPU memory the engine may take, in (0, 1]."""
    vllm_tensor_parallel: int = 1
    """With rollout=vllm: GPUs the engine shards the model across (>= 1)."""
    vllm_sleep: bool = False
    """With rollout=vllm: free the engine's memory between rollouts (colocated training)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model nodes run: auto (CUDA when present, else the CPU), cpu or cuda."""
    train_ranks: int = 1
    """Processes that train the update together (>= 1): one SPMD group, one node to the graph.

    The update node starts train_ranks - 1 rank processes beside its own and splits each
    batch among them by token count; the result equals one rank's up to float rounding
    (runtime/ranks/). On CUDA each rank takes its own GPU."""
    train_backend: Literal["fsdp", "ddp"] = "fsdp"
    """With train_ranks > 1: fsdp (FSDP2: weights, gradients, Adam state 1/K per rank) or ddp."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            _refuse("task", self.task, f"one of {', '.join(TASKS)}")
        _at_least("batch_size", self.batch_size, 1)
        _at_least("seed", self.seed, 0)
        _at_least("max_new_tokens", self.max_new_tokens, 1)
        if self.max_prompt_tokens is not None:
            _at_least("max_prompt_tokens", self.max_prompt_tokens, 1)
        _at_least("epochs", self.epochs, 1)
        _positive("lr", self.lr)
        if temperature_problem(self.temperature, greedy=False):
            _refuse("temperature", self.temperature, f"a finite number >= {MIN_TEMPERATURE}")
        _at_least("kl_coef", self.kl_coef, 0.0)
        _at_least("entropy_coef", self.entropy_coef, 0.0)
        if self.on_bad_sample not in ("raise", "skip"):
            _refuse("on_bad_sample", self.on_bad_sample, "'raise' or 'skip'")
        _at_least("val_every", self.val_every, 1)
        _at_least("val_rows", self.val_rows, 1)
        _at_least("lora_r", self.lora_r, 0)
        _at_least("vllm_tensor_parallel", self.vllm_tensor_parallel, 1)
        _within("vllm_gpu_memory", self.vllm_gpu_memory, 1e-6, 1.0)
        _positive("lora_alpha", self.lora_alpha)
        for name in ("data", "val_data"):
            value = getattr(self, name)
            if value is not None and not os.path.exists(value):
                _refuse(name, value, "an existing local file or folder (nothing is downloaded)")
        if self.dtype not in ("float32", "bfloat16"):
            _refuse("dtype", self.dtype, "float32 or bfloat16")
        if self.rollout not in ("hf", "vllm"):
            _refuse("rollout", self.rollout, "'hf' or 'vllm'")
        if self.device not in ("auto", "cpu", "cuda"):
            _refuse("device", self.device, "auto, cpu or cuda")
        _at_least("train_ranks", self.train_ranks, 1)
        if self.train_backend not in ("fsdp", "ddp"):
            _refuse("train_backend", self.train_backend, "'fsdp' or 'ddp'")

    @classmethod
    def from_options(cls, graph: str, options: dict[str, Any]) -> Self:
        """The config of ``graph`` from ``build_graph``'s keyword options, checked."""
        values = check_options(options, config_options(cls), False, graph)
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"{graph}: {exc}") from None


class PPOConfig(RLConfig, kw_only=True, forbid_unknown_fields=True):
    """PPO: a critic trained beside the policy, advantages by GAE."""

    critic_lr: float = 1e-3
    """The critic's Adam learning rate (> 0); as the policy's."""
    gamma: float = 1.0
    """GAE discount per token, in [0, 1]; 1 because the only reward comes at the end."""
    lam: float = 0.95
    """GAE lambda, in [0, 1]: 0 trusts the critic's next value, 1 the whole return."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("critic_lr", self.critic_lr)
        _within("gamma", self.gamma, 0.0, 1.0)
        _within("lam", self.lam, 0.0, 1.0)


class MultimodalPPOConfig(PPOConfig, kw_only=True, forbid_unknown_fields=True):
    """PPO with images: a vision tower in front of a prefix-VLM policy."""

    vision: str = "tiny"
    """'tiny' or open_clip:NAME[:WEIGHTS_FILE]; only a prefix-VLM policy reads it."""


class TextGRPOConfig(RLConfig, kw_only=True, forbid_unknown_fields=True):
    """GRPO: several samples per prompt, advantages within each group, no critic."""

    batch_size: int = 16
    """Prompts per step (>= 1); 16 prompts of 4 samples (64 responses), as in the figures."""
    group_size: int = 4
    """Samples per prompt (>= 2: a group's advantages compare its samples with each other)."""
    estimator: Estimator = "grpo"
    """A registered group estimator: grpo (group mean and std), dr_grpo (group mean), rloo."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least("group_size", self.group_size, 2)
        if self.estimator not in GROUP_ESTIMATORS:
            _refuse("estimator", self.estimator, f"one of {', '.join(GROUP_ESTIMATORS)}")


class GRPOConfig(TextGRPOConfig, kw_only=True, forbid_unknown_fields=True):
    """GRPO with images: a vision tower in front of a prefix-VLM policy."""

    vision: str = "tiny"
    """'tiny' or open_clip:NAME[:WEIGHTS_FILE]; only a prefix-VLM policy reads it."""


def _refuse(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"option {name}={value!r}: must be {allowed}")


def _at_least(name: str, value: float, low: float) -> None:
    if not (value >= low and math.isfinite(value)):  # also refuses NaN
        _refuse(name, value, f">= {low}" if isinstance(value, int) else f"a finite number >= {low}")


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        _refuse(name, value, "a finite number > 0")


def _within(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        _refuse(name, value, f"in [{low}, {high}]")
