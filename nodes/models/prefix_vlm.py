"""The prefix-VLM policy family: image features projected into prefix embeddings of a causal LM.

See :mod:`nodes.models.policy_base` for the interface every family implements.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nodes.chat import chat_messages, needs_template
from nodes.models.files import (
    _check_safetensors,
    _load_pretrained,
    _load_tokenizer,
    _loading,
    _no_bars,
    _read_json,
    save_tokenizer,
)
from nodes.models.hf_causal import _tiny_config
from nodes.models.policy_base import (
    _PREFIX_MARKER,
    TINY_MARK,
    Policy,
    PromptBatch,
    _check_response,
    _positions,
    char_tokenizer,
    word_tokenizer,
)
from nodes.seeding import seeded
from yatt_graph import UsageError

__all__ = ["PrefixVLM", "check_prefix_files", "tiny_prefix_vlm"]


class PrefixVLM(Policy):
    """A causal LM that reads ``k`` projected image-feature embeddings before the prompt.

    Sequence layout, per row: ``[prefix (k) | left pad | prompt | response | right pad]`` with
    attention mask 0 on padding and position ids that skip it (``cumsum(mask) - 1``, the rule
    ``generate`` uses), so teacher-forced and cached generation see identical positions.
    Without ``image_embeds`` it is a plain text policy (no prefix).
    """

    _hf_attribute = "lm"

    def __init__(self, lm: nn.Module, tokenizer: Any, image_dim: int, num_prefix_tokens: int = 4):
        super().__init__()
        if image_dim < 1 or num_prefix_tokens < 1:
            raise ValueError(
                f"PrefixVLM: image_dim={image_dim}, num_prefix_tokens={num_prefix_tokens}; "
                "both must be >= 1"
            )
        self.lm = lm
        self.tokenizer = tokenizer
        tokenizer.padding_side = "left"
        self.image_dim = int(image_dim)
        self.num_prefix_tokens = int(num_prefix_tokens)
        self.hidden_size = int(lm.config.get_text_config().hidden_size)
        self.vocab_size = int(lm.get_output_embeddings().weight.shape[0])
        self.projector = nn.Linear(self.image_dim, self.num_prefix_tokens * self.hidden_size)

    # --- inputs ------------------------------------------------------------------------------
    def _check_embeds(self, fn: str, image_embeds: Tensor | None, n: int) -> None:
        if image_embeds is None:
            return
        if image_embeds.dim() != 2 or image_embeds.shape != (n, self.image_dim):
            raise ValueError(
                f"{fn}: image_embeds has shape {tuple(image_embeds.shape)}; expected ({n}, "
                f"{self.image_dim}) (one row per prompt, D = the encoder's embed_dim)"
            )

    def encode_prompts(self, prompts, *, images=None, image_embeds=None) -> PromptBatch:
        if images is not None:
            raise ValueError(
                "PrefixVLM.encode_prompts: takes image_embeds (from a VisionEncoder), not images"
            )
        self._check_embeds("PrefixVLM.encode_prompts", image_embeds, len(prompts))
        if any(chat_messages(p) is not None for p in prompts):
            raise needs_template("a prefix-VLM has none")
        enc = self.tokenizer(list(prompts), return_tensors="pt", padding=True)
        return self.prepare(enc["input_ids"], enc["attention_mask"], image_embeds=image_embeds)

    def prepare(self, prompt_ids, prompt_mask, *, images=None, image_embeds=None) -> PromptBatch:
        if images is not None:
            raise ValueError("PrefixVLM.prepare: takes image_embeds, not images")
        self._check_embeds("PrefixVLM.prepare", image_embeds, prompt_ids.shape[0])
        extra = {} if image_embeds is None else {"image_embeds": image_embeds.float()}
        return PromptBatch(prompt_ids.long(), prompt_mask.long(), extra)

    def prompt_positions(self, batch: PromptBatch) -> Tensor:
        """The prompt's tokens and, with image embeddings, the k prefix positions: int64[B]."""
        k = self.num_prefix_tokens if "image_embeds" in batch.model_inputs else 0
        return batch.prompt_mask.sum(1) + k

    def _prompt_embeds(self, batch: PromptBatch) -> tuple[Tensor, Tensor]:
        """Embeddings and mask of ``[prefix | prompt]``: float[B, k+P, H], int64[B, k+P]."""
        dev = self.device
        tok = self.lm.get_input_embeddings()(batch.prompt_ids.to(dev))  # (B, P, H)
        mask = batch.prompt_mask.to(dev)  # (B, P)
        feats = batch.model_inputs.get("image_embeds")
        if feats is None:
            return tok, mask
        B = tok.shape[0]
        w = self.projector.weight
        prefix = self.projector(feats.to(dev, w.dtype))  # (B, k*H)
        prefix = prefix.view(B, self.num_prefix_tokens, self.hidden_size).to(tok.dtype)  # (B, k, H)
        ones = mask.new_ones(B, self.num_prefix_tokens)  # (B, k)
        return torch.cat([prefix, tok], 1), torch.cat([ones, mask], 1)  # (B, k+P, H), (B, k+P)

    # --- model -------------------------------------------------------------------------------
    def forward_response(self, batch, response_ids, response_mask, *, logits=True, hidden=False):
        _check_response("PrefixVLM.forward_response", batch, response_ids, response_mask)
        dev = self.device
        prompt_emb, prompt_mask = self._prompt_embeds(batch)  # (B, L, H), (B, L)
        resp_ids = torch.where(response_mask.to(dev) > 0, response_ids.to(dev), self.pad_token_id)
        resp_emb = self.lm.get_input_embeddings()(resp_ids)  # (B, R, H)
        embeds = torch.cat([prompt_emb, resp_emb], 1)  # (B, L+R, H)
        mask = torch.cat([prompt_mask, (response_mask.to(dev) > 0).long()], 1)  # (B, L+R)
        return self._response_pass(
            self.lm,
            response_ids.shape[1],
            logits,
            hidden,
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=_positions(mask),
        )

    def _generate_raw(self, batch, gen_config, **kwargs) -> Tensor:
        embeds, mask = self._prompt_embeds(batch)  # (B, L, H), (B, L)
        out = self.lm.generate(
            inputs_embeds=embeds, attention_mask=mask, generation_config=gen_config, **kwargs
        )
        return out.sequences  # (B, R): with inputs_embeds only, generate returns new tokens only

    # --- files -------------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        """Write a directory that :meth:`from_pretrained` and ``load_policy`` read back:

        * ``lm/``: the causal LM (``model.save_pretrained``, LoRA adapters merged into a copy)
          and its tokenizer, a plain transformers checkpoint that ``AutoModelForCausalLM``
          loads on its own (the text LM without the image prefix);
        * the tokenizer's files again, so that ``AutoTokenizer.from_pretrained(path)`` gives
          it (:func:`nodes.models.files.save_tokenizer`);
        * ``projector.safetensors``: the Linear from image features to prefix embeddings
          (``weight`` float[k*H, D], ``bias`` float[k*H]);
        * ``prefix_vlm.json``: ``{"image_dim": D, "num_prefix_tokens": k}``, the marker that
          ``model_family`` recognises as ``"prefix-vlm"``.
        """
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with _no_bars():
            self._export_model().save_pretrained(path / "lm")
        tiny = bool(getattr(self.lm.config, TINY_MARK, False))
        save_tokenizer(self.tokenizer, path / "lm", built_in_code=tiny)
        save_tokenizer(self.tokenizer, path, built_in_code=tiny)
        save_file(
            {k: v.contiguous() for k, v in self.projector.state_dict().items()},
            path / "projector.safetensors",
        )
        (path / _PREFIX_MARKER).write_text(
            json.dumps(
                {"image_dim": self.image_dim, "num_prefix_tokens": self.num_prefix_tokens}, indent=1
            )
        )

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str = "float32") -> PrefixVLM:
        """Load what :meth:`save_pretrained` wrote (local files only)."""
        from safetensors.torch import load_file

        fn = "PrefixVLM.from_pretrained"
        path = Path(path)
        meta = check_prefix_files(fn, path)
        projector = path / "projector.safetensors"
        policy = cls.from_lm(path / "lm", meta["image_dim"], meta["num_prefix_tokens"], dtype=dtype)
        with _loading(fn, projector):
            policy.projector.load_state_dict(load_file(projector))
        return policy

    @classmethod
    def from_lm(
        cls,
        lm_path: str | Path,
        image_dim: int,
        num_prefix_tokens: int = 4,
        *,
        dtype: str = "float32",
    ) -> PrefixVLM:
        """A local HF causal LM and its tokenizer, with a fresh projector."""
        fn = "PrefixVLM.from_lm"
        lm, tokenizer = _load_pretrained(
            fn, lm_path, "AutoModelForCausalLM", dtype, _load_tokenizer
        )
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return cls(lm, tokenizer, image_dim, num_prefix_tokens)


def check_prefix_files(fn: str, path: Path) -> dict[str, Any]:
    """What a saved prefix-VLM's own files hold (``prefix_vlm.json``'s integers), checked with
    ``projector.safetensors`` (present, its header readable) before anything loads; each
    failure is one UsageError naming the file. The ``lm/`` checkpoint is checked on its own."""
    marker = path / _PREFIX_MARKER
    meta = _read_json(fn, marker, "saved PrefixVLM")
    for key in ("image_dim", "num_prefix_tokens"):
        if not isinstance(meta.get(key), int) or isinstance(meta.get(key), bool):
            raise UsageError(
                f"{fn}: {str(marker)!r} needs an integer {key!r} (got {meta.get(key)!r}); "
                "it is written by PrefixVLM.save_pretrained"
            )
    projector = path / "projector.safetensors"
    if not projector.is_file():
        raise UsageError(
            f"{fn}: {str(projector)!r} is missing (the image projector of the prefix-VLM in "
            f"{str(path)!r}); copy it there too, or save the policy again"
        )
    _check_safetensors(fn, projector, "policy")
    return meta


def tiny_prefix_vlm(
    seed: int = 0,
    image_dim: int = 32,
    num_prefix_tokens: int = 2,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_positions: int = 256,
    words: Sequence[str] | None = None,
) -> PrefixVLM:
    """A random GPT-2 (2 layers, 64 dims) + tokenizer + projector; same seed, same weights.

    The tokenizer is character-level, or word-level over ``words`` when they are given.
    """
    from transformers import GPT2LMHeadModel

    tokenizer = char_tokenizer() if words is None else word_tokenizer(words)
    config = _tiny_config("gpt2", tokenizer, n_embd, n_layer, n_head, n_positions)
    with seeded(seed):
        policy = PrefixVLM(GPT2LMHeadModel(config), tokenizer, image_dim, num_prefix_tokens)
    return policy.eval()
