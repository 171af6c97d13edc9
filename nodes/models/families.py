"""Which policy family a model directory holds, and loading it as a policy.

* ``"prefix-vlm"``: a directory written by ``PrefixVLM.save_pretrained`` (``prefix_vlm.json``);
* ``"vlm"``: an image-text-to-text checkpoint (``AutoModelForImageTextToText``: Qwen2-VL, ...);
* ``"causal-lm"``: a text causal LM (``AutoModelForCausalLM``: GPT-2, Llama, Qwen2, ...).

:func:`model_family` reads only ``prefix_vlm.json``/``config.json`` (``model_type`` and
``architectures``) against transformers' own auto mappings; :func:`load_policy` loads the
family and applies the options every spec may carry (:data:`OPTION_KEYS`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from nodes.models.files import (
    _check_checkpoint_dir,
    _check_model_type,
    _found,
    _local_dir,
    _read_json,
    config_positions,
)
from nodes.models.hf_causal import HFCausalPolicy
from nodes.models.hf_vlm import HFVisionLanguagePolicy
from nodes.models.lora import apply_lora, check_lora_spec
from nodes.models.policy_base import _PREFIX_MARKER, TINY_MARK, Policy
from nodes.models.prefix_vlm import PrefixVLM, check_prefix_files
from nodes.seeding import seeded
from yatt_graph import UsageError

__all__ = [
    "DTYPES",
    "FAMILIES",
    "OPTION_KEYS",
    "Family",
    "check_model_dir",
    "check_model_options",
    "check_path_options",
    "configure_policy",
    "describe_model_dir",
    "load_policy",
    "has_chat_template",
    "is_tiny_dir",
    "model_positions",
    "model_family",
]

Family = Literal["prefix-vlm", "vlm", "causal-lm"]
FAMILIES: tuple[Family, ...] = ("prefix-vlm", "vlm", "causal-lm")
DTYPES = ("float32", "bfloat16", "float16")
#: spec keys every policy spec (a tiny name or a path) may carry, applied after building
OPTION_KEYS = ("dtype", "gradient_checkpointing", "lora", "chat_template")


def _mapping_names(mapping: Mapping[str, Any]) -> set[str]:
    names: set[str] = set()
    for value in mapping.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def model_family(path: str | Path) -> Family:
    """``"prefix-vlm"``, ``"vlm"`` or ``"causal-lm"`` for a local model directory; anything
    else is a ValueError saying what the directory holds and what is supported.

    The saved ``architectures`` decide (a model type can be saved with a head we do not load:
    ``bert`` as ``BertForMaskedLM``); without them the ``model_type`` does, and a type in both
    auto mappings (gemma3) is a VLM when the config has a ``vision_config``."""
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
    config = _config(fn, path)
    model_type = config.get("model_type")
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    has_vision = isinstance(config.get("vision_config"), dict)
    vlm_names, causal_names = _mapping_names(VLM), _mapping_names(CAUSAL)
    is_vlm = any(a in vlm_names for a in architectures)
    is_causal = any(a in causal_names for a in architectures)
    if not architectures:
        is_vlm, is_causal = model_type in VLM, model_type in CAUSAL
    if is_vlm and (has_vision or not is_causal):
        return "vlm"
    if is_causal:
        return "causal-lm"
    _check_model_type(fn, path, config)  # a config transformers knows, at the least
    arch = f" ({', '.join(architectures)})" if architectures else ""
    raise UsageError(
        f"{fn}: {str(path)!r} holds a {model_type!r} model{arch}; yatt-graph loads causal LMs "
        "(AutoModelForCausalLM: gpt2, llama, qwen2, ...), image-text-to-text VLMs "
        "(AutoModelForImageTextToText: qwen2_vl, qwen2_5_vl, ...) and saved prefix-VLMs"
    )


def check_model_dir(path: str | Path, who: str = "load_policy") -> Family:
    """The family of a local model directory (:func:`model_family`), after checking that it
    holds everything loading it needs, reading only its JSON files and safetensors headers:
    ``config.json``, the weights (every shard an index names), the tokenizer's files (and the
    package that reads them), a VLM's image processor, a prefix-VLM's ``prefix_vlm.json``,
    ``projector.safetensors`` and ``lm/``. Whatever is missing is one UsageError naming the
    folder, what is missing and the fix, before any model loads."""
    family = model_family(path)
    path = Path(path)
    if family == "prefix-vlm":
        check_prefix_files(who, path)
        _check_checkpoint_dir(who, path / "lm", "tokenizer")
    else:
        _check_checkpoint_dir(who, path, "processor" if family == "vlm" else "tokenizer")
    return family


def model_positions(path: str | Path) -> int | None:
    """Positions one sequence may take in a model folder (:func:`config_positions` of its
    ``config.json``; a prefix-VLM's ``lm/``), read from the file alone; None where it names
    none or cannot be read."""
    folder = Path(path)
    for config in (folder / "config.json", folder / "lm" / "config.json"):
        try:
            read = json.loads(config.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(read, dict) and (n := config_positions(read)):
            return n
    return None


def is_tiny_dir(path: str | Path) -> bool:
    """Whether a directory holds one of this project's tiny models (their config carries
    :data:`~nodes.models.policy_base.TINY_MARK`), saved or exported, rather than a user's."""
    folder = Path(path)
    for config in (folder / "config.json", folder / "lm" / "config.json"):  # lm/: a prefix-VLM
        try:
            if json.loads(config.read_text()).get(TINY_MARK):
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def has_chat_template(path: str | Path) -> bool:
    """Whether a model directory's tokenizer or processor carries a chat template (read from
    its files, without loading anything)."""
    folder = Path(path)
    if (folder / "chat_template.jinja").is_file():
        return True
    for name in ("tokenizer_config.json", "chat_template.json", "processor_config.json"):
        try:
            if json.loads((folder / name).read_text()).get("chat_template"):
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def _config(fn: str, path: Path) -> dict[str, Any]:
    if not (path / "config.json").is_file():
        raise UsageError(
            f"{fn}: {str(path)!r} has no config.json (it holds {_found(path)}); give a "
            "directory written by save_pretrained (a transformers checkpoint or a saved policy)"
        )
    return _read_json(fn, path / "config.json", "model checkpoint")


def _safetensors_summary(files: list[Path]) -> tuple[int, set[str]] | None:
    """Parameter count and dtypes from the safetensors headers (no tensor is read), or None
    when a header cannot be read."""
    count, dtypes = 0, set()
    for file in files:
        try:
            with file.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        for name, info in header.items():
            if name != "__metadata__" and isinstance(info, dict):
                count += math.prod(info.get("shape", ()))
                dtypes.add(str(info.get("dtype", "?")).lower())
    return count, dtypes


def describe_model_dir(path: str | Path) -> str:
    """One line about a model directory for people (the CLI prints it): its family, model
    type and architecture, and the parameter count and dtype from the safetensors headers,
    e.g. ``causal-lm qwen2 (Qwen2ForCausalLM), 0.11M parameters (f32) in '/models/q'``.
    Raises what :func:`model_family` raises for a directory it cannot load."""
    family = model_family(path)
    path = Path(path)
    root = path / "lm" if family == "prefix-vlm" else path
    config = _config("describe_model_dir", root)
    architectures = ", ".join(a for a in config.get("architectures") or [] if isinstance(a, str))
    text = f"{family} {config.get('model_type', '?')}" + (
        f" ({architectures})" if architectures else ""
    )
    files = sorted(root.glob("*.safetensors"))
    if family == "prefix-vlm":
        files.append(path / "projector.safetensors")
        meta = _read_json("describe_model_dir", path / _PREFIX_MARKER, "saved PrefixVLM")
        text += f" + projector {meta.get('image_dim')} -> {meta.get('num_prefix_tokens')} tokens"
    summary = _safetensors_summary([f for f in files if f.is_file()]) if files else None
    if summary is not None and summary[0]:
        count, dtypes = summary
        scale = next((s for s in ((1e9, "B"), (1e6, "M"), (1e3, "K")) if count >= s[0]), (1, ""))
        text += f", {count / scale[0]:.3g}{scale[1]} parameters ({'/'.join(sorted(dtypes))})"
    return f"{text} in {str(path)!r}"


def check_dtype(dtype: Any, who: str = "policy") -> str:
    if dtype not in DTYPES:
        raise ValueError(f"{who}: dtype={dtype!r}; choose one of {', '.join(DTYPES)}")
    return dtype


def check_model_options(options: Mapping[str, Any], who: str = "policy") -> None:
    """Check the :data:`OPTION_KEYS` values of a spec (a ValueError saying what is wrong)."""
    if "dtype" in options:
        check_dtype(options["dtype"], who)
    if "gradient_checkpointing" in options and not isinstance(
        options["gradient_checkpointing"], bool
    ):
        raise ValueError(
            f"{who}: gradient_checkpointing={options['gradient_checkpointing']!r}; give true or "
            "false"
        )
    template = options.get("chat_template")
    if "chat_template" in options and not (
        isinstance(template, bool) or (isinstance(template, str) and template)
    ):
        raise ValueError(
            f"{who}: chat_template={template!r}; give true (the tokenizer's own template), "
            "false (prompts as they are) or a Jinja template string"
        )
    if options.get("lora") is not None:
        check_lora_spec(options["lora"], who)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_path_options(options: Mapping[str, Any], who: str = "load_policy") -> None:
    """:func:`check_model_options` plus the keys only a path spec has (``image_dim``,
    ``num_prefix_tokens``, ``seed``)."""
    check_model_options(options, who)
    image_dim = options.get("image_dim")
    if image_dim is not None and not (_is_int(image_dim) and image_dim >= 1):
        raise ValueError(f"{who}: image_dim={image_dim!r}; give an integer >= 1 (or leave it out)")
    if "num_prefix_tokens" in options:
        k = options["num_prefix_tokens"]
        if not (_is_int(k) and k >= 1):
            raise ValueError(f"{who}: num_prefix_tokens={k!r}; give an integer >= 1")
    if "seed" in options and not _is_int(options["seed"]):
        raise ValueError(f"{who}: seed={options['seed']!r}; give an integer")


def configure_policy(
    policy: Policy,
    *,
    dtype: str = "float32",
    gradient_checkpointing: bool = False,
    lora: Mapping[str, Any] | None = None,
    chat_template: bool | str | None = None,
) -> Policy:
    """Apply the spec options to a built policy (in place; returns it): dtype, non-reentrant
    gradient checkpointing of the HF model, LoRA adapters, and the chat template (True: the
    tokenizer's or processor's own, when it has one; False: prompts as they are; a Jinja
    string: that template; None: leave the policy as built)."""
    options = {"dtype": dtype, "gradient_checkpointing": gradient_checkpointing}
    if chat_template is not None:
        options["chat_template"] = chat_template
    check_model_options(options, "policy")
    if dtype != "float32":
        policy.to(getattr(torch, dtype))
    if chat_template is not None:
        _set_chat_template(policy, chat_template)
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


def _set_chat_template(policy: Policy, chat_template: bool | str) -> None:
    if not hasattr(policy, "use_chat_template"):
        if chat_template is False:
            return
        raise ValueError(
            f"{type(policy).__name__}: chat_template={chat_template!r}, but this family "
            "tokenizes prompts as they are (it applies no chat template); drop the key"
        )
    if isinstance(chat_template, str):
        owner = getattr(policy, "processor", None) or policy.tokenizer
        owner.chat_template = chat_template
    policy.use_chat_template = chat_template is not False


def load_policy(
    path: str | Path,
    *,
    dtype: str = "float32",
    chat_template: bool | str = True,
    gradient_checkpointing: bool = False,
    lora: Mapping[str, Any] | None = None,
    image_dim: int | None = None,
    num_prefix_tokens: int = 4,
    seed: int = 0,
) -> Policy:
    """Load a local model directory as a policy of its family (:func:`model_family`).

    * ``dtype``: float32, bfloat16 or float16 (the weights are loaded in it);
    * ``chat_template``: format prompts with the directory's chat template (True, when it has
      one), as they are (False), or with this Jinja template (a string). Causal LMs and VLMs;
    * ``gradient_checkpointing``: non-reentrant activation checkpointing of the HF model;
    * ``lora``: LoRA adapters (:mod:`nodes.models.lora`), initialized from ``seed``;
    * ``image_dim``, ``num_prefix_tokens``: a causal LM becomes a :class:`PrefixVLM` around
      it, with a fresh projector (``image_dim`` -> ``num_prefix_tokens`` prefix embeddings)
      seeded by ``seed``, so the user's text LM reads image embeddings from a vision tower.
      Without ``image_dim`` a causal LM is an :class:`HFCausalPolicy`; a saved prefix-VLM
      takes only its own ``image_dim`` and a VLM none (it has its own vision tower).
    """
    fn = "load_policy"
    check_path_options(
        {
            "dtype": dtype,
            "chat_template": chat_template,
            "image_dim": image_dim,
            "num_prefix_tokens": num_prefix_tokens,
            "seed": seed,
        },
        fn,
    )
    family = model_family(path)
    with seeded(int(seed)):
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
                path, dtype=dtype, use_chat_template=chat_template is not False
            )
        else:
            policy = HFCausalPolicy.from_pretrained(
                path, dtype=dtype, use_chat_template=chat_template is not False
            )
            if image_dim is not None:
                prefix = PrefixVLM(policy.model, policy.tokenizer, image_dim, num_prefix_tokens)
                policy = prefix.to(getattr(torch, dtype)).eval()
        return configure_policy(
            policy,
            gradient_checkpointing=gradient_checkpointing,
            lora=lora,
            chat_template=chat_template if isinstance(chat_template, str) else None,
        ).eval()
