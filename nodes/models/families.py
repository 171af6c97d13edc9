"""Which policy family a model directory holds, and loading it as a policy.

* ``"prefix-vlm"``: a directory written by ``PrefixVLM.save_pretrained`` (``prefix_vlm.json``);
* ``"vlm"``: an image-text-to-text checkpoint (``AutoModelForImageTextToText``: Qwen2-VL, ...);
* ``"causal-lm"``: a text causal LM (``AutoModelForCausalLM``: GPT-2, Llama, Qwen2, ...).

:func:`model_family` reads only ``prefix_vlm.json``/``config.json`` (``model_type`` and
``architectures``) against transformers' own auto mappings; :func:`load_policy` loads the
family and applies the options every spec may carry (:data:`OPTION_KEYS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from nodes.models.files import _read_json
from nodes.models.hf_causal import HFCausalPolicy
from nodes.models.hf_vlm import HFVisionLanguagePolicy
from nodes.models.lora import apply_lora, check_lora_spec
from nodes.models.policy_base import _PREFIX_MARKER, Policy, _local_dir
from nodes.models.prefix_vlm import PrefixVLM

__all__ = ["DTYPES", "FAMILIES", "OPTION_KEYS", "configure_policy", "load_policy", "model_family"]

FAMILIES = ("prefix-vlm", "vlm", "causal-lm")
DTYPES = ("float32", "bfloat16", "float16")
#: spec keys every policy spec (a tiny name or a path) may carry, applied after building
OPTION_KEYS = ("dtype", "gradient_checkpointing", "lora", "chat_template")


def _mapping_names(mapping: Mapping[str, Any]) -> set[str]:
    names: set[str] = set()
    for value in mapping.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def model_family(path: str | Path) -> str:
    """``"prefix-vlm"``, ``"vlm"`` or ``"causal-lm"`` for a local model directory; anything
    else is a ValueError saying what the directory holds and what is supported."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL,
    )
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as VLM,
    )

    fn = "model_family"
    path = _local_dir(fn, path)
    if (path / _PREFIX_MARKER).is_file():
        return "prefix-vlm"
    if not (path / "config.json").is_file():
        found = sorted(p.name for p in path.iterdir())[:6]
        raise ValueError(
            f"{fn}: {str(path)!r} has no config.json (it holds {found or 'nothing'}); give a "
            "directory written by save_pretrained (a transformers checkpoint or a saved policy)"
        )
    config = _read_json(fn, path / "config.json", "model checkpoint")
    model_type = config.get("model_type")
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    vlm_names, causal_names = _mapping_names(VLM), _mapping_names(CAUSAL)
    # The saved architecture decides: one model_type may be in both mappings (gemma3), and a
    # type with a causal head may be saved as another (bert: BertForMaskedLM). Without one,
    # the model_type does.
    if architectures:
        if any(a in vlm_names for a in architectures):
            return "vlm"
        if any(a in causal_names for a in architectures):
            return "causal-lm"
    elif model_type in VLM:
        return "vlm"
    elif model_type in CAUSAL:
        return "causal-lm"
    arch = f" ({', '.join(architectures)})" if architectures else ""
    raise ValueError(
        f"{fn}: {str(path)!r} holds a {model_type!r} model{arch}; yatt-graph loads causal LMs "
        "(AutoModelForCausalLM: gpt2, llama, qwen2, ...), image-text-to-text VLMs (qwen2_vl, "
        "qwen2_5_vl, ...) and saved prefix-VLMs"
    )


def check_dtype(dtype: Any, who: str = "policy") -> str:
    if dtype not in DTYPES:
        raise ValueError(f"{who}: dtype={dtype!r}; choose one of {', '.join(DTYPES)}")
    return dtype


def check_options(options: Mapping[str, Any], who: str = "policy") -> None:
    """Check the :data:`OPTION_KEYS` values of a spec (a ValueError saying what is wrong)."""
    if "dtype" in options:
        check_dtype(options["dtype"], who)
    for key in ("gradient_checkpointing", "chat_template"):
        if key in options and not isinstance(options[key], bool):
            raise ValueError(f"{who}: {key}={options[key]!r}; give true or false")
    if options.get("lora") is not None:
        check_lora_spec(options["lora"], who)


def configure_policy(
    policy: Policy,
    *,
    dtype: str = "float32",
    gradient_checkpointing: bool = False,
    lora: Mapping[str, Any] | None = None,
    chat_template: bool | None = None,
) -> Policy:
    """Apply the spec options to a built policy (in place; returns it): dtype, non-reentrant
    gradient checkpointing of the HF model, LoRA adapters, chat template on/off."""
    check_options({"dtype": dtype, "gradient_checkpointing": gradient_checkpointing}, "policy")
    if dtype != "float32":
        policy.to(getattr(torch, dtype))
    if chat_template is not None and hasattr(policy, "use_chat_template"):
        policy.use_chat_template = bool(chat_template)
    if gradient_checkpointing:
        model = getattr(policy, policy._hf_attribute)
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if lora is not None:
        apply_lora(policy, lora)
    return policy


def load_policy(
    path: str | Path,
    *,
    dtype: str = "float32",
    chat_template: bool = True,
    gradient_checkpointing: bool = False,
    lora: Mapping[str, Any] | None = None,
    image_dim: int | None = None,
    num_prefix_tokens: int = 4,
    seed: int = 0,
) -> Policy:
    """Load a local model directory as a policy of its family (:func:`model_family`).

    A causal LM with ``image_dim`` becomes a :class:`PrefixVLM` around it, with a fresh
    projector seeded by ``seed`` (the user's text LM reads image embeddings from a vision
    tower). ``seed`` also seeds the LoRA initialization."""
    fn = "load_policy"
    check_dtype(dtype, fn)
    family = model_family(path)
    if image_dim is not None and (
        isinstance(image_dim, bool) or not isinstance(image_dim, int) or image_dim < 1
    ):
        raise ValueError(f"{fn}: image_dim={image_dim!r}; give an integer >= 1 (or leave it out)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        if family == "prefix-vlm":
            policy: Policy = PrefixVLM.from_pretrained(path, dtype=dtype)
            if image_dim is not None and image_dim != policy.image_dim:
                raise ValueError(
                    f"{fn}: {str(path)!r} is a prefix-VLM saved with image_dim="
                    f"{policy.image_dim}, not {image_dim}; drop image_dim or match the encoder"
                )
        elif family == "vlm":
            if image_dim is not None:
                raise ValueError(
                    f"{fn}: {str(path)!r} is an image-text-to-text model with its own vision "
                    "tower; it takes images, not image_dim: drop image_dim"
                )
            policy = HFVisionLanguagePolicy.from_pretrained(
                path, dtype=dtype, use_chat_template=chat_template
            )
        else:
            policy = HFCausalPolicy.from_pretrained(
                path, dtype=dtype, use_chat_template=chat_template
            )
            if image_dim is not None:
                prefix = PrefixVLM(policy.model, policy.tokenizer, image_dim, num_prefix_tokens)
                policy = prefix.to(getattr(torch, dtype)).eval()
        return configure_policy(
            policy, gradient_checkpointing=gradient_checkpointing, lora=lora
        ).eval()
