"""Policy models behind one small interface, used by the rollout, reference, critic and update nodes.

Three families implement :class:`Policy`:

* :class:`PrefixVLM` (:mod:`nodes.models.prefix_vlm`): image features (``image_embeds``, from
  :class:`nodes.vision.VisionEncoder`) projected by a Linear into ``k`` prefix embeddings in
  front of the prompt of a transformers causal LM (GPT-2 built from a config in code, or any
  local causal LM: ``load_policy(dir, image_dim=D)``).
* :class:`HFCausalPolicy` (:mod:`nodes.models.hf_causal`): a text causal LM
  (``AutoModelForCausalLM`` + ``AutoTokenizer``; GPT-2, Llama, Qwen2, ...) from a local path,
  or a tiny random one built in code (``"tiny-gpt2"``, ``"tiny-llama"``, ``"tiny-qwen2"``).
* :class:`HFVisionLanguagePolicy` (:mod:`nodes.models.hf_vlm`): transformers' own VLMs
  (``AutoModelForImageTextToText`` + ``AutoProcessor``; Qwen2-VL, Qwen2.5-VL, ...) from a local
  path, or a tiny random Qwen2-VL built in code.

:func:`nodes.models.families.model_family` tells a directory's family (and
:func:`describe_model_dir` says it in one line); LoRA adapters are in
:mod:`nodes.models.lora`. The interface, the batch types and the tokenizers are in
:mod:`nodes.models.policy_base`; this module gathers them and builds policies from specs.

The interface (every method takes and returns batch-first tensors):

* ``encode_prompts(prompts, images=, image_embeds=) -> PromptBatch``: tokenize, left-pad.
* ``prepare(prompt_ids, prompt_mask, images=, image_embeds=) -> PromptBatch``: rebuild a batch
  from the tensors on the rollout's ports (what reference, critic and update nodes receive).
* ``generate(batch, max_new_tokens=, temperature=, top_p=, top_k=, stop_token_ids=, stop_strings=)
  -> Generation``: HF ``generate`` with KV cache; logprobs of the sampled tokens under the
  temperature-scaled policy (see :meth:`Policy.generate`).
* ``forward_response(batch, response_ids, response_mask) -> ResponseForward``: teacher-forced
  logits ``(B, R, V)`` where ``logits[:, t]`` scores ``response_ids[:, t]``, and the trunk's last
  hidden states ``(B, R, H)`` at the same positions (the value-head hook).
* ``forward_logits``, ``response_logprobs``, ``response_hidden_states``: views of the above.
* ``save_pretrained(path)`` / ``load_policy(path)``; ``state_dict``/``load_state_dict`` (it is an
  ``nn.Module``); ``.tokenizer``, ``.hidden_size``, ``.vocab_size``, ``.pad_token_id``,
  ``.eos_token_id``; ``.has_lora`` and ``adapter_disabled()`` (the frozen base of a LoRA policy).

Nodes build policies from JSON-able specs with :func:`build_policy` (a tiny name, a local
directory, or ``{"builder": "module:function", ...kwargs}``). Name and path specs also take
the options ``dtype`` (float32|bfloat16|float16), ``gradient_checkpointing`` (non-reentrant),
``lora`` (:mod:`nodes.models.lora`) and ``chat_template`` (true: the tokenizer's own, false:
none, or a Jinja template string); path specs also ``image_dim``, ``num_prefix_tokens`` and
``seed`` (see :func:`load_policy`). An unknown key is an error that lists the valid ones.
Nothing here downloads: tiny models come from configs and a character tokenizer made in code.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from nodes.models.families import (
    OPTION_KEYS,
    check_model_dir,
    check_model_options,
    check_path_options,
    configure_policy,
    describe_model_dir,
    load_policy,
    model_family,
)
from nodes.models.hf_causal import (
    HFCausalPolicy,
    tiny_causal_lm,
    tiny_gpt2,
    tiny_llama,
    tiny_qwen2,
)
from nodes.models.hf_vlm import HFVisionLanguagePolicy, tiny_qwen2_vl
from nodes.models.policy_base import (
    Generation,
    Policy,
    PromptBatch,
    ResponseForward,
    char_tokenizer,
    word_tokenizer,
)
from nodes.models.prefix_vlm import PrefixVLM, tiny_prefix_vlm
from nodes.seeding import seeded

__all__ = [
    "Generation",
    "HFCausalPolicy",
    "HFVisionLanguagePolicy",
    "Policy",
    "PrefixVLM",
    "PromptBatch",
    "ResponseForward",
    "build_policy",
    "char_tokenizer",
    "check_model_dir",
    "check_policy_spec",
    "describe_model_dir",
    "load_policy",
    "model_family",
    "tiny_causal_lm",
    "tiny_prefix_vlm",
    "tiny_qwen2_vl",
    "word_tokenizer",
]


# ---------------------------------------------------------------------------------------------
# building from JSON-able specs (what nodes take as constructor arguments)
# ---------------------------------------------------------------------------------------------

_BUILDERS = {
    "tiny-prefix-vlm": tiny_prefix_vlm,
    "tiny-qwen2-vl": tiny_qwen2_vl,
    "tiny-gpt2": tiny_gpt2,
    "tiny-llama": tiny_llama,
    "tiny-qwen2": tiny_qwen2,
}
#: the keys of a path spec: 'path' and the keyword arguments of load_policy
_PATH_KEYS = ("path", *sorted(set(inspect.signature(load_policy).parameters) - {"path"}))


def _split_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the options (``nodes.models.families.OPTION_KEYS``) of a name spec out of ``kwargs``."""
    return {key: kwargs.pop(key) for key in OPTION_KEYS if key in kwargs}


def _spec_dict(spec: str | Mapping[str, Any]) -> dict[str, Any]:
    """The spec as a dict with one of 'name', 'path' or 'builder' (checked, not built)."""
    if isinstance(spec, Policy):
        raise ValueError("build_policy: got a live Policy; pass it as model= instead of a spec")
    if isinstance(spec, str):
        spec = {"name": spec} if spec in _BUILDERS else {"path": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"build_policy: spec must be a str or dict, got {type(spec).__name__}")
    kwargs = dict(spec)
    if sum(key in kwargs for key in ("name", "path", "builder")) != 1:
        raise ValueError(
            f"build_policy: spec {kwargs!r} needs one of 'name', 'path' or 'builder' (exactly one)"
        )
    return kwargs


def check_policy_spec(spec: str | Mapping[str, Any]) -> None:
    """Check a :func:`build_policy` spec without building anything (what a node's constructor
    does): a known tiny builder with arguments it takes, a local directory of a supported
    family, or a ``"module:function"`` builder reference; option values are checked too.
    Raises ValueError saying what is wrong."""
    kwargs = _spec_dict(spec)
    if "name" in kwargs:
        name = kwargs.pop("name")
        if name not in _BUILDERS:
            raise ValueError(f"build_policy: unknown name {name!r}; known: {sorted(_BUILDERS)}")
        check_model_options(_split_options(kwargs), f"build_policy {name!r}")
        params = inspect.signature(_BUILDERS[name]).parameters
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            valid = sorted({"name", *params, *OPTION_KEYS})
            raise ValueError(
                f"build_policy: {name!r} takes no key(s) {unknown}; valid keys: {valid}"
            )
        try:
            inspect.signature(_BUILDERS[name]).bind(**kwargs)
        except TypeError as exc:
            raise ValueError(f"build_policy: {name!r} {exc}; spec {dict(spec)!r}") from None
    elif "path" in kwargs:
        unknown = sorted(set(kwargs) - set(_PATH_KEYS))
        if unknown:
            raise ValueError(
                f"build_policy: a path spec takes no key(s) {unknown}; valid keys: "
                f"{sorted(_PATH_KEYS)}"
            )
        check_path_options(kwargs, "build_policy")
        check_model_dir(kwargs["path"], "build_policy")  # a whole folder of a family we load
    else:
        module, sep, qualname = str(kwargs["builder"]).partition(":")
        if not (sep and module and qualname):
            raise ValueError(
                f"build_policy: builder {kwargs['builder']!r} must be 'package.module:function'"
            )


def build_policy(spec: str | Mapping[str, Any]) -> Policy:
    """Build a policy from a JSON-able spec.

    * ``"tiny-prefix-vlm"``, ``"tiny-qwen2-vl"``, ``"tiny-gpt2"``, ``"tiny-llama"``,
      ``"tiny-qwen2"``: the tiny builders with their defaults;
    * ``{"name": "tiny-qwen2", "seed": 1, "words": [...], "lora": {...}}``: a tiny builder with
      keyword arguments, plus the options (dtype, gradient_checkpointing, lora, chat_template);
    * ``"/local/dir"`` or ``{"path": "/local/dir", "dtype": "bfloat16"}``: :func:`load_policy`;
    * ``{"builder": "package.module:function", ...}``: any function returning a Policy.
    """
    kwargs = _spec_dict(spec)
    # Seeded from the spec and isolated from the global generator: a build gives the same
    # weights whatever was built before it, and leaves the global state as it found it.
    with seeded(int(kwargs.get("seed", 0))):
        return _build(kwargs, spec)


def _build(kwargs: dict[str, Any], spec: str | Mapping[str, Any]) -> Policy:
    check_policy_spec(spec)
    if "name" in kwargs:
        options = _split_options(kwargs)
        policy = _BUILDERS[kwargs.pop("name")](**kwargs)
        return configure_policy(policy, **options)
    if "path" in kwargs:
        return load_policy(kwargs.pop("path"), **kwargs)
    builder = kwargs.pop("builder")
    module, _, qualname = str(builder).partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    policy = obj(**kwargs)
    if not isinstance(policy, Policy):
        raise ValueError(
            f"build_policy: builder {builder!r} returned {type(policy).__name__}, not a Policy"
        )
    return policy
