"""Which names a weight update carries into vLLM: the names of the Hugging Face checkpoint.

A vLLM model class's ``load_weights`` reads the tensor names of the checkpoint it was
started from (what ``save_pretrained`` writes) and maps them to its own parameters itself
(``hf_to_vllm_mapper``; stacked q/k/v and gate/up projections). A weight update must
therefore speak the checkpoint's names, not the names of the policy wrapper that holds the
HF model (``HFVisionLanguagePolicy.model`` and ``HFCausalPolicy.model`` make every name start
with ``model.``). :func:`checkpoint_items` does what ``save_pretrained`` does to a state
dict, for any part of one:

1. strip the wrapper's attribute (``model.``);
2. drop a tied weight that its source also carries (``lm_head.weight`` when the embeddings
   are tied, as ``save_pretrained`` leaves it out), or send it under the source's name when
   the update holds only the tied one;
3. revert transformers' renaming on load (``revert_weight_conversion``: in transformers 5
   Qwen2-VL's ``model.language_model.*`` is saved as ``model.*``, ``model.visual.*`` as
   ``visual.*``).

tests/nodes/test_vllm.py checks the result against the tensor names of saved checkpoints
(tiny Qwen2-VL, tiny Qwen2 tied and untied), so a transformers release that saves under other
names is caught on a CPU. verl does the same step with ``_checkpoint_conversion_mapping``
(``verl/utils/model.py: convert_weight_keys``), which transformers 5 replaced.

A prefix-VLM (a Linear projector in front of an LM) has no vLLM model class, and a LoRA
policy's names are peft's: both are refused with a clear error.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

__all__ = ["checkpoint_items", "hf_model_of"]


def hf_model_of(policy: nn.Module, who: str = "vLLM") -> tuple[str, nn.Module]:
    """``(attribute, model)``: the transformers model a policy wraps, for serving with vLLM.
    Raises ValueError for a prefix-VLM, a LoRA policy or anything else vLLM cannot serve."""
    from transformers import PreTrainedModel

    if hasattr(policy, "projector"):
        raise ValueError(
            f"{who}: {type(policy).__name__} is not a transformers model vLLM can serve (a "
            "prefix-VLM puts its own projector in front of the LM, and vLLM has no model class "
            "for that); use a causal LM or an image-text-to-text checkpoint, or rollout=hf"
        )
    if getattr(policy, "has_lora", False):
        raise ValueError(
            f"{who}: a LoRA policy's weights are peft's (base_model.model...lora_A); the vLLM "
            "rollout takes a full model: train without a lora spec, or use rollout=hf"
        )
    attribute = getattr(policy, "_hf_attribute", "model")
    model = getattr(policy, attribute, None)
    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"{who}: {type(policy).__name__} is not a transformers model vLLM can serve (its "
            f"{attribute!r} is a {type(model).__name__}); use a causal LM or an "
            "image-text-to-text checkpoint, or rollout=hf"
        )
    return attribute, model


def checkpoint_items(
    policy: nn.Module, weights: Mapping[str, Tensor], who: str = "vLLM"
) -> list[tuple[str, Tensor]]:
    """``(checkpoint name, tensor)`` for the policy weights in ``weights`` (policy names, as a
    weight sync sends them; any subset of the state dict): the names ``save_pretrained``
    would write for them (see the module docstring). A name outside the served model is a
    ValueError."""
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
    # {tied name: its source}, only where this model really ties them (config-aware)
    tied: Mapping[str, str] = getattr(model, "all_tied_weights_keys", None) or {}
    for target, source in tied.items():
        if target in own:
            tensor = own.pop(target)
            own.setdefault(source, tensor)
    return list(revert_weight_conversion(model, own).items())
