"""Which names a weight update carries into vLLM: the names of the Hugging Face checkpoint.

A vLLM model class's ``load_weights`` reads the tensor names of the checkpoint it was
started from (what ``save_pretrained`` writes) and maps them to its own parameters itself
(``hf_to_vllm_mapper``, stacked q/k/v and gate/up projections). A weight update must
therefore speak the checkpoint's names, not the names of the policy wrapper that holds the
HF model (``HFVisionLanguagePolicy.model`` makes every name start with ``model.``). The mapping
here strips the wrapper's attribute and reverts the renaming transformers does on save;
tests check it against the tensor names of a saved checkpoint, so a transformers release that
renames differently is caught.

A prefix-VLM (a Linear projector in front of an LM) has no vLLM model class, and a LoRA
policy's names are peft's: both are refused with a clear error.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from torch import Tensor, nn

__all__ = ["checkpoint_items", "hf_model_of"]


def hf_model_of(policy: nn.Module, who: str = "vLLM") -> tuple[str, nn.Module]:
    """``(attribute, model)``: the transformers model a policy wraps, for serving with vLLM."""
    from transformers import PreTrainedModel

    if getattr(policy, "has_lora", False):
        raise ValueError(
            f"{who}: a LoRA policy's weights are peft's (base_model.model...lora_A); the vLLM "
            "rollout takes a full model: train without lora_r, or use rollout=hf"
        )
    for attribute in ("model", "lm", "hf_model"):
        model = getattr(policy, attribute, None)
        if isinstance(model, PreTrainedModel) and not hasattr(policy, "projector"):
            return attribute, model
    raise ValueError(
        f"{who}: {type(policy).__name__} is not a transformers model vLLM can serve (a prefix-VLM "
        "has its own projector); use a causal LM or an image-text-to-text checkpoint, or rollout=hf"
    )


def checkpoint_items(
    policy: nn.Module, weights: Mapping[str, Tensor], who: str = "vLLM"
) -> Iterator[tuple[str, Tensor]]:
    """``(checkpoint name, tensor)`` for each policy weight in ``weights`` (policy names, as a
    weight sync sends them): the wrapper's attribute stripped, then transformers' own renaming
    on save reverted (``revert_weight_conversion``: Qwen2-VL's ``model.language_model.*`` is
    saved as ``model.*``, ``model.visual.*`` as ``visual.*``). A name outside the wrapped model
    is a ValueError."""
    from transformers.core_model_loading import revert_weight_conversion

    attribute, model = hf_model_of(policy, who)
    prefix = attribute + "."
    own: dict[str, Tensor] = {}
    for name, tensor in weights.items():
        if not name.startswith(prefix):
            raise ValueError(
                f"{who}: weight {name!r} is not part of the served model ({prefix}...); only "
                "the transformers model's weights can go into the engine"
            )
        own[name[len(prefix) :]] = tensor
    yield from revert_weight_conversion(model, own).items()
