"""What every policy family shares: the :class:`Policy` interface (its batch and result types
in :mod:`nodes.models.policy_types`), the offline tokenizers and the helpers for generation. :mod:`nodes.models.policy` is the
public face (it also builds policies from specs); the families live in
:mod:`nodes.models.prefix_vlm`, :mod:`nodes.models.hf_causal` and :mod:`nodes.models.hf_vlm`.
"""

from __future__ import annotations

import contextlib
import string
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nodes.models.files import config_positions
from nodes.models.policy_types import Generation, PromptBatch, ResponseForward
from nodes.rl.losses import logprobs_from_logits

__all__ = [
    "Generation",
    "Policy",
    "PromptBatch",
    "ResponseForward",
    "char_tokenizer",
    "load_checked",
    "word_tokenizer",
]

_PREFIX_MARKER = "prefix_vlm.json"
#: special tokens of :func:`char_tokenizer`, in vocabulary order
_CHAR_SPECIALS = ("<pad>", "<eos>", "<unk>")
_QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# A chat template for the tiny Qwen2-VL processor: the image placeholder, then the prompt text.
_TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endfor %}"
)


# ---------------------------------------------------------------------------------------------
# a tokenizer that works offline
# ---------------------------------------------------------------------------------------------


TINY_MARK = "yatt_tiny"
"""A key the tiny models built in code write into their ``config.json`` (saved and exported
with them): a directory that has it holds one of this project's toy models, not a user's."""


def char_tokenizer(extra_special_tokens: Sequence[str] = ()) -> Any:
    """A character-level ``PreTrainedTokenizerFast`` built in code (no download).

    Vocabulary: ``<pad>`` (0), ``<eos>`` (1), ``<unk>`` (2), then ``extra_special_tokens``, then
    the printable ASCII characters. Pads on the left (prompts are left-padded).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = _specials(extra_special_tokens)
    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return _fast_tokenizer(backend, specials)


def word_tokenizer(words: Sequence[str], extra_special_tokens: Sequence[str] = ()) -> Any:
    """A word-level ``PreTrainedTokenizerFast`` over ``words`` (split on whitespace; no download).

    Vocabulary: ``<pad>`` (0), ``<eos>`` (1), ``<unk>`` (2), then ``extra_special_tokens`` (found
    anywhere in a text, e.g. a VLM's image placeholders), then ``words`` in order. Small task
    vocabularies make one answer one token, which a tiny policy can find by sampling.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = _specials(extra_special_tokens)
    vocab = {tok: i for i, tok in enumerate(specials)}
    for word in words:
        if not word or any(c.isspace() for c in word):
            raise ValueError(f"word_tokenizer: {word!r} is not a single word")
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # joins words with spaces, and no more: text it decodes encodes back to the same ids
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return _fast_tokenizer(backend, specials)


def _specials(extra: Sequence[str]) -> list[str]:
    """``<pad>``, ``<eos>``, ``<unk>``, then the ``extra`` special tokens not among them."""
    return list(_CHAR_SPECIALS) + [t for t in extra if t not in _CHAR_SPECIALS]


def _fast_tokenizer(backend: Any, specials: list[str]) -> Any:
    """``backend`` (a ``tokenizers.Tokenizer`` whose vocabulary starts with ``specials``) as a
    left-padding ``PreTrainedTokenizerFast`` that knows its special tokens."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
    if len(specials) > len(_CHAR_SPECIALS):
        tok.add_special_tokens({"additional_special_tokens": specials[len(_CHAR_SPECIALS) :]})
    return tok


# ---------------------------------------------------------------------------------------------
# the common interface
# ---------------------------------------------------------------------------------------------


class Policy(nn.Module):
    """The interface shared by :class:`PrefixVLM`, :class:`HFCausalPolicy` and
    :class:`HFVisionLanguagePolicy`."""

    tokenizer: Any
    hidden_size: int
    vocab_size: int
    suppressed_token_ids: tuple[int, ...] = ()
    """Tokens the policy never emits (e.g. image placeholders, which would break a teacher-forced
    forward): ``generate`` bans them and ``forward_response`` gives them -inf logits, so both
    describe the same distribution."""
    _hf_attribute: str = "model"
    """The attribute holding the transformers model (what LoRA wraps and export saves)."""

    @property
    def has_lora(self) -> bool:
        """Whether the policy's HF model carries LoRA adapters (:mod:`nodes.models.lora`)."""
        from nodes.models.lora import is_lora_model

        return is_lora_model(getattr(self, self._hf_attribute))

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[Policy]:
        """Within the block the policy computes with its frozen base model (adapters off):
        a LoRA policy's reference model for free."""
        if not self.has_lora:
            raise ValueError(
                f"{type(self).__name__}.adapter_disabled: the policy has no LoRA adapters; "
                "build it with a 'lora' spec key, or use a separate reference policy"
            )
        with getattr(self, self._hf_attribute).disable_adapter():
            yield self

    def _export_model(self) -> nn.Module:
        """The HF model to save: itself, or a merged copy for a LoRA policy."""
        model = getattr(self, self._hf_attribute)
        if self.has_lora:
            from nodes.models.lora import merged_copy

            return merged_copy(model)
        return model

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def context_length(self) -> int | None:
        """Positions one sequence may take (image tokens, prompt and response), from the
        model's config (``max_position_embeddings`` or ``n_positions``); None if it names none."""
        return config_positions(getattr(self, self._hf_attribute).config)

    def prompt_positions(self, batch: PromptBatch) -> Tensor:
        """Positions each row's prompt takes (its tokens, image placeholders included): int64[B]."""
        return batch.prompt_mask.sum(1)

    # --- to implement ----------------------------------------------------------------------
    def encode_prompts(
        self,
        prompts: Sequence[str],
        *,
        images: Sequence[Any] | None = None,
        image_embeds: Tensor | None = None,
    ) -> PromptBatch:
        """Tokenize ``prompts`` (left-padded) with one image or image-embedding row each."""
        raise NotImplementedError

    def prepare(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        *,
        images: Sequence[Any] | None = None,
        image_embeds: Tensor | None = None,
    ) -> PromptBatch:
        """Rebuild the batch :meth:`encode_prompts` made from its ``prompt_ids``/``prompt_mask``
        (int64[B, P]) and the same image inputs (what downstream nodes receive on ports)."""
        raise NotImplementedError

    def forward_response(
        self,
        batch: PromptBatch,
        response_ids: Tensor,
        response_mask: Tensor,
        *,
        logits: bool = True,
        hidden: bool = False,
    ) -> ResponseForward:
        """One teacher-forced pass over ``[prompt | response]``; see :class:`ResponseForward`.

        ``response_ids`` int64[B, R] is right-padded; positions where ``response_mask`` is 0 are
        neither read nor scored. Differentiable (call under ``torch.no_grad()`` for inference).
        """
        raise NotImplementedError

    def _response_pass(
        self, lm: nn.Module, R: int, logits: bool, hidden: bool, **inputs: Any
    ) -> ResponseForward:
        """One teacher-forced pass of ``lm`` over ``inputs`` ([prompt | response], R response
        tokens), at the response positions: position L-1+t predicts response token t, the last
        R+1 positions minus the very last. Without ``logits`` only the backbone runs (a value
        head reads its last hidden state; the LM head's output would be thrown away)."""
        if not logits:
            inner = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # under peft
            out = inner.base_model(**inputs, use_cache=False)
            return ResponseForward(None, out.last_hidden_state[:, -(R + 1) : -1])  # (B, R, H)
        out = lm(**inputs, output_hidden_states=hidden, logits_to_keep=R + 1, use_cache=False)
        return ResponseForward(
            _suppress(out.logits[:, :-1], self.suppressed_token_ids),  # (B, R, V)
            out.hidden_states[-1][:, -(R + 1) : -1] if hidden else None,  # (B, R, H)
        )

    def _token_pass(
        self,
        batch: PromptBatch,
        response_ids: Tensor,
        real: Tensor,
        logits: bool,
        hidden: bool,
        positions: bool = True,
        **inputs: Any,
    ) -> ResponseForward:
        """:meth:`_response_pass` of ``self.model`` over prompt and response token ids (the HF
        families), padding where ``real`` (bool[B, R]) is False; ``inputs`` go to the model,
        with ``positions`` position ids that skip padding (a VLM computes its own)."""
        dev = self.device
        resp_ids = torch.where(real, response_ids.to(dev), self.pad_token_id)  # (B, R)
        ids = torch.cat([batch.prompt_ids.to(dev), resp_ids], 1)  # (B, P+R)
        mask = torch.cat([batch.prompt_mask.to(dev), real.long()], 1)  # (B, P+R)
        if positions:
            inputs["position_ids"] = _positions(mask)
        R = response_ids.shape[1]
        return self._response_pass(
            self.model, R, logits, hidden, input_ids=ids, attention_mask=mask, **inputs
        )

    def _generate_raw(self, batch: PromptBatch, gen_config: Any, **kwargs: Any) -> Tensor:
        """Run ``generate``; return only the new tokens, int64[B, R]. The HF families'
        ``generate`` over the prompt ids; ``kwargs`` go to it."""
        P = batch.prompt_ids.shape[1]
        out = self.model.generate(
            input_ids=batch.prompt_ids.to(self.device),
            attention_mask=batch.prompt_mask.to(self.device),
            generation_config=gen_config,
            **kwargs,
        )
        return out.sequences[:, P:]  # (B, R)

    def save_pretrained(self, path: str | Path) -> None:
        """Write a directory that :func:`load_policy` reads back (local files only)."""
        raise NotImplementedError

    # --- shared ------------------------------------------------------------------------------
    def load_weights(
        self,
        weights: Mapping[str, Tensor],
        *,
        strict: bool = False,
        who: str = "Policy.load_weights",
    ) -> None:
        """:func:`load_checked` into this policy."""
        load_checked(self, weights, strict=strict, who=who)

    def forward_logits(
        self, batch: PromptBatch, response_ids: Tensor, response_mask: Tensor
    ) -> Tensor:
        """Teacher-forced logits float[B, R, V]; ``logits[:, t]`` scores ``response_ids[:, t]``."""
        return self.forward_response(batch, response_ids, response_mask).logits

    def response_logprobs(
        self,
        batch: PromptBatch,
        response_ids: Tensor,
        response_mask: Tensor,
        temperature: float = 1.0,
    ) -> Tensor:
        """Teacher-forced ``log softmax(logits / temperature)`` of each response token.

        Returns float32[B, R], 0 at padding (``response_mask == 0``); differentiable.
        """
        logits = self.forward_logits(batch, response_ids, response_mask)  # (B, R, V)
        if temperature != 1.0:
            logits = logits / temperature  # (B, R, V)
        return logprobs_from_logits(logits, response_ids, response_mask).float()  # (B, R)

    def response_hidden_states(
        self, batch: PromptBatch, response_ids: Tensor, response_mask: Tensor
    ) -> Tensor:
        """The trunk's last hidden state at the positions that predict each response token,
        float[B, R, H] (where a value head reads V(s_t))."""
        out = self.forward_response(batch, response_ids, response_mask, logits=False, hidden=True)
        return out.hidden

    @torch.no_grad()
    def generate(self, batch: PromptBatch, **sampling: Any) -> Generation:
        """Sample responses for the whole batch: :func:`nodes.models.sampling.generate`."""
        from nodes.models.sampling import generate  # (on use: it loads transformers)

        return generate(self, batch, **sampling)

    def generate_stream(
        self, batch: PromptBatch, *, every: int = 1, **sampling: Any
    ) -> Iterator[tuple[list[int], Generation]]:
        """The same samples, handed out as rows finish: :func:`nodes.models.sampling.generate_stream`."""
        from nodes.models.sampling import generate_stream

        return generate_stream(self, batch, every=every, **sampling)


def _suppress(logits: Tensor, token_ids: Sequence[int]) -> Tensor:
    """Set the logits of never-emitted tokens to -inf (as ``generate`` does): float[B, R, V]."""
    if not token_ids:
        return logits
    banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)  # (V,)
    banned[list(token_ids)] = True
    return logits.masked_fill(banned, float("-inf"))  # (B, R, V)


def _positions(mask: Tensor) -> Tensor:
    """Position ids that skip padding, as ``generate`` computes them: int64[B, T]."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)


def _check_response(
    fn: str, batch: PromptBatch, response_ids: Tensor, response_mask: Tensor
) -> None:
    if response_ids.dim() != 2 or response_ids.shape != response_mask.shape:
        raise ValueError(
            f"{fn}: response_ids {tuple(response_ids.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be (B, R)"
        )
    if response_ids.shape[0] != len(batch):
        raise ValueError(
            f"{fn}: {response_ids.shape[0]} responses for {len(batch)} prompts; rows must match"
        )


def load_checked(
    module: nn.Module, weights: Mapping[str, Tensor], *, strict: bool, who: str
) -> None:
    """Load a state dict (a weight-sync payload) into ``module``: names must exist and shapes
    match; with ``strict=False`` it may be partial. Tensors are copied in place, so the
    module's dtype and device are kept."""
    if not isinstance(weights, Mapping):
        raise ValueError(
            f"{who}: weights must be a state dict (name -> tensor), got {type(weights).__name__}"
        )
    own = module.state_dict()
    unknown = sorted(set(weights) - set(own))
    if unknown:
        raise ValueError(
            f"{who}: {len(unknown)} weight name(s) not in this model, e.g. {unknown[:3]}; "
            f"its names look like {sorted(own)[:3]}"
        )
    missing = sorted(set(own) - set(weights))
    if strict and missing:
        raise ValueError(
            f"{who}: a complete update lacks {len(missing)} weight(s), e.g. {missing[:3]}"
        )
    for key, value in weights.items():
        if not isinstance(value, Tensor) or tuple(value.shape) != tuple(own[key].shape):
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"{who}: weight {key!r} is {got}; expected shape {tuple(own[key].shape)}"
            )
    module.load_state_dict(dict(weights), strict=False)
