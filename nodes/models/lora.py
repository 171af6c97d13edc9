"""LoRA adapters (peft) on a policy's transformers model.

A lora spec is ``{"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}``
(``target_modules`` may also be a list of module names such as ``["q_proj", "v_proj"]``).
:func:`apply_lora` wraps the policy's HF model (``policy.model``, or ``policy.lm`` for a
prefix-VLM) with peft and freezes it, so only the adapter's parameters train (a prefix-VLM's
projector, which is no part of the HF model, stays trainable). The parameter names depend
only on the spec, so two builds of one spec exchange state dicts. ``Policy.save_pretrained``
saves a merged copy (:func:`merged_copy`), which the plain Auto classes load.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["LORA_KEYS", "apply_lora", "check_lora_spec", "is_lora_model", "merged_copy"]

#: the keys of a lora spec and their defaults
LORA_KEYS: dict[str, Any] = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}


def check_lora_spec(spec: Any, who: str = "lora") -> dict[str, Any]:
    """The spec with its defaults filled in, or one ValueError saying what is wrong."""
    if not isinstance(spec, Mapping):
        raise ValueError(
            f"{who}: a lora spec is a dict like {LORA_KEYS!r}, got {type(spec).__name__}"
        )
    unknown = sorted(set(spec) - set(LORA_KEYS))
    if unknown:
        raise ValueError(f"{who}: unknown lora key(s) {unknown}; valid keys: {sorted(LORA_KEYS)}")
    out = {**LORA_KEYS, **spec}
    r, alpha, dropout, targets = out["r"], out["alpha"], out["dropout"], out["target_modules"]
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{who}: lora r={r!r}; give an integer >= 1 (the adapter rank)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"{who}: lora alpha={alpha!r}; give a number > 0 (scale = alpha / r)")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"{who}: lora dropout={dropout!r}; give a number in [0, 1)")
    names_ok = (
        isinstance(targets, (list, tuple))
        and targets
        and all(isinstance(t, str) and t for t in targets)
    )
    if targets != "all-linear" and not names_ok:
        raise ValueError(
            f"{who}: lora target_modules={targets!r}; give 'all-linear' or a list of module "
            "names such as ['q_proj', 'v_proj']"
        )
    out["target_modules"] = targets if targets == "all-linear" else list(targets)
    return out


def is_lora_model(model: nn.Module) -> bool:
    """Whether ``model`` is a peft model (an HF model with adapters)."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def apply_lora(policy: nn.Module, spec: Mapping[str, Any]) -> nn.Module:
    """Wrap the policy's HF model with LoRA adapters in place; returns the policy.

    Only the adapter parameters of the HF model stay trainable. Initialization draws from the
    global generator (``build_policy`` seeds it from the spec)."""
    from peft import LoraConfig, get_peft_model

    who = f"{type(policy).__name__} lora"
    spec = check_lora_spec(spec, who)
    attribute = policy._hf_attribute
    model = getattr(policy, attribute)
    if is_lora_model(model):
        raise ValueError(f"{who}: the policy already has LoRA adapters; apply a lora spec once")
    config = LoraConfig(
        r=spec["r"],
        lora_alpha=spec["alpha"],
        lora_dropout=float(spec["dropout"]),
        target_modules=spec["target_modules"],
        # GPT-2's Conv1D stores its weight transposed
        fan_in_fan_out=getattr(model.config, "model_type", "") == "gpt2",
    )
    try:
        wrapped = get_peft_model(model, config)
    except ValueError as exc:
        why = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(
            f"{who}: peft refused target_modules={spec['target_modules']!r} ({why}); name "
            "modules the model has, or use 'all-linear'"
        ) from exc
    setattr(policy, attribute, wrapped)
    for name, param in wrapped.named_parameters():
        param.requires_grad_("lora_" in name)
    return policy


def merged_copy(model: nn.Module) -> nn.Module:
    """A plain HF model with the adapters merged in (a copy; ``model`` is unchanged)."""
    return copy.deepcopy(model).merge_and_unload()
