"""transformers' text causal LMs (GPT-2, Llama, Qwen2, ...) as a policy family.

See :mod:`nodes.models.policy_base` for the interface every family implements.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nodes.chat import chat_messages, needs_template
from nodes.models.files import _load_pretrained, _load_tokenizer, _no_bars, save_tokenizer
from nodes.models.policy_base import (
    TINY_MARK,
    Policy,
    PromptBatch,
    _check_response,
    _suppress,
    char_tokenizer,
    word_tokenizer,
)
from nodes.seeding import seeded

__all__ = [
    "TINY_ARCHS",
    "HFCausalPolicy",
    "tiny_causal_lm",
    "tiny_gpt2",
    "tiny_llama",
    "tiny_qwen2",
]

#: the architectures :func:`tiny_causal_lm` builds
TINY_ARCHS = ("gpt2", "llama", "qwen2")


class HFCausalPolicy(Policy):
    """A transformers causal LM (``AutoModelForCausalLM``) with its tokenizer; text only.

    Prompts are formatted with the tokenizer's chat template (one user turn, then the generation
    prompt) when it has one and ``use_chat_template``, else tokenized as they are. Prompts are
    left-padded (pad = EOS when the tokenizer has no pad token, as for GPT-2), and the
    teacher-forced forward uses position ids that skip the padding, as ``generate`` does.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, use_chat_template: bool = True):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        self.use_chat_template = bool(use_chat_template)
        self.hidden_size = int(model.config.get_text_config().hidden_size)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])

    # --- inputs ------------------------------------------------------------------------------
    @property
    def _templated(self) -> bool:
        return self.use_chat_template and bool(getattr(self.tokenizer, "chat_template", None))

    def _format(self, prompt: Any) -> str:
        messages = chat_messages(prompt)
        if not self._templated:
            if messages is not None:
                why = "its tokenizer has none" if self.use_chat_template else "chat_template=false"
                raise needs_template(why)
            return prompt
        return self.tokenizer.apply_chat_template(
            messages or [{"role": "user", "content": prompt}], tokenize=False,
            add_generation_prompt=True,
        )  # fmt: skip

    @staticmethod
    def _text_only(fn: str, images: Any, image_embeds: Any) -> None:
        if images is not None or image_embeds is not None:
            given = "images" if images is not None else "image_embeds"
            raise ValueError(
                f"{fn}: got {given}, but a causal LM reads text only; give a prefix-VLM "
                "(load_policy(dir, image_dim=D)) or an image-text-to-text model for images"
            )

    def encode_prompts(self, prompts, *, images=None, image_embeds=None) -> PromptBatch:
        self._text_only("HFCausalPolicy.encode_prompts", images, image_embeds)
        texts = [self._format(p) for p in prompts]
        # a chat template writes its own BOS; without one the tokenizer adds what it adds
        enc = self.tokenizer(
            texts, return_tensors="pt", padding=True, add_special_tokens=not self._templated
        )
        return PromptBatch(enc["input_ids"].long(), enc["attention_mask"].long())

    def prepare(self, prompt_ids, prompt_mask, *, images=None, image_embeds=None) -> PromptBatch:
        self._text_only("HFCausalPolicy.prepare", images, image_embeds)
        return PromptBatch(prompt_ids.long(), prompt_mask.long())

    # --- model -------------------------------------------------------------------------------
    def forward_response(self, batch, response_ids, response_mask, *, logits=True, hidden=False):
        _check_response("HFCausalPolicy.forward_response", batch, response_ids, response_mask)
        real = response_mask.to(self.device) > 0  # (B, R)
        return self._token_pass(batch, response_ids, real, logits, hidden)

    def forward_packed_logits(self, batch, response_ids: Tensor, real: Tensor) -> Tensor:
        """:meth:`forward_response`'s logits with the rows packed into one sequence and no
        padding: each row's prompt and real response tokens, one after another, position ids
        restarting at each row, no attention mask (transformers then keeps each row's
        attention to its own tokens). Only the positions that predict response tokens reach
        the LM head. float[B, R, V], zero where ``real`` (bool[B, R]) is False."""
        dev = self.device
        prompt_real = batch.prompt_mask.to(dev).bool()  # (B, P)
        real = real.to(dev)
        B, R = response_ids.shape
        pieces, positions, keep = [], [], []
        offset = 0
        for b in range(B):
            row = torch.cat([batch.prompt_ids[b].to(dev)[prompt_real[b]],
                             response_ids[b].to(dev)[real[b]]])  # fmt: skip
            p, n = int(prompt_real[b].sum()), int(real[b].sum())
            pieces.append(row)
            positions.append(torch.arange(len(row), device=dev))
            # position p-1+k predicts the row's k-th real response token
            keep.append(offset + p - 1 + torch.arange(n, device=dev))
            offset += len(row)
        ids = torch.cat(pieces)[None]  # (1, T)
        kept = torch.cat(keep)  # (K,) K = real response tokens
        out = self.model(input_ids=ids, position_ids=torch.cat(positions)[None],
                         logits_to_keep=kept, use_cache=False)  # fmt: skip
        logits = out.logits[0]  # (K, V)
        full = logits.new_zeros(B, R, logits.shape[-1])  # (B, R, V)
        full[real] = logits  # row-major order, as kept was built
        return _suppress(full, self.suppressed_token_ids)

    # --- files -------------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        """``model.save_pretrained`` + ``tokenizer.save_pretrained`` into one directory, which
        ``AutoModelForCausalLM`` and ``AutoTokenizer`` load and :func:`load_policy` reads back
        (a LoRA policy is saved merged; a tiny policy's tokenizer, built in code, loads as it
        is: :func:`nodes.models.files.save_tokenizer`)."""
        with _no_bars():
            self._export_model().save_pretrained(path)
        tiny = bool(getattr(self.model.config, TINY_MARK, False))
        save_tokenizer(self.tokenizer, path, built_in_code=tiny)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: str = "float32", use_chat_template: bool = True
    ) -> HFCausalPolicy:
        """Load a causal LM and its tokenizer from a local directory (never downloads)."""
        fn = "HFCausalPolicy.from_pretrained"
        model, tokenizer = _load_pretrained(
            fn, path, "AutoModelForCausalLM", dtype, _load_tokenizer
        )
        return cls(model, tokenizer, use_chat_template=use_chat_template).eval()


def _tiny_config(
    arch: str,
    tokenizer: Any,
    hidden_size: int,
    num_layers: int,
    heads: int = 4,
    positions: int = 512,
) -> Any:
    """The config of a random ``arch`` model over ``tokenizer`` (dropout off, marked tiny)."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.eos_token_id,
        TINY_MARK: True,
    }
    if arch == "gpt2":
        # no dropout: a PPO ratio must compare the same function in rollout and update
        return GPT2Config(
            n_layer=num_layers,
            n_embd=hidden_size,
            n_head=heads,
            n_positions=positions,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **ids,
        )
    config_class = LlamaConfig if arch == "llama" else Qwen2Config
    return config_class(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        **ids,
    )


def tiny_causal_lm(
    arch: str = "gpt2",
    seed: int = 0,
    words: Sequence[str] | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    chat_template: str | None = None,
) -> HFCausalPolicy:
    """A random GPT-2, Llama or Qwen2 (2 layers, 64 dims) with a tokenizer made in code: the
    character tokenizer, or a word-level one over ``words``. Same seed, same weights.

    ``chat_template`` (a Jinja string) is set on the tokenizer, so prompts are formatted as
    one user turn and it is saved with the model; by default the tokenizer has none."""
    from transformers import AutoModelForCausalLM

    if arch not in TINY_ARCHS:
        raise ValueError(f"tiny_causal_lm: arch={arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    if hidden_size < 8 or hidden_size % 8 or num_layers < 1:
        raise ValueError(
            f"tiny_causal_lm: hidden_size={hidden_size}, num_layers={num_layers}; need a "
            "hidden_size that is a multiple of 8 and num_layers >= 1"
        )
    if chat_template is not None and not (isinstance(chat_template, str) and chat_template):
        raise ValueError(
            f"tiny_causal_lm: chat_template={chat_template!r}; give a Jinja template string "
            "(or leave it out)"
        )
    tokenizer = char_tokenizer() if words is None else word_tokenizer(words)
    tokenizer.chat_template = chat_template
    config = _tiny_config(arch, tokenizer, hidden_size, num_layers)
    with seeded(seed):
        model = AutoModelForCausalLM.from_config(config)
    return HFCausalPolicy(model, tokenizer).eval()


tiny_gpt2 = functools.partial(tiny_causal_lm, "gpt2")
tiny_gpt2.__doc__ = """:func:`tiny_causal_lm` with ``arch="gpt2"``."""
tiny_llama = functools.partial(tiny_causal_lm, "llama")
tiny_llama.__doc__ = """:func:`tiny_causal_lm` with ``arch="llama"``."""
tiny_qwen2 = functools.partial(tiny_causal_lm, "qwen2")
tiny_qwen2.__doc__ = """:func:`tiny_causal_lm` with ``arch="qwen2"``."""
