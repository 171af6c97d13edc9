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

Options whose right value depends on the model default to None, resolved when the config is
made (:data:`AUTO`): the shapes task's measured values with a tiny policy (built in code, or
one saved from it), values a real model can live with when ``policy`` names a model of the
user's (``yatt-graph show GRAPH --options`` says both; a run prints what it chose). The tiny policy's are the ones the learning tests and
the README's figures were measured with.
"""

from __future__ import annotations

import math
import os
import typing
from typing import Any, Literal, Self

import msgspec

from nodes.data import TASKS
from nodes.models.families import has_chat_template, is_tiny_dir, model_positions
from nodes.models.precision import PRECISIONS, native_bf16
from nodes.models.sampling import MIN_TEMPERATURE, temperature_problem
from nodes.rl.advantages import GROUP_ESTIMATORS, KLEstimator
from nodes.rl.aggregate import Aggregation
from nodes.rl.losses import POLICY_LOSSES
from nodes.update.schedule import LR_SCHEDULES
from yatt_graph.options import build_config, check_options, config_options

__all__ = [
    "VAL_OPTIONS",
    "GRPOConfig",
    "MultimodalPPOConfig",
    "PPOConfig",
    "RLConfig",
    "TextGRPOConfig",
    "at_least",
    "check_choices",
    "positive",
    "refuse",
    "within",
]


Estimator = GROUP_ESTIMATORS.literal()
"""The names of :data:`nodes.rl.advantages.GROUP_ESTIMATORS` (an ``estimator`` option)."""
PolicyLoss = POLICY_LOSSES.literal()
"""The names of :data:`nodes.rl.losses.POLICY_LOSSES` (the ``policy_loss`` option)."""
Schedule = Literal[LR_SCHEDULES]  # type: ignore[valid-type]
Precision = Literal[PRECISIONS]  # type: ignore[valid-type]


VAL_SAMPLING = ("val_temperature", "val_top_p", "val_pass_threshold")
"""The options of the sampled validation responses (with ``val_samples`` > 1)."""
VAL_OPTIONS = ("val_every", "val_rows", "val_samples", *VAL_SAMPLING)
"""The options of validation besides ``val_data`` (idle without it)."""


CPU_BUDGET = 1024
"""A model's default ``micro_batch_tokens`` on the CPU: of the budgets measured on SmolLM2-135M
(none, 1024, 2048) the one with the smallest peak, at the same step time within the runs'
noise (docs/PERFORMANCE.md, "A real pretrained model against TRL's GRPOTrainer")."""


def _model_device(config: RLConfig) -> str:
    """Where ``config``'s model nodes run: ``cuda`` or ``cpu`` (``device=auto`` resolved)."""
    if config.device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return config.device


def _model_precision(config: RLConfig) -> str:
    """bf16 autocast where the model nodes' device does bf16 math in hardware, else float32."""
    return "bf16" if native_bf16(_model_device(config)) else "no"


def _model_budget(config: RLConfig) -> int:
    """:data:`CPU_BUDGET` on the CPU; on CUDA the whole batch at once (0)."""
    return CPU_BUDGET if _model_device(config) == "cpu" else 0


AUTO: dict[str, tuple[Any, Any]] = {
    "lr": (1e-3, 1e-6),
    "max_new_tokens": (2, 256),
    "epochs": (2, 1),
    "entropy_coef": (0.01, 0.0),
    "kl_coef": (0.05, 0.001),
    "critic_lr": (1e-3, 1e-5),
    "mixed_precision": ("no", _model_precision),
    "micro_batch_tokens": (0, _model_budget),
}
"""Option -> (its default with a tiny policy, with a model of the user's), for options left
None; a function of the config stands for a model's default that depends on its device."""


TINY_TEXT_LMS = ("tiny-gpt2", "tiny-llama", "tiny-qwen2")
"""The tiny text causal LMs a ready graph builds in code by name (``--policy tiny-qwen2``)."""


def users_model(policy: str | dict[str, Any]) -> bool:
    """Whether ``policy`` names a model of the user's: a directory that is not one of this
    project's tiny models (built in code, or saved and exported from a run of one)."""
    tiny = policy in ("tiny", "tiny-qwen2-vl", *TINY_TEXT_LMS)
    path = policy.get("path") if isinstance(policy, dict) else None if tiny else policy
    return path is not None and not is_tiny_dir(path)


def _folder(policy: str | dict[str, Any]) -> str | None:
    """The folder a policy option names (the string, or a spec's ``path``), if it is text."""
    path = policy.get("path") if isinstance(policy, dict) else policy
    return path if isinstance(path, str) else None


def _positions(policy: str | dict[str, Any]) -> int | None:
    """The context of a policy given as a folder (:func:`model_positions`), else None."""
    path = _folder(policy)
    return model_positions(path) if path is not None else None


def _templated(policy: str | dict[str, Any]) -> bool:
    """Whether a policy given as a folder has a chat template (:func:`has_chat_template`)."""
    path = _folder(policy)
    return path is not None and has_chat_template(path)


def fitted_new_tokens(policy: str | dict[str, Any], default: int) -> tuple[int, str]:
    """``max_new_tokens`` for a model of the user's when left to its default: the default
    where it leaves at least as many positions for the prompt, else half the model's context,
    with the note the run prints (empty where nothing was fitted)."""
    positions = _positions(policy)
    if positions is None or 2 * default <= positions:
        return default, ""
    fitted = max(1, positions // 2)
    return fitted, (
        f"max_new_tokens={fitted}: the model takes {positions} positions, too few for the "
        f"default {default} beside a prompt, so half of them go to the response "
        "(--set max_new_tokens=N to choose)"
    )


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
    lr: float | None = None
    """The policy's AdamW learning rate (> 0); none: 1e-3 with the tiny policy, 1e-6 with a model.

    1e-3 is what the tiny policy's figures were measured at; a pretrained model takes the
    small rates TRL and verl use (1e-6)."""
    max_new_tokens: int | None = None
    """Longest response in tokens (>= 1); none: 2 with the tiny policy, 256 with a model.

    The shapes answers are one word and an end token; a response also ends at the tokenizer's
    end token and at ``stop``."""
    max_prompt_tokens: int | None = None
    """A longer prompt keeps its last this many tokens (>= 1); none: a prompt that leaves no
    room for max_new_tokens in the model's context stops the run, naming it."""
    temperature: float = 1.0
    """Sampling temperature (> 0), also used for the logprobs of the update and the reference."""
    kl_coef: float | None = None
    """Weight (>= 0) of the KL penalty to the reference policy; none: 0.05 tiny, 0.001 a model.

    With 0.05 the ready graphs ended higher and closer together across seeds than without
    the penalty (README); 0 turns it off."""
    entropy_coef: float | None = None
    """Weight (>= 0) of the entropy bonus in the policy loss; none: 0.01 tiny, 0 with a model."""
    epochs: int | None = None
    """Optimizer passes over each step's batch (>= 1); none: 2 with the tiny policy, 1 a model."""
    mini_batches: int = 1
    """Optimizer steps per pass (>= 1), each on that share of the batch (whole prompts)."""
    micro_batch_tokens: int | None = None
    """Padded tokens of one forward (0: all at once); none: 1024 with a model on the CPU, else 0.

    It bounds the update's, reference's, critic's, reward model's and judge's forwards; 0 takes
    the whole batch at once (a reward model or judge: its rows). Rows are sorted by length
    and the update accumulates gradients, so the step is the unsplit one up to float rounding,
    and memory stays bounded whatever the batch size."""
    pack_sequences: bool = False
    """Pack each micro-batch's rows into one sequence without padding for the update's forward.

    For a text causal LM policy (--policy DIR, tiny-qwen2, ...; the default tiny policy is a
    prefix-VLM): position ids restart at each row, and the step is the padded one up to
    float rounding."""
    mask_truncated: bool = False
    """Leave responses cut at max_new_tokens out of the loss (DAPO's overlong filtering).

    Either way the update's metrics report the share cut (``truncated``) and the mean length
    of the responses that ended (``ended_length``)."""
    recompute_logprobs: bool | None = None
    """Recompute the rollout's logprobs teacher-forced, as the update computes them; none: on
    with rollout=vllm, dtype=bfloat16 or tis_cap > 0 (unless stream), off otherwise.

    Then the update reports the gap to the sampler's own (``logprob_gap_mean``, ``_max``)."""
    tis_cap: float | None = None
    """Truncated importance sampling: weigh each token's loss by min(pi_trainer / pi_sampler,
    tis_cap) (>= 0; 0: off); none: 2 with rollout=vllm, 0 otherwise."""
    tis_level: Literal["token", "sequence"] = "token"
    """With tis_cap > 0: token (each token's ratio) or sequence (one ratio per response).

    The sequence ratio is the geometric mean of the response's token ratios,
    exp(mean_t log pi_trainer / pi_sampler), on all its tokens: a product over a long response
    would drift exponentially with its length and sit at the cap."""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """With tis_cap > 0: truncate (min(ratio, tis_cap)) or mask (masked importance sampling:
    weight 0 outside [1/tis_cap, tis_cap], so that token or response leaves the loss)."""
    weights_include: list[str] = []
    """Regular expressions: the update sends the rollout only the weights whose names match one
    (a partial update: --set 'weights_include=["lora_"]' sends LoRA adapters); empty: all."""
    weights_dtype: str | None = None
    """The dtype the update sends the weights in (a floating torch dtype: bfloat16, float16);
    none: as they train."""
    mixed_precision: Precision | None = None
    """bf16: the model nodes compute in bf16 autocast; none: bf16 with a model on bf16 hardware.

    The update trains, the rollout samples and the reference and critic score under it; the
    weights and the AdamW state stay float32. bf16 hardware is a CUDA GPU with bf16 or a CPU
    with AVX512-BF16 or AMX (elsewhere bf16 is emulated and no faster); on such a CPU bf16 made
    SmolLM2-135M's step 1.6-1.8x faster (docs/PERFORMANCE.md)."""
    weight_decay: float = 0.0
    """AdamW weight decay (>= 0) of the trained models."""
    max_grad_norm: float = 1.0
    """Clip the gradient norm to this (> 0); 0: no clipping."""
    clip_eps: float = 0.2
    """PPO ratio clip range below (and, without clip_eps_high, above) 1, in (0, 1)."""
    clip_eps_high: float | None = None
    """Clip range above 1 when it differs (DAPO's clip-higher, e.g. 0.28); none: clip_eps."""
    dual_clip: float | None = None
    """Dual-clip PPO: a token with a negative advantage loses at most -A * dual_clip (> 1, e.g. 3)."""
    policy_loss: PolicyLoss = "ppo"
    """The policy loss: ppo (each token's ratio clipped) or gspo (GSPO: each response's ratio).

    gspo clips the sequence ratio exp(mean over the response's tokens of log pi - log pi_old),
    which moves far less than a token's: take GSPO's clip range, --set clip_eps=3e-4
    clip_eps_high=4e-4 (the paper's). With one pass over each batch (epochs=1,
    mini_batches=1) the ratio is 1 (up to the sampler's rounding) and both take the same step."""
    lr_schedule: Schedule = "constant"
    """After the warmup: constant, or linear / cosine decay to 0 over lr_decay_steps steps."""
    lr_warmup_steps: int = 0
    """Steps of linear warmup from lr / lr_warmup_steps to lr (>= 0)."""
    lr_decay_steps: int = 0
    """Steps of linear or cosine decay after the warmup (> 0 for those schedules)."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens with this much probability."""
    top_k: int = 0
    """Sample from the k likeliest tokens (>= 0); 0: all."""
    stop: list[str] = []
    """Strings that end a response (kept in it), as a JSON list: --set 'stop=["</answer>"]'."""
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
    val_samples: int = 1
    """k, sampled responses per validation row (>= 1); 1: the greedy response alone (val/reward).

    With k > 1 each row also gets k samples at val_temperature and val_top_p, and the metrics
    are val/greedy (the greedy responses' mean reward), val/avg@k (the samples' mean reward)
    and val/pass@k (the share of rows with a sample whose reward is >= val_pass_threshold:
    Chen et al.'s unbiased estimator with n = k). Every pass draws from the same seed."""
    val_temperature: float = 1.0
    """Sampling temperature of the val_samples responses (0: greedy, else >= 0.01)."""
    val_top_p: float = 1.0
    """Nucleus sampling of the val_samples responses, in (0, 1]."""
    val_pass_threshold: float = 1.0
    """A sampled validation response passes (val/pass@k) when its reward is at least this.

    1 is the default reward's right answer (it gives 1 for the answer, 0.2 for another choice
    of the right kind, 0 otherwise); set it to what a right answer scores under your reward."""
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
    vllm_gpu_memory: float | None = None
    """With rollout=vllm: the engine's share of GPU memory, in (0, 1]; none: derived at start.

    At most 0.9 and what the GPU has free when the engine starts, less 0.1 for the trainer
    beside it when it sleeps (nodes/models/vllm_options.py, gpu_share)."""
    vllm_tensor_parallel: int = 1
    """With rollout=vllm: GPUs the engine shards the model across (>= 1)."""
    vllm_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """With rollout=vllm: the engine's precision; auto: bfloat16 (float16 for a float16 policy),
    which FlashAttention and CUDA graphs need (the trainer recomputes the logprobs)."""
    vllm_eager: bool = False
    """With rollout=vllm: run without CUDA graphs (slower; for debugging)."""
    vllm_sleep: bool | None = None
    """With rollout=vllm: free the engine's GPU memory between rollouts, for the trainer on
    the same GPU (level 2: the weights are dropped, the next update sends them); none: on,
    unless the run says --offload off."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model nodes run: auto (CUDA when present, else the CPU), cpu or cuda."""
    train_ranks: int = 1
    """Processes that train the update together (>= 1): one SPMD group, one node to the graph.

    The update node starts train_ranks - 1 rank processes beside its own and splits each
    batch among them by token count; the result equals one rank's up to float rounding
    (runtime/ranks/). On CUDA each rank takes its own GPU."""
    train_backend: Literal["fsdp", "hsdp", "ddp"] = "fsdp"
    """With train_ranks > 1: fsdp (FSDP2: weights, gradients, Adam state 1/K per rank), hsdp
    (FSDP2 within each host, the hosts holding replicas: 1/M per rank with --ranks-per-host M,
    and only the gradient reduction crosses hosts) or ddp."""
    shard_reference: bool = False
    """With train_ranks > 1: shard the reference over the update's ranks (FSDP2 forward
    without an optimizer; within each host under hsdp), so no device holds a whole frozen
    copy; each rank scores a share of the batch, and the reference runs on the update's
    controller. Its logprobs equal the unsharded reference's up to float rounding."""
    teacher: str | None = None
    """A local model folder whose logprobs of the sampled responses teach the policy
    (on-policy distillation, with distill_coef > 0); none: no teacher.

    A causal LM, an image-text-to-text VLM or a saved prefix-VLM (what --export writes); its
    tokenizer must be the policy's (the same vocabulary and ids), since it scores the
    policy's token ids. It scores as the reference does (micro_batch_tokens, precision)."""
    distill_coef: float = 0.0
    """Weight (>= 0) of the reverse KL to the teacher, log pi - log pi_teacher per sampled
    token (needs teacher); 0: off. Each step reports its mean as distill/kl.

    With reward_coef=0 the policy learns from the teacher alone (pure on-policy distillation);
    otherwise the teacher's signal joins the reward's."""
    distill_mode: Literal["loss", "advantage"] = "loss"
    """How distill_coef acts: loss (distill_coef * the mean reverse KL joins the update's loss,
    its gradient through the policy's logprobs) or advantage (-distill_coef * (log pi_old -
    log pi_teacher) is added to each token's advantage, as Tinker, verl and slime do)."""
    distill_estimator: KLEstimator = "k2"
    """The loss mode's per-token estimator of the reverse KL: k1, k2, k3 or abs.

    k2 (0.5 * (log pi - log pi_teacher)^2) by default: on the policy's own samples its
    gradient is the reverse KL's; k1's gradient is 0 in expectation."""
    reward_coef: float = 1.0
    """Weight (>= 0) of the reward's advantages in the policy loss; 0 with distill_coef > 0:
    pure on-policy distillation (the reward is still computed and reported)."""

    def __post_init__(self) -> None:
        self._resolve()
        check_choices(self)
        if self.task not in TASKS:
            refuse("task", self.task, f"one of {', '.join(TASKS)}")
        at_least("batch_size", self.batch_size, 1)
        at_least("seed", self.seed, 0)
        at_least("max_new_tokens", self.max_new_tokens, 1)
        positions = _positions(self.policy)
        if positions is not None and self.max_new_tokens >= positions:
            refuse(
                "max_new_tokens",
                self.max_new_tokens,
                f"below the model's context, {positions} positions, which the prompt shares",
            )
        if self.max_prompt_tokens is not None:
            at_least("max_prompt_tokens", self.max_prompt_tokens, 1)
        at_least("epochs", self.epochs, 1)
        positive("lr", self.lr)
        if temperature_problem(self.temperature, greedy=False):
            refuse("temperature", self.temperature, f"a finite number >= {MIN_TEMPERATURE}")
        at_least("kl_coef", self.kl_coef, 0.0)
        at_least("entropy_coef", self.entropy_coef, 0.0)
        at_least("val_every", self.val_every, 1)
        at_least("val_rows", self.val_rows, 1)
        at_least("val_samples", self.val_samples, 1)
        if temperature_problem(self.val_temperature):
            refuse(
                "val_temperature",
                self.val_temperature,
                f"0 or a finite number >= {MIN_TEMPERATURE}",
            )
        if not 0 < self.val_top_p <= 1:
            refuse("val_top_p", self.val_top_p, "in (0, 1]")
        if not math.isfinite(self.val_pass_threshold):
            refuse("val_pass_threshold", self.val_pass_threshold, "a finite reward")
        at_least("lora_r", self.lora_r, 0)
        at_least("vllm_tensor_parallel", self.vllm_tensor_parallel, 1)
        if self.vllm_gpu_memory is not None:
            within("vllm_gpu_memory", self.vllm_gpu_memory, 1e-6, 1.0)
        positive("lora_alpha", self.lora_alpha)
        for name in ("data", "val_data"):
            value = getattr(self, name)
            if value is not None and not os.path.exists(value):
                refuse(name, value, "an existing local file or folder (nothing is downloaded)")
        at_least("train_ranks", self.train_ranks, 1)
        self._check_distillation()
        self._resolve_logprobs()
        if self.vllm_sleep is None:
            self.vllm_sleep = self.rollout == "vllm"

    def _check_distillation(self) -> None:
        """The teacher and its weights: a folder where a weight reads it, and something to learn."""
        at_least("distill_coef", self.distill_coef, 0.0)
        at_least("reward_coef", self.reward_coef, 0.0)
        if self.teacher is not None and not os.path.isdir(self.teacher):
            refuse(
                "teacher", self.teacher, "an existing local model folder (nothing is downloaded)"
            )
        if self.distill_coef > 0 and self.teacher is None:
            raise ValueError(
                f"option distill_coef={self.distill_coef!r} needs a teacher: pass --teacher DIR "
                "(a local model folder with the policy's tokenizer), or set distill_coef=0"
            )
        if self.teacher is not None and self.distill_coef == 0:
            raise ValueError(
                f"option teacher={self.teacher!r} is read only with distill_coef > 0; pass "
                "--set distill_coef=1 (or leave --teacher out)"
            )
        if self.reward_coef == 0 and self.distill_coef == 0:
            raise ValueError(
                "option reward_coef=0 leaves nothing to learn from without a teacher; pass "
                "--teacher DIR --set distill_coef=1 (pure on-policy distillation), or set "
                "reward_coef > 0"
            )

    def _resolve_logprobs(self) -> None:
        """Choose recompute_logprobs and tis_cap where left None (see their docs)."""
        if self.tis_cap is None:
            self.tis_cap = 2.0 if self.rollout == "vllm" else 0.0
        if not (self.tis_cap >= 0 and math.isfinite(self.tis_cap)):
            refuse("tis_cap", self.tis_cap, "a finite number >= 0 (0: off)")
        if self.tis_mode == "mask" and 0 < self.tis_cap <= 1:
            refuse(
                "tis_cap", self.tis_cap, "> 1 with tis_mode=mask (it keeps [1/tis_cap, tis_cap])"
            )
        if self.recompute_logprobs is None:
            differ = self.rollout == "vllm" or self.dtype != "float32" or self.tis_cap > 0
            self.recompute_logprobs = differ and not self.stream
        if self.recompute_logprobs and self.stream:
            raise ValueError(
                "recompute_logprobs=true and stream=true cannot go together: a streamed "
                "response leaves before a recompute could see it; set recompute_logprobs=false "
                "or set stream=false"
            )
        if self.tis_cap > 0 and not self.recompute_logprobs:
            raise ValueError(
                f"tis_cap={self.tis_cap} needs recompute_logprobs=true (the trainer's logprobs "
                "beside the sampler's), which stream=true rules out; set tis_cap=0 or set "
                "stream=false"
            )

    def _resolve(self) -> None:
        """Give each :data:`AUTO` option of this config left None its default for this policy; a
        default ``max_new_tokens`` that cannot fit the model's context is fitted to it
        (:func:`fitted_new_tokens`)."""
        which = int(users_model(self.policy))
        for name in AUTO:
            if getattr(self, name, 0) is None:
                value = AUTO[name][which]
                if callable(value):
                    value = value(self)
                elif name == "max_new_tokens" and which:
                    value = fitted_new_tokens(self.policy, int(value))[0]
                setattr(self, name, value)

    @property
    def prompts_drawn(self) -> int:
        """Prompts the data node draws a step (more than batch_size with dynamic sampling)."""
        return self.batch_size

    @property
    def has_reference(self) -> bool:
        """Whether the graph scores a reference (PPO's always does)."""
        return True

    def idle_options(self) -> dict[str, str]:
        """The options that do nothing with these settings, each with what would make it
        matter: what ``yatt-graph show GRAPH --options`` leaves out."""
        vllm, data = self.rollout == "vllm", self.data is not None or self.val_data is not None
        when = {
            "task": ("no data (the shapes task)", self.data is None),
            **dict.fromkeys(("prompt_key", "image_key", "answer_key"), ("data", data)),
            **dict.fromkeys(VAL_OPTIONS, ("val_data", self.val_data is not None)),
            **dict.fromkeys(
                VAL_SAMPLING,
                (
                    "val_data and val_samples > 1",
                    self.val_data is not None and self.val_samples > 1,
                ),
            ),
            **dict.fromkeys(("lora_alpha", "lora_targets"), ("lora_r > 0", self.lora_r > 0)),
            "chat_template": ("a policy with a chat template", _templated(self.policy)),
            "train_backend": ("train_ranks > 1", self.train_ranks > 1),
            "shard_reference": (
                "train_ranks > 1 and a reference (kl_coef > 0)",
                self.train_ranks > 1 and self.has_reference,
            ),
            "distill_mode": ("distill_coef > 0", self.distill_coef > 0),
            "distill_estimator": (
                "distill_coef > 0 and distill_mode=loss",
                self.distill_coef > 0 and self.distill_mode == "loss",
            ),
            "lr_decay_steps": ("lr_schedule linear or cosine", self.lr_schedule != "constant"),
            "tis_cap": ("recompute_logprobs", bool(self.recompute_logprobs)),
            **dict.fromkeys(("tis_level", "tis_mode"), ("tis_cap > 0", self.tis_cap > 0)),
            "overlong_penalty": ("overlong_buffer > 0", getattr(self, "overlong_buffer", 1) > 0),
            **{n: ("rollout=vllm", vllm) for n in self.__struct_fields__ if n.startswith("vllm_")},
        }
        return {name: need for name, (need, active) in when.items() if not active}

    @classmethod
    def from_options(cls, graph: str, options: dict[str, Any]) -> Self:
        """The config of ``graph`` from ``build_graph``'s keyword options, checked."""
        return build_config(cls, check_options(options, config_options(cls), False, graph), graph)


class PPOConfig(RLConfig, kw_only=True, forbid_unknown_fields=True):
    """PPO: a critic trained beside the policy, advantages by GAE."""

    critic_lr: float | None = None
    """The critic's AdamW learning rate (> 0); none: 1e-3 with the tiny policy, 1e-5 a model."""
    gamma: float = 1.0
    """GAE discount per token, in [0, 1]; 1 because the only reward comes at the end."""
    lam: float = 0.95
    """GAE lambda, in [0, 1]: 0 trusts the critic's next value, 1 the whole return."""
    shard_critic: bool = False
    """With train_ranks > 1: the critic scores on the update's ranks with the value model the
    update trains there (FSDP2), so no device holds a whole copy of it and no weights are
    sent to it; each rank scores a share of the batch, on the update's controller."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("critic_lr", self.critic_lr)
        within("gamma", self.gamma, 0.0, 1.0)
        within("lam", self.lam, 0.0, 1.0)

    def idle_options(self) -> dict[str, str]:
        idle = super().idle_options()
        if self.train_ranks < 2:
            idle["shard_critic"] = "train_ranks > 1"
        return idle


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
    """A registered group estimator: grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline."""
    dynamic_sampling: float = 0.0
    """DAPO's dynamic sampling: draw this share more prompts (0.5: 1.5x batch_size, the refill
    cap), drop the groups whose rewards are all equal and train on the first batch_size of
    the rest (fewer when too few differ); 0: off. Its stats: dynamic_sampling/*."""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: the last this many tokens before max_new_tokens cost up to
    overlong_penalty of the score, in proportion (0: off)."""
    overlong_penalty: float = 1.0
    """The most a response at max_new_tokens loses with overlong_buffer (>= 0)."""
    kl_estimator: KLEstimator = "k3"
    """The KL-to-reference loss term's estimator: k1, k2, k3 (the GRPO paper's) or abs."""
    aggregation: Aggregation = "seq-mean-token-mean"
    """How token losses make the loss: token-mean, seq-mean-token-mean, seq-mean-token-sum or
    seq-mean-token-sum-norm (Dr.GRPO's constant normaliser, over max_new_tokens)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least("group_size", self.group_size, 2)
        if not (0 <= self.dynamic_sampling <= 10 and math.isfinite(self.dynamic_sampling)):
            refuse("dynamic_sampling", self.dynamic_sampling, "in [0, 10] (0: off)")
        if self.dynamic_sampling and self.stream:
            raise ValueError(
                "dynamic_sampling and stream=true cannot go together: a group is kept or "
                "dropped once all its rewards are in; set dynamic_sampling=0 or set stream=false"
            )

    @property
    def has_reference(self) -> bool:
        """Only the KL term reads a reference: with kl_coef=0 the graph has none."""
        return self.kl_coef != 0

    @property
    def prompts_drawn(self) -> int:
        """batch_size, and with dynamic sampling that share more (rounded up)."""
        return math.ceil(self.batch_size * (1 + self.dynamic_sampling))


class GRPOConfig(TextGRPOConfig, kw_only=True, forbid_unknown_fields=True):
    """GRPO with images: a vision tower in front of a prefix-VLM policy."""

    vision: str = "tiny"
    """'tiny' or open_clip:NAME[:WEIGHTS_FILE]; only a prefix-VLM policy reads it."""


def refuse(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"option {name}={value!r}: must be {allowed}")


def at_least(name: str, value: float, low: float) -> None:
    if not (value >= low and math.isfinite(value)):  # also refuses NaN
        refuse(name, value, f">= {low}" if isinstance(value, int) else f"a finite number >= {low}")


def positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        refuse(name, value, "a finite number > 0")


def within(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        refuse(name, value, f"in [{low}, {high}]")


def check_choices(config: msgspec.Struct) -> None:
    """Refuse a value outside its field's ``Literal`` choices (a Struct made in code is not
    checked against its types as a decoded one is)."""
    for field in msgspec.structs.fields(config):
        if typing.get_origin(field.type) is typing.Literal:
            value = getattr(config, field.name)
            if value not in typing.get_args(field.type):
                choices = ", ".join(str(c) for c in typing.get_args(field.type))
                refuse(field.name, value, f"one of {choices}")
