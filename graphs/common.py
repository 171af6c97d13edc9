"""The front half of the ready graphs, and how their data, model and reward options load.

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
* ``reward``: the spellings of :func:`nodes.rewards.reward_from_option`: ``module:function``
  (a rule ``fn(text, meta) -> float``; default :func:`nodes.data.answer_reward`), ``clip``,
  ``model:DIR`` (a sequence classifier) or ``judge:DIR`` (a generative judge).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from graphs.config import TINY_TEXT_LMS, RLConfig, TextGRPOConfig
from nodes.advantage import GroupAdvantage
from nodes.data import ShapesSource, task_vocabulary
from nodes.reference import ReferenceLogprobs
from nodes.rewards import RewardNode, reward_from_option
from nodes.rollout import Rollout
from nodes.vision import TINY_OPEN_CLIP_CFG, VisionEncoder
from yatt_graph import Graph, Handle, Node

if TYPE_CHECKING:
    from nodes.memory import Load

__all__ = [
    "Sampled",
    "connect_weights",
    "data_source",
    "is_prefix_policy",
    "policy_spec",
    "resolve_device",
    "reward_node",
    "sample_and_score",
    "sample_columns",
    "group_advantage",
    "train_group",
    "vision_encoder",
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
    policy, seed = config.policy, config.seed
    if isinstance(policy, dict):
        return policy
    if policy == "tiny":
        spec: dict[str, Any] = {"name": "tiny-prefix-vlm", "seed": seed, "words": task_vocabulary()}
        if image_dim is not None:
            spec["image_dim"] = image_dim
        return {**spec, **_model_options(config)}
    if policy in TINY_TEXT_LMS:
        if image_dim is not None:
            raise ValueError(
                f"policy {policy!r} is a text-only LM; use it with text_ppo or text_grpo, or "
                "'tiny' (a prefix-VLM) with images"
            )
        spec = {"name": policy, "seed": seed, "words": task_vocabulary()}
        return {**spec, **_model_options(config)}
    path = Path(policy)
    if not path.is_dir():
        raise ValueError(
            f"policy {policy!r} is neither 'tiny', one of {', '.join(TINY_TEXT_LMS)}, nor a "
            "local model directory; models load only from local paths (nothing is downloaded)"
        )
    from nodes.models.families import model_family

    family = model_family(path)
    spec = {"path": str(path), **_model_options(config)}
    if not config.chat_template:
        spec["chat_template"] = False
    if family == "causal-lm" and image_dim is not None:
        spec |= {"image_dim": image_dim, "seed": seed}  # a prefix-VLM around the user's LM
    if family == "vlm" and image_dim is None:
        raise ValueError(
            f"policy {policy!r} is an image-text-to-text model; a text-only graph cannot give "
            "it images: use mm_ppo or mm_grpo"
        )
    return spec


def update_options(config: RLConfig) -> dict[str, Any]:
    """The update node's options the config sets, PPO's and GRPO's alike: the optimizer, its
    schedule, the loss's clip range and entropy bonus, the passes, and how a step is cut."""
    names = (
        "lr", "weight_decay", "max_grad_norm", "clip_eps", "clip_eps_high", "dual_clip", "entropy_coef",
        "epochs", "mini_batches", "micro_batch_tokens", "pack_sequences", "mask_truncated", "tis_cap", "mixed_precision",
        "lr_schedule",
        "lr_warmup_steps", "lr_decay_steps", "temperature", "seed",
    )  # fmt: skip
    return {name: getattr(config, name) for name in names}


def step_load(config: RLConfig, graph: Graph) -> Load:
    """One step's :class:`nodes.memory.Load` for a ready graph built from ``config``: a copy
    of its data node draws one batch, whose longest prompt (as the rollout's policy encodes
    it) stands for the prompt length unless ``max_prompt_tokens`` bounds it."""
    import copy

    from nodes.memory import Load, prompt_tokens

    rollout = graph.nodes["rollout"]
    batch = copy.deepcopy(graph.nodes["data"]).run()  # the run's own data node is not moved on
    images = batch.get("images")
    images = list(images) if images is not None and "vision" in graph.nodes else None
    longest = prompt_tokens(rollout.policy_spec, list(batch["prompts"]), images)
    if config.max_prompt_tokens is not None:
        longest = min(longest, config.max_prompt_tokens)
    pixels = max((im.width * im.height for im in images or []), default=0)
    return Load(
        prompts=config.prompts_drawn,  # (an upper bound for what trains, with dynamic sampling)
        responses=config.prompts_drawn * rollout.n,
        prompt_tokens=longest,
        response_tokens=config.max_new_tokens,
        image_pixels=pixels,
    )


def sampled_logprobs(config: RLConfig, sampled: Sampled) -> dict[str, Handle]:
    """The update's ``rollout_logprobs`` input where the rollout recomputes its logprobs (else
    they are the ``logprobs`` it already takes)."""
    return (
        {"rollout_logprobs": sampled.sample.rollout_logprobs} if config.recompute_logprobs else {}
    )


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


def is_prefix_policy(spec: dict[str, Any]) -> bool:
    """Whether the policy reads image embeddings from a separate vision encoder."""
    if spec.get("name") == "tiny-prefix-vlm":
        return True
    if "path" not in spec:
        return False
    return (Path(spec["path"]) / "prefix_vlm.json").is_file() or "image_dim" in spec


def vision_encoder(vision: str, seed: int, device: str = "cpu") -> VisionEncoder:
    return VisionEncoder(**_vision_kwargs(vision, seed), device=device, name="vision")


def _vision_kwargs(vision: str, seed: int) -> dict[str, Any]:
    if vision == "tiny":
        return {"model_name": "ViT-S-32", "model_cfg": TINY_OPEN_CLIP_CFG, "seed": seed}
    kind, _, rest = vision.partition(":")
    if kind != "open_clip" or not rest:
        raise ValueError(f"vision {vision!r}: use 'tiny' or 'open_clip:NAME[:WEIGHTS_FILE]'")
    name, _, weights = rest.partition(":")
    return {"model_name": name, "pretrained": weights or None, "seed": seed}


def reward_node(
    reward: str, on_bad_sample: str = "raise", micro_batch_tokens: int = 0
) -> RewardNode:
    """The reward of ``reward`` (:func:`nodes.rewards.reward_from_option`); ``on_bad_sample``:
    ``"raise"`` (a NaN/inf score stops the run, naming the sample) or ``"skip"`` (the sample
    scores 0, and a ``bad_samples`` output counts it); a reward model or judge reads within
    ``micro_batch_tokens``."""
    return reward_from_option(
        reward, on_bad_sample=on_bad_sample, name="reward", micro_batch_tokens=micro_batch_tokens
    )


def data_source(config: RLConfig, *, text_only: bool, rows: bool = False) -> Node:
    """The training data: ``config.data`` read by :class:`nodes.datasets.DatasetSource`, or
    the shapes task; ``rows``: with the ``rows`` output (each prompt's file and row)."""
    if config.data is None:
        return ShapesSource(
            batch_size=config.prompts_drawn,
            task=config.task,
            seed=config.seed,
            text_hint=text_only,
            emit_rows=rows,
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
        emit_rows=rows,
        name="data",
        **_keys(config),
    )


def _check_meta(source: Node, reward: RewardNode) -> None:
    """The user's data holds the columns the reward reads (the answer, a template's keys)."""
    from nodes.datasets import DatasetSource

    if not isinstance(source, DatasetSource):  # the shapes task has every key
        return
    columns = source.columns
    have = {c for c in columns if c not in (source.prompt_key, source.image_key)}
    have |= {"answer"} if source.answer_key in columns else set()
    missing = sorted(reward.reads_meta - have)
    if missing:
        hint = " pass --set answer_key=<column>, or" if "answer" in missing else ""
        raise ValueError(
            f"{source.file_label}: the reward {type(reward).__name__} reads {missing} of each "
            f"row, and the data has no such column (its columns: {list(columns)});{hint} use a "
            "reward that does not need it"
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


def _keys(config: RLConfig) -> dict[str, str]:
    return {
        "prompt_key": config.prompt_key,
        "image_key": config.image_key,
        "answer_key": config.answer_key,
    }


class Sampled(NamedTuple):
    """The front half every ready graph shares: data, rollout, reward and reference."""

    spec: dict[str, Any]
    """The policy spec, for every node that holds a copy of the policy."""
    device: str
    """Where the model nodes run (``config.device`` resolved)."""
    rollout: Node
    sample: Any
    """The rollout's outputs (``sample.texts``, ``sample.logprobs``, ...)."""
    scores: Handle
    tensors: dict[str, Handle]
    """prompt_ids, prompt_mask, response_ids, response_mask: what model nodes read."""
    image_port: dict[str, Handle]
    """``image_embeds`` (prefix-VLM), ``images`` (HF VLM) or nothing (text only)."""
    ref_logprobs: Handle | None
    """The reference's logprobs; None when the graph asked for no reference."""
    validation: Node | None
    """The greedy validation node (``config.val_data``), which loads the rollout's weights."""
    drawn_scores: Handle
    """Every sampled response's score (``scores`` holds the kept groups' with dynamic
    sampling): what the run reports as its reward."""
    drawn_group_ids: Handle | None = None
    """Every sampled response's group label where dynamic sampling drops groups (``sample``
    then holds the kept rows); None where ``sample`` holds every sampled response."""


def sample_and_score(
    g: Graph, config: RLConfig, *, vision: str | None = None, n: int = 1, reference: bool = True
) -> Sampled:
    """Declare data -> (vision) -> rollout -> reward, and the reference logprobs, in ``g``.

    ``vision``: the vision tower (``config.vision`` of a graph with images), or None for a
    text-only graph; ``n``: samples per prompt.
    ``config.stream``: the rollout hands out responses as they end (``Rollout(stream=True)``);
    with one sample per prompt the reward, the reference and the critic then take them piece by
    piece (runtime/engine/streams.py), which overlaps generation when they run on another
    controller (``--placement partial``).
    Weight updates reach the rollout (and the validation) through :func:`connect_weights`.
    """
    text_only = vision is None
    device = resolve_device(config.device)
    source = data_source(config, text_only=text_only, rows=True)
    data = source()
    if config.data is not None:
        g.output("data", data.stats)
    g.output("data_rows", data.rows)  # each prompt's file and row, for the samples file
    vision_kwargs: dict[str, Any] = {}
    if text_only:
        g.discard(data.images)
        spec, image_port = policy_spec(config, None), {}
    else:
        vision_kwargs = _vision_kwargs(vision, config.seed)
        encoder = VisionEncoder(**vision_kwargs, device=device, name="vision")
        spec = policy_spec(config, encoder.embed_dim)
        prefix = is_prefix_policy(spec)
        image_port = {"image_embeds": encoder(data.images)} if prefix else {"images": data.images}
        g.output("images", data.images)  # thumbnails in the samples file
    rollout = Rollout(
        policy=spec,
        backend=config.rollout,
        n=n,
        max_new_tokens=config.max_new_tokens,
        max_prompt_tokens=config.max_prompt_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        stop=config.stop,
        seed=config.seed,
        recompute_logprobs=config.recompute_logprobs,
        stream=config.stream,
        device=device,
        vllm_options=vllm_options(config) if config.rollout == "vllm" else None,
        name="rollout",
    )
    sample = rollout(prompts=data.prompts, **image_port)
    if not config.recompute_logprobs:
        g.discard(sample.rollout_logprobs)  # the sampler's logprobs are the ones the update takes
    reward = reward_node(config.reward, config.on_bad_sample, config.micro_batch_tokens)
    _check_meta(source, reward)
    extra: dict[str, Handle] = {}
    if getattr(reward, "needs_prompts", False):
        extra["prompts"] = data.prompts
    if getattr(reward, "needs_images", False):
        if text_only:
            raise ValueError(f"reward {config.reward!r} reads images; this graph has none")
        extra["images"] = data.images
    scores = reward(texts=sample.texts, meta=data.meta, **extra)
    if config.on_bad_sample == "skip":  # the reward has a second output: which samples it skipped
        scores, skipped = scores
        g.output("bad_samples", skipped)
    drawn_scores = scores
    g.output("texts", sample.texts)  # with prompts and scores: what a run shows at a glance
    g.output("prompts", data.prompts)
    # per sampled response, as texts: the samples file's length and stop reason
    g.output("response_lengths", sample.response_lengths)
    g.output("truncated", sample.truncated)
    drawn_group_ids = None
    if config.prompts_drawn > config.batch_size:  # dynamic sampling: the informative groups
        drawn_group_ids = sample.group_ids
        sample, scores, image_port = _keep_groups(g, config, sample, scores, image_port)
    tensors = {
        "prompt_ids": sample.prompt_ids,
        "prompt_mask": sample.prompt_mask,
        "response_ids": sample.response_ids,
        "response_mask": sample.response_mask,
    }
    ref = None  # no reference where nothing reads it (GRPO without its KL term)
    if reference:
        node = ReferenceLogprobs(
            policy=spec, temperature=config.temperature, device=device, name="reference",
            micro_batch_tokens=config.micro_batch_tokens,
        )  # fmt: skip
        ref = node(**tensors, **image_port)
    validation = None
    if config.val_data is not None:
        validation = _validation(g, config, spec, device, text_only, image_port, vision_kwargs)
    return Sampled(
        spec, device, rollout, sample, scores, tensors, image_port, ref, validation, drawn_scores,
        drawn_group_ids,
    )  # fmt: skip


def sample_columns(g: Graph, config: RLConfig, s: Sampled, advantages: Handle) -> None:
    """The graph output ``sample_stats``: per trained response its advantage, reference KL
    and rollout/trainer logprob gap, and which sampled response it is
    (:class:`nodes.sample_stats.SampleStats`), for the samples file."""
    from nodes.sample_stats import SampleStats

    optional: dict[str, Handle] = {}
    if s.ref_logprobs is not None:
        optional["ref_logprobs"] = s.ref_logprobs
    if config.recompute_logprobs:
        optional["rollout_logprobs"] = s.sample.rollout_logprobs
    if s.drawn_group_ids is not None:
        optional["sampled_group_ids"] = s.drawn_group_ids
    stats = SampleStats(name="sample_stats")(
        response_mask=s.sample.response_mask,
        group_ids=s.sample.group_ids,
        advantages=advantages,
        logprobs=s.sample.logprobs,
        **optional,
    )
    g.output("sample_stats", stats)


def _keep_groups(
    g: Graph, config: RLConfig, sample: Any, scores: Handle, image_port: dict[str, Handle]
) -> tuple[Any, Handle, dict[str, Handle]]:
    """The rollout's rows of the first ``batch_size`` groups whose scores differ
    (:class:`nodes.filters.KeepGroups`), in place of the rollout's outputs."""
    from types import SimpleNamespace

    from nodes.filters import KeepGroups

    rows = ["prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs",
            "truncated"]  # fmt: skip
    if config.recompute_logprobs:
        rows.append("rollout_logprobs")
    node = KeepGroups(config.batch_size, rows=rows, prompts=list(image_port), name="keep_groups")
    kept = node(scores=scores, group_ids=sample.group_ids, **{r: getattr(sample, r) for r in rows},
                **image_port)  # fmt: skip
    g.output("dynamic_sampling", kept.stats)
    carried = {r: getattr(kept, r) for r in rows} | {"group_ids": kept.group_ids}
    return SimpleNamespace(**carried), kept.scores, {p: getattr(kept, p) for p in image_port}


def _validation(
    g: Graph,
    config: RLConfig,
    spec: dict[str, Any],
    device: str,
    text_only: bool,
    image_port: dict[str, Handle],
    vision_kwargs: dict[str, Any],
) -> Node:
    from nodes.validation import GreedyValidation

    image_input = "none" if text_only else next(iter(image_port))
    node = GreedyValidation(
        spec,
        config.val_data,
        config.reward,
        every=config.val_every,
        rows=config.val_rows,
        batch_size=config.batch_size,
        max_new_tokens=config.max_new_tokens,
        max_prompt_tokens=config.max_prompt_tokens,
        image_input=image_input,
        vision=vision_kwargs if image_input == "image_embeds" else None,
        keys=_keys(config),
        on_bad_sample=config.on_bad_sample,
        device=device,
        name="validation",
    )
    g.output("val", node())
    return node


def connect_weights(g: Graph, s: Sampled, weights: Handle) -> None:
    """The weight sync's output into the rollout (and the validation), one step later."""
    g.connect(weights, s.rollout, "weights", delay=1)
    if s.validation is not None:
        g.connect(weights, s.validation, "weights", delay=1)
