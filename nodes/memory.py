"""What a model node will hold, before it is built: the sizes and formulas of the memory plan
(:mod:`nodes.memory_plan` adds them up per process and device).

A model node says what it holds for one step's :class:`Load` through ``Node.memory(load)``:
bytes by part (:data:`PARTS`). The parts in :data:`HELD` stay between steps (weights, AdamW
state, snapshots of published weights); the others live only while the node runs
(gradients, activations, the KV cache, images). Nodes of one process run one at a time, so a
process peaks at what all its nodes hold plus the largest single call's working set; a model
of one share key (:mod:`nodes.shared_models`) in one process is counted once.

Sizes come from the model without building it where that would cost: a local checkpoint's
parameter count from its safetensors headers and its shape from ``config.json``; a tiny model
built in code is built (milliseconds). The working-set formulas (:func:`train_bytes`,
:func:`forward_bytes`, :func:`kv_cache_bytes`) count per token what eager PyTorch keeps for
the backward pass of a decoder layer, the attention scores, and the logits with their
log-softmax and gradient; docs/PERFORMANCE.md ("The memory plan against measured peaks")
checks them against measured peaks.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = [
    "HELD",
    "PARTS",
    "Load",
    "ModelSize",
    "checkpoint_size",
    "module_size",
    "reading_memory",
    "forward_bytes",
    "image_memory",
    "sampling_memory",
    "scoring_memory",
    "training_memory",
    "kv_cache_bytes",
    "model_size",
    "prompt_tokens",
    "train_bytes",
    "vision_params",
    "within_budget",
]

PARTS = ("weights", "optimizer", "snapshots", "gradients", "activations", "kv_cache", "images")
"""What a node's memory is made of, in the order the plan prints it."""
HELD = ("weights", "optimizer", "snapshots")
"""The parts held between calls; the others are a call's working set."""

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Load:
    """One step's work, as the model nodes see it."""

    prompts: int
    """Prompts a step (the data node's batch)."""
    responses: int
    """Responses a step (prompts times samples per prompt)."""
    prompt_tokens: int
    """The longest prompt, in tokens."""
    response_tokens: int
    """The longest response (max_new_tokens)."""
    image_pixels: int = 0
    """Pixels of the largest image (0: no images)."""
    hosts: int = 1
    """The hosts a node's rank group spans (hybrid sharding shards within each, so a rank
    holds 1/(ranks per host) of the state); the plan sets it per node."""

    @property
    def tokens(self) -> int:
        """Padded prompt + response tokens of the whole step's batch."""
        return self.responses * (self.prompt_tokens + self.response_tokens)


@dataclass(frozen=True)
class ModelSize:
    """What the formulas need of a model."""

    params: int
    trainable: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_dim: int
    """Key (or value) width of one layer: key-value heads times head size."""
    vocab: int
    bytes_per_param: int = 4


def _dims(config: Mapping[str, Any]) -> dict[str, int]:
    """Layers, widths, heads and vocabulary of a transformers config dict (its text config
    for a VLM), under the names of the common families."""
    text = config.get("text_config") or config
    if isinstance(text, Mapping) and "hidden_size" not in text and "n_embd" not in text:
        text = config

    def pick(*names: str, default: int = 0) -> int:
        for name in names:
            value = text.get(name)
            if isinstance(value, int) and value > 0:
                return value
        return default

    hidden = pick("hidden_size", "n_embd", "d_model")
    heads = pick("num_attention_heads", "n_head", default=1)
    head_dim = pick("head_dim", default=hidden // max(heads, 1))
    return {
        "layers": pick("num_hidden_layers", "n_layer", "num_layers"),
        "hidden": hidden,
        "intermediate": pick("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden),
        "heads": heads,
        "kv_dim": pick("num_key_value_heads", default=heads) * head_dim,
        "vocab": pick("vocab_size"),
    }


def _lora_params(spec: Mapping[str, Any], m: ModelSize) -> int:
    """Trainable parameters of LoRA adapters on every linear layer of a decoder: rank times
    (inputs + outputs) of q, k, v, o, gate, up and down."""
    r = int(spec.get("r", 8))
    return r * m.layers * (9 * m.hidden + 2 * m.kv_dim + 3 * m.intermediate)


@functools.lru_cache(maxsize=32)
def _size_of(spec_json: str) -> ModelSize:
    from nodes.models.families import model_family
    from nodes.models.policy import _spec_dict

    spec = _spec_dict(json.loads(spec_json))
    dtype = str(spec.get("dtype", "float32"))
    if "path" in spec and not spec.get("image_dim"):
        root = Path(spec["path"])
        size = checkpoint_size(root / "lm" if model_family(root) == "prefix-vlm" else root, dtype)
    else:  # a model built in code (or a prefix-VLM around a user's LM): built, then counted
        from nodes.models.policy import build_policy

        policy = build_policy(spec)
        decoder = getattr(policy, "lm", None) or getattr(policy, "model", None)
        size = module_size(policy, dtype, config=getattr(decoder, "config", None))
        del policy
    lora = spec.get("lora")
    return replace(size, trainable=_lora_params(lora, size) if lora else size.params)


def checkpoint_size(path: str | Path, dtype: str = "float32") -> ModelSize:
    """The size of the transformers checkpoint in ``path``, from its safetensors headers and
    ``config.json`` (nothing is loaded)."""
    from nodes.models.families import _safetensors_summary
    from nodes.models.files import _read_json

    root = Path(path)
    dims = _dims(_read_json("memory plan", root / "config.json", "model checkpoint"))
    summary = _safetensors_summary(sorted(root.glob("*.safetensors")))
    params = summary[0] if summary else _estimate_params(dims)
    return ModelSize(params=params, trainable=params, bytes_per_param=_BYTES.get(dtype, 4), **dims)


def module_size(module: Any, dtype: str = "float32", config: Any = None) -> ModelSize:
    """The size of a live module; its shape from ``config`` (default: the module's own)."""
    config = config if config is not None else getattr(module, "config", None)
    dims = _dims(config.to_dict() if config is not None else {})
    params = sum(p.numel() for p in module.parameters())
    return ModelSize(params=params, trainable=params, bytes_per_param=_BYTES.get(dtype, 4), **dims)


def reading_memory(size: ModelSize, load: Load, rows: int, max_length: int, *, extra: int = 0,
                   logits: bool = True, budget: int = 0) -> dict[str, int]:  # fmt: skip
    """A model that reads each response (a reward model, a judge), ``rows`` at a time (and
    within ``budget`` padded tokens), each the prompt and the response (plus ``extra`` tokens
    of a template) up to ``max_length``."""
    length = min(load.prompt_tokens + load.response_tokens + extra, max_length)
    m = size if logits else replace(size, vocab=0)
    w = m.bytes_per_param
    tokens = within_budget(min(rows, load.responses) * length, length, budget)
    return {"weights@": m.params * w, "activations": forward_bytes(m, tokens, length, w)}


def _estimate_params(dims: Mapping[str, int]) -> int:
    """A decoder's parameters from its shape (for a checkpoint without safetensors)."""
    h, kv, inter = dims["hidden"], dims["kv_dim"], dims["intermediate"]
    return dims["layers"] * (2 * h * h + 2 * h * kv + 3 * h * inter) + 2 * dims["vocab"] * h


def model_size(spec: str | Mapping[str, Any]) -> ModelSize:
    """The size of the model a policy spec (:func:`nodes.models.policy.build_policy`) builds."""
    return _size_of(json.dumps(spec, sort_keys=True, default=str))


def _layer_floats(m: ModelSize) -> int:
    """Floats a decoder layer keeps per token for its backward pass: the norms' inputs and
    outputs, q, k, v and their rotated copies, the attention output, the residuals (about 10
    hidden widths), and the MLP's gate, up, activation and product (4 intermediate widths)."""
    return 10 * m.hidden + 2 * m.kv_dim + 4 * m.intermediate


def train_bytes(m: ModelSize, tokens: int, longest: int, width: int = 4) -> int:
    """Activations a forward and backward pass over ``tokens`` padded tokens keeps at its
    peak, in rows of ``longest`` tokens: every layer's saved tensors and attention scores, and
    the logits, their float32 log-softmax and its gradient (4 vocabularies of float32)."""
    per_token = m.layers * (_layer_floats(m) + m.heads * longest) * width + 4 * m.vocab * 4
    return tokens * per_token


def forward_bytes(m: ModelSize, tokens: int, longest: int, width: int = 4) -> int:
    """The working set of a forward pass without gradients: one layer's tensors at a time
    and the float32 logits with their log-softmax."""
    per_token = (6 * m.hidden + 3 * m.intermediate + m.heads * longest) * width + 2 * m.vocab * 4
    return tokens * per_token


def kv_cache_bytes(m: ModelSize, rows: int, length: int, width: int = 4) -> int:
    """Keys and values of every layer for ``rows`` sequences of ``length`` tokens."""
    return rows * length * m.layers * 2 * m.kv_dim * width


def within_budget(tokens: int, longest: int, budget: int) -> int:
    """Tokens of the largest forward over ``tokens`` padded tokens in rows of ``longest``: all
    of them, or with a ``budget`` at most that many in whole rows (at least one)."""
    return min(tokens, max(budget // longest, 1) * longest) if budget > 0 else tokens


def budget_tokens(budget: int, load: Load) -> tuple[int, int]:
    """(tokens, longest row) of the largest forward over the step's batch (:func:`within_budget`)."""
    longest = load.prompt_tokens + load.response_tokens
    return within_budget(load.tokens, longest, budget), longest


def prompt_tokens(spec: Any, prompts: list[Any], images: list[Any] | None = None) -> int:
    """The longest of ``prompts`` (with their images, one per prompt) as the policy of
    ``spec`` encodes them, chat template included; a local checkpoint's tokenizer or processor
    is loaded without its weights."""
    from nodes.models.families import model_family
    from nodes.models.policy import _spec_dict, build_policy

    d = _spec_dict(spec)
    if "path" in d and not d.get("image_dim"):
        return _dir_prompt_tokens(Path(d["path"]), model_family(d["path"]), d, prompts, images)
    policy = build_policy(spec)
    k = int(getattr(policy, "num_prefix_tokens", 0) or 0)  # a prefix-VLM's image positions
    vlm = images is not None and not k and hasattr(policy, "processor")
    batch = policy.encode_prompts(prompts, images=images if vlm else None)
    return int(batch.prompt_ids.shape[1]) + (k if images is not None else 0)


def _dir_prompt_tokens(root: Path, family: str, spec: Mapping[str, Any], prompts: list[Any],
                       images: list[Any] | None) -> int:  # fmt: skip
    from transformers import AutoProcessor

    from nodes.chat import chat_messages, needs_template
    from nodes.models.families import check_model_dir
    from nodes.models.files import _load_tokenizer, _loading

    check_model_dir(root, "memory plan")
    template = spec.get("chat_template", True) is not False
    if family == "vlm":
        with _loading("memory plan", root):
            processor = AutoProcessor.from_pretrained(root, local_files_only=True)
        if not (template and getattr(processor, "chat_template", None)) and any(
            chat_messages(p) is not None for p in prompts
        ):
            raise needs_template("its processor has none" if template else "chat_template=false")
        lengths = []
        for i, prompt in enumerate(prompts):
            image = images[i] if images else None
            content = [{"type": "image"}] if image is not None else []
            messages = chat_messages(prompt) or [
                {"role": "user", "content": [*content, {"type": "text", "text": str(prompt)}]}
            ]
            text = processor.apply_chat_template(messages, add_generation_prompt=True)
            enc = processor(text=[text], images=[image] if image is not None else None)
            lengths.append(len(enc["input_ids"][0]))
        return max(lengths, default=0)
    prefix = 0
    if family == "prefix-vlm":
        meta = json.loads((root / "prefix_vlm.json").read_text())
        prefix, root = int(meta.get("num_prefix_tokens", 0)) if images else 0, root / "lm"
    with _loading("memory plan", root):
        tokenizer = _load_tokenizer(root)
    lengths = []
    for prompt in prompts:
        messages = chat_messages(prompt)
        if template and getattr(tokenizer, "chat_template", None):
            messages = messages or [{"role": "user", "content": str(prompt)}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
        elif messages is not None:
            why = "its tokenizer has none" if template else "chat_template=false"
            raise needs_template("a prefix-VLM has none" if family == "prefix-vlm" else why)
        else:
            ids = tokenizer(str(prompt))["input_ids"]
        lengths.append(len(ids))
    return max(lengths, default=0) + prefix


# --- what the model nodes hold ------------------------------------------------------------
def _lora(spec: Any) -> bool:
    return isinstance(spec, Mapping) and bool(spec.get("lora"))


def _checkpointed(spec: Any) -> bool:
    return isinstance(spec, Mapping) and bool(spec.get("gradient_checkpointing"))


def sampling_memory(spec: Any, load: Load) -> dict[str, int]:
    """A rollout's: the policy, its KV cache for every response at full length, and the
    prompts' prefill (logits of the last position only)."""
    m = model_size(spec)
    w = m.bytes_per_param
    prefill = forward_bytes(replace(m, vocab=0), load.responses * load.prompt_tokens,
                            load.prompt_tokens, w) + load.responses * m.vocab * 4 * 3  # fmt: skip
    length = load.prompt_tokens + load.response_tokens
    return {
        "weights": m.params * w,
        "kv_cache": kv_cache_bytes(m, load.responses, length, w),
        "activations": prefill,
    }


def scoring_memory(spec: Any, load: Load, budget: int, *, logits: bool = True) -> dict[str, int]:
    """A forward over the step's responses without gradients (reference logprobs, values):
    the model and its largest forward within ``budget`` padded tokens."""
    m = model_size(spec)
    tokens, longest = budget_tokens(budget, load)
    m = m if logits else replace(m, vocab=0)
    return {"weights": m.params * m.bytes_per_param,
            "activations": forward_bytes(m, tokens, longest, m.bytes_per_param)}  # fmt: skip


def training_memory(
    spec: Any,
    load: Load,
    *,
    budget: int = 0,
    rows: int = 0,
    mini_batches: int = 1,
    mixed: bool = False,
    live: bool = False,
    shards: int = 1,
    logits: bool = True,
) -> dict[str, int]:
    """An update's, for one trained model: its weights, gradients and AdamW state (1/shards
    each with FSDP), the copy kept to undo a non-finite step and the snapshot it publishes
    (none when ``live``: consumers read its tensors), and the activations of its largest
    micro-batch (``budget`` padded tokens or ``rows`` rows; else the mini-batch)."""
    m = model_size(spec)
    w = m.bytes_per_param
    mini = replace(load, responses=max(load.responses // max(mini_batches, 1), 1))
    tokens, longest = budget_tokens(budget, mini)
    if rows and not budget:
        tokens = min(rows, mini.responses) * longest
    width = 2 if mixed or w == 2 else 4
    m = m if logits else replace(m, vocab=0)
    if _checkpointed(spec):  # each layer's input kept, one layer's tensors at a time
        per = m.layers * m.hidden * width + (_layer_floats(m) + m.heads * longest) * width
        activations = tokens * (per + 4 * m.vocab * 4)
    else:
        activations = train_bytes(m, tokens, longest, width)
    trained = m.trainable * w
    return {
        "weights": m.params * w // shards,
        "optimizer": 2 * trained // shards,
        "snapshots": trained // shards + (0 if live else m.params * w),
        "gradients": trained // shards,
        "activations": activations,
    }


def image_memory(load: Load, side: tuple[int, int]) -> dict[str, int]:
    """A vision tower's images in flight: the decoded RGB images and their float32 tensors at
    the tower's input size."""
    return {"images": load.prompts * (3 * load.image_pixels + 3 * side[0] * side[1] * 4)}


@functools.lru_cache(maxsize=8)
def vision_params(model_name: str, overrides_json: str) -> int:
    """Parameters of an open_clip image tower, counted on the meta device (nothing allocated)."""
    import logging

    import open_clip

    overrides = json.loads(overrides_json)
    root = logging.getLogger()
    level, root.level = root.level, logging.ERROR  # "no pretrained weights": none are wanted
    try:
        model = open_clip.create_model(model_name, device="meta", **overrides)
    finally:
        root.level = level
    return sum(p.numel() for p in model.visual.parameters())
