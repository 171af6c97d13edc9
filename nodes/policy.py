"""Policy models behind one small interface, used by the rollout, reference, critic and update nodes.

Two families implement :class:`Policy`:

* :class:`PrefixVLM`: image features (``image_embeds``, from :class:`nodes.vision.VisionEncoder`)
  projected by a Linear into ``k`` prefix embeddings in front of the prompt of a transformers
  causal LM (GPT-2 built from a config in code, or any local causal LM).
* :class:`HFVisionLanguagePolicy`: transformers' own VLMs (``AutoModelForImageTextToText`` +
  ``AutoProcessor``; Qwen2-VL, Qwen2.5-VL, ...) from a local path, or a tiny random Qwen2-VL
  built in code.

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
  ``.eos_token_id``.

Nodes build policies from JSON-able specs with :func:`build_policy` (``"tiny-prefix-vlm"``,
``"tiny-qwen2-vl"``, a local directory, or ``{"builder": "module:function", ...kwargs}``).
Nothing here downloads: tiny models come from configs and a character tokenizer made in code.
"""

from __future__ import annotations

import importlib
import json
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from nodes.losses import logprobs_from_logits

__all__ = [
    "Generation",
    "HFVisionLanguagePolicy",
    "Policy",
    "PrefixVLM",
    "PromptBatch",
    "ResponseForward",
    "build_policy",
    "char_tokenizer",
    "load_policy",
    "tiny_prefix_vlm",
    "tiny_qwen2_vl",
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
# data passed between the interface's methods
# ---------------------------------------------------------------------------------------------


@dataclass
class PromptBatch:
    """Tokenized prompts plus whatever else the model needs to read them (image inputs)."""

    prompt_ids: Tensor
    """int64[B, P], left-padded with the pad id."""
    prompt_mask: Tensor
    """int64[B, P], 1 on real prompt tokens."""
    model_inputs: dict[str, Tensor] = field(default_factory=dict)
    """Model-specific extras: ``image_embeds`` (PrefixVLM) or ``pixel_values``,
    ``image_grid_thw``, ``mm_token_type_ids`` (HF VLMs)."""

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def to(self, device: torch.device | str) -> PromptBatch:
        return PromptBatch(
            self.prompt_ids.to(device),
            self.prompt_mask.to(device),
            {k: v.to(device) for k, v in self.model_inputs.items()},
        )


class ResponseForward(NamedTuple):
    """Teacher-forced outputs at the response positions."""

    logits: Tensor | None
    """float[B, R, V]: ``logits[:, t]`` is the next-token distribution that scores
    ``response_ids[:, t]``; None when not asked for."""
    hidden: Tensor | None
    """float[B, R, H]: the trunk's last hidden state at the same positions; None unless asked."""


class Generation(NamedTuple):
    """Finished responses, following the rollout's data conventions."""

    response_ids: Tensor
    """int64[B, R], right-padded with the pad id."""
    response_mask: Tensor
    """float32[B, R], 1.0 on real tokens including the EOS/stop token."""
    logprobs: Tensor
    """float32[B, R], log-prob of each sampled token under the temperature-scaled policy; 0 at
    padding."""
    response_lengths: Tensor
    """int64[B]."""
    texts: list[str]
    """Decoded responses (special tokens skipped; a stop string is kept)."""


# ---------------------------------------------------------------------------------------------
# a tokenizer that works offline
# ---------------------------------------------------------------------------------------------


def char_tokenizer(extra_special_tokens: Sequence[str] = ()) -> Any:
    """A character-level ``PreTrainedTokenizerFast`` built in code (no download).

    Vocabulary: ``<pad>`` (0), ``<eos>`` (1), ``<unk>`` (2), then ``extra_special_tokens``, then
    the printable ASCII characters. Pads on the left (prompts are left-padded).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = list(_CHAR_SPECIALS) + [t for t in extra_special_tokens if t not in _CHAR_SPECIALS]
    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
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


def word_tokenizer(words: Sequence[str]) -> Any:
    """A word-level ``PreTrainedTokenizerFast`` over ``words`` (split on whitespace; no download).

    Vocabulary: ``<pad>`` (0), ``<eos>`` (1), ``<unk>`` (2), then ``words`` in order. Small task
    vocabularies make one answer one token, which a tiny policy can find by sampling.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_CHAR_SPECIALS)}
    for word in words:
        if not word or any(c.isspace() for c in word):
            raise ValueError(f"word_tokenizer: {word!r} is not a single word")
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


# ---------------------------------------------------------------------------------------------
# the common interface
# ---------------------------------------------------------------------------------------------


class _StepLogprobRecorder:
    """A logits processor that records log-probs of the sampled tokens during ``generate``.

    ``generate`` runs user processors before its temperature/top-k/top-p warpers, so the scores
    seen here are the model's raw logits. At step s it keeps ``log_softmax(logits_s / T)`` and,
    at step s+1, reads off the log-prob of the token sampled at step s. Only one (B, V) tensor
    is held, unlike ``output_logits=True`` which keeps all R of them.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.last: Tensor | None = None  # (B, V) log-probs of the latest step
        self.steps: list[Tensor] = []  # R x (B,)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.last is not None:
            self.steps.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))  # (B,)
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # (B, V)
        return scores

    def finish(self, new_tokens: Tensor) -> Tensor:
        """``new_tokens``: int64[B, R] as returned by generate; returns float32[B, R]."""
        if self.last is not None:
            self.steps.append(self.last.gather(-1, new_tokens[:, -1:]).squeeze(-1))  # (B,)
        self.last = None
        return torch.stack(self.steps, dim=1)  # (B, R)


class Policy(nn.Module):
    """The interface shared by :class:`PrefixVLM` and :class:`HFVisionLanguagePolicy`."""

    tokenizer: Any
    hidden_size: int
    vocab_size: int
    suppressed_token_ids: tuple[int, ...] = ()
    """Tokens the policy never emits (e.g. image placeholders, which would break a teacher-forced
    forward): ``generate`` bans them and ``forward_response`` gives them -inf logits, so both
    describe the same distribution."""

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

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

    def _response_outputs(self, out: Any, R: int, logits: bool, hidden: bool) -> ResponseForward:
        """The response positions of a forward run with ``logits_to_keep=R + 1``.

        Position L-1+t predicts response token t: the last R+1 positions minus the very last.
        """
        return ResponseForward(
            _suppress(out.logits[:, :-1], self.suppressed_token_ids)
            if logits
            else None,  # (B, R, V)
            out.hidden_states[-1][:, -(R + 1) : -1] if hidden else None,  # (B, R, H)
        )

    def _generate_raw(self, batch: PromptBatch, gen_config: Any, **kwargs: Any) -> Tensor:
        """Run ``generate``; return only the new tokens, int64[B, R]."""
        raise NotImplementedError

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
        """Load a state dict (a weight-sync payload): names must exist and shapes match; with
        ``strict=False`` it may be partial. Tensors are copied in place, so the model's dtype
        and device are kept."""
        if not isinstance(weights, Mapping):
            raise ValueError(
                f"{who}: weights must be a state dict (name -> tensor), got {type(weights).__name__}"
            )
        own = self.state_dict()
        unknown = sorted(set(weights) - set(own))
        if unknown:
            raise ValueError(
                f"{who}: {len(unknown)} weight name(s) not in this policy, e.g. {unknown[:3]}; "
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
        self.load_state_dict(dict(weights), strict=False)

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
    def generate(
        self,
        batch: PromptBatch,
        *,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
    ) -> Generation:
        """Sample responses with HF ``generate`` (KV cache).

        ``temperature == 0`` is greedy decoding. A response ends at the EOS token, at any of
        ``stop_token_ids`` or at the token that completes any of ``stop_strings`` (that token is
        kept and counted in the mask), or after ``max_new_tokens``.

        Logprobs: ``log softmax(logits / temperature)`` at the sampled token, i.e. under the
        temperature-scaled policy *before* top-k/top-p truncation (T = 1 for greedy). That is
        the distribution a PPO/GRPO update recomputes with ``response_logprobs(..., temperature)``,
        so the two agree up to float error; the truncated sampling distribution is not used
        because its support changes with top-p and the update could not reproduce it.
        """
        from transformers import GenerationConfig

        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens is {max_new_tokens}; it must be >= 1")
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(
                f"generate: temperature={temperature}, top_p={top_p}, top_k={top_k}; need "
                "temperature >= 0, 0 < top_p <= 1, top_k >= 0"
            )
        greedy = temperature == 0
        eos = [self.eos_token_id, *[int(t) for t in stop_token_ids if int(t) != self.eos_token_id]]
        # A complete config, so that a checkpoint's own generation_config.json (penalties,
        # top_k) never changes what we sample from.
        gen_config = GenerationConfig(
            do_sample=not greedy,
            temperature=1.0 if greedy else float(temperature),
            top_p=1.0 if greedy else float(top_p),
            top_k=0 if greedy else int(top_k),
            max_new_tokens=int(max_new_tokens),
            eos_token_id=eos,
            pad_token_id=self.pad_token_id,
            bos_token_id=self.tokenizer.bos_token_id,
            stop_strings=list(stop_strings) or None,
            suppress_tokens=list(self.suppressed_token_ids) or None,
            return_dict_in_generate=True,
            use_cache=True,
        )
        recorder = _StepLogprobRecorder(1.0 if greedy else float(temperature))
        was_training = self.training
        self.eval()
        try:
            new_tokens = self._generate_raw(
                batch,
                gen_config,
                logits_processor=[recorder],
                tokenizer=self.tokenizer if stop_strings else None,
            )  # (B, R)
        finally:
            self.train(was_training)
        step_logprobs = recorder.finish(new_tokens)  # (B, R)
        return _finish_responses(
            new_tokens,
            step_logprobs,
            set(eos),
            list(stop_strings),
            self.tokenizer,
            self.pad_token_id,
        )


def _stop_string_end(tokenizer: Any, ids: list[int], stop_strings: list[str]) -> int | None:
    """Index of the token that completes the first stop string in ``ids``, or None."""
    if not stop_strings or not any(s in tokenizer.decode(ids) for s in stop_strings):
        return None
    lo, hi = 0, len(ids) - 1  # containment is monotone in the prefix length: binary search
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in tokenizer.decode(ids[: mid + 1]) for s in stop_strings):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _finish_responses(
    new_tokens: Tensor,
    step_logprobs: Tensor,
    stop_ids: set[int],
    stop_strings: list[str],
    tokenizer: Any,
    pad_id: int,
) -> Generation:
    """Cut each row after its first stop token/string; pad, mask and decode.

    ``generate`` keeps sampling rows that already finished (filling them with the pad id), so
    each row's end is found here from its tokens, the same rule ``generate`` stopped on.
    """
    B, R = new_tokens.shape
    lengths = []
    rows = new_tokens.tolist()
    for row in rows:
        end = next((t for t, tok in enumerate(row) if tok in stop_ids), R - 1)
        by_string = _stop_string_end(tokenizer, row[: end + 1], stop_strings)
        lengths.append((end if by_string is None else by_string) + 1)
    lengths_t = torch.tensor(lengths, dtype=torch.int64)  # (B,)
    R_out = int(lengths_t.max())
    positions = torch.arange(R_out)[None, :]  # (1, R')
    real = positions < lengths_t[:, None]  # (B, R')
    ids = torch.where(real, new_tokens[:, :R_out].cpu(), pad_id)  # (B, R')
    logprobs = torch.where(real, step_logprobs[:, :R_out].cpu().float(), 0.0)  # (B, R')
    texts = [tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(rows, lengths)]
    return Generation(ids, real.float(), logprobs, lengths_t, texts)


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


# ---------------------------------------------------------------------------------------------
# family 1: image features as a prefix of a causal LM
# ---------------------------------------------------------------------------------------------


class PrefixVLM(Policy):
    """A causal LM that reads ``k`` projected image-feature embeddings before the prompt.

    Sequence layout, per row: ``[prefix (k) | left pad | prompt | response | right pad]`` with
    attention mask 0 on padding and position ids that skip it (``cumsum(mask) - 1``, the rule
    ``generate`` uses), so teacher-forced and cached generation see identical positions.
    Without ``image_embeds`` it is a plain text policy (no prefix).
    """

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
        enc = self.tokenizer(list(prompts), return_tensors="pt", padding=True)
        return self.prepare(enc["input_ids"], enc["attention_mask"], image_embeds=image_embeds)

    def prepare(self, prompt_ids, prompt_mask, *, images=None, image_embeds=None) -> PromptBatch:
        if images is not None:
            raise ValueError("PrefixVLM.prepare: takes image_embeds, not images")
        self._check_embeds("PrefixVLM.prepare", image_embeds, prompt_ids.shape[0])
        extra = {} if image_embeds is None else {"image_embeds": image_embeds.float()}
        return PromptBatch(prompt_ids.long(), prompt_mask.long(), extra)

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
        R = response_ids.shape[1]
        out = self.lm(
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=_positions(mask),
            output_hidden_states=hidden,
            logits_to_keep=R + 1,
            use_cache=False,
        )
        return self._response_outputs(out, R, logits, hidden)

    def _generate_raw(self, batch, gen_config, **kwargs) -> Tensor:
        embeds, mask = self._prompt_embeds(batch)  # (B, L, H), (B, L)
        out = self.lm.generate(
            inputs_embeds=embeds, attention_mask=mask, generation_config=gen_config, **kwargs
        )
        return out.sequences  # (B, R): with inputs_embeds only, generate returns new tokens only

    # --- files -------------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        """Write ``lm/`` (HF model + tokenizer), ``projector.safetensors`` and a marker file."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.lm.save_pretrained(path / "lm")
        self.tokenizer.save_pretrained(path / "lm")
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

        path = Path(path)
        meta = json.loads((path / _PREFIX_MARKER).read_text())
        policy = cls.from_lm(path / "lm", meta["image_dim"], meta["num_prefix_tokens"], dtype=dtype)
        policy.projector.load_state_dict(load_file(path / "projector.safetensors"))
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
        from transformers import AutoModelForCausalLM, AutoTokenizer

        lm_path = _local_dir("PrefixVLM.from_lm", lm_path)
        lm = AutoModelForCausalLM.from_pretrained(
            lm_path, dtype=getattr(torch, dtype), local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(lm_path, local_files_only=True)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return cls(lm, tokenizer, image_dim, num_prefix_tokens)


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
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = char_tokenizer() if words is None else word_tokenizer(words)
    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_positions=n_positions,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.eos_token_id,
        # no dropout: a PPO ratio must compare the same function in rollout and update
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy = PrefixVLM(GPT2LMHeadModel(config), tokenizer, image_dim, num_prefix_tokens)
    return policy.eval()


# ---------------------------------------------------------------------------------------------
# family 2: transformers' own image-text-to-text models
# ---------------------------------------------------------------------------------------------


class HFVisionLanguagePolicy(Policy):
    """A transformers VLM (``AutoModelForImageTextToText``) with its processor.

    Prompts are formatted with the processor's chat template (one user turn: the image, then
    the text) when it has one, else as ``image_token + prompt``. ``prepare`` rebuilds the image
    inputs from the images and the per-token type ids (``mm_token_type_ids``/``token_type_ids``)
    from the image token in ``prompt_ids``.
    """

    def __init__(self, model: nn.Module, processor: Any, use_chat_template: bool = True):
        super().__init__()
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.tokenizer.padding_side = "left"
        self.use_chat_template = use_chat_template
        text_config = model.config.get_text_config()
        self.hidden_size = int(text_config.hidden_size)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.image_token = getattr(processor, "image_token", None)
        self.image_token_id = getattr(processor, "image_token_id", None)
        self.video_token_id = getattr(processor, "video_token_id", None)
        # the model's multimodal placeholders: a sampled one would make the teacher-forced
        # forward look for image features that do not exist
        placeholder_keys = (
            "image_token_id",
            "video_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
            "image_token_index",
            "boi_token_id",
            "eoi_token_id",
            "boi_token_index",
            "eoi_token_index",
        )
        placeholders = {getattr(model.config, k, None) for k in placeholder_keys}
        placeholders |= {self.image_token_id, self.video_token_id}
        self.suppressed_token_ids = tuple(
            sorted(int(t) for t in placeholders if isinstance(t, int) and 0 <= t < self.vocab_size)
        )

    # --- inputs ------------------------------------------------------------------------------
    def _format(self, prompt: str, with_image: bool) -> str:
        template = getattr(self.processor, "chat_template", None)
        if self.use_chat_template and template:
            content = ([{"type": "image"}] if with_image else []) + [
                {"type": "text", "text": prompt}
            ]
            return self.processor.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
        return (self.image_token or "") + prompt if with_image else prompt

    def _check_images(self, fn: str, images: Sequence[Any] | None, n: int) -> None:
        if images is not None and len(images) != n:
            raise ValueError(
                f"{fn}: {len(images)} images for {n} prompts; give one image per prompt"
            )

    def encode_prompts(self, prompts, *, images=None, image_embeds=None) -> PromptBatch:
        fn = "HFVisionLanguagePolicy.encode_prompts"
        if image_embeds is not None:
            raise ValueError(
                f"{fn}: takes images (PIL), not image_embeds; this model has its own vision tower"
            )
        self._check_images(fn, images, len(prompts))
        texts = [self._format(p, images is not None) for p in prompts]
        kwargs = {"images": list(images)} if images is not None else {}
        enc = self.processor(text=texts, return_tensors="pt", padding=True, **kwargs)
        extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
        return PromptBatch(enc["input_ids"].long(), enc["attention_mask"].long(), extra)

    def prepare(self, prompt_ids, prompt_mask, *, images=None, image_embeds=None) -> PromptBatch:
        fn = "HFVisionLanguagePolicy.prepare"
        if image_embeds is not None:
            raise ValueError(f"{fn}: takes images (PIL), not image_embeds")
        self._check_images(fn, images, prompt_ids.shape[0])
        prompt_ids = prompt_ids.long()
        extra: dict[str, Tensor] = {}
        if images is not None:
            pixels = self.processor.image_processor(list(images), return_tensors="pt")
            extra.update({k: v for k, v in pixels.items()})
        names = set(getattr(self.processor, "model_input_names", ()))
        is_image = prompt_ids == self.image_token_id if self.image_token_id is not None else None
        if "mm_token_type_ids" in names:  # text 0, image 1, video 2 (Qwen2-VL family)
            types = torch.zeros_like(prompt_ids)
            if is_image is not None:
                types[is_image] = 1
            if self.video_token_id is not None:
                types[prompt_ids == self.video_token_id] = 2
            extra["mm_token_type_ids"] = types
        if "token_type_ids" in names and is_image is not None:  # image 1 (Gemma-3 style)
            extra["token_type_ids"] = is_image.long()
        return PromptBatch(prompt_ids, prompt_mask.long(), extra)

    def _model_inputs(self, batch: PromptBatch, seq_len: int) -> dict[str, Tensor]:
        """Extras on the device; per-token ones (B, P) are extended with zeros to ``seq_len``."""
        dev, B, P = self.device, *batch.prompt_ids.shape
        out = {}
        for key, value in batch.model_inputs.items():
            value = value.to(dev)
            if value.dim() == 2 and tuple(value.shape) == (B, P) and seq_len > P:
                value = torch.cat([value, value.new_zeros(B, seq_len - P)], 1)  # (B, seq_len)
            if value.is_floating_point():
                value = value.to(self.model.dtype)
            out[key] = value
        return out

    # --- model -------------------------------------------------------------------------------
    def forward_response(self, batch, response_ids, response_mask, *, logits=True, hidden=False):
        fn = "HFVisionLanguagePolicy.forward_response"
        _check_response(fn, batch, response_ids, response_mask)
        dev = self.device
        real = response_mask.to(dev) > 0  # (B, R)
        banned = torch.tensor(self.suppressed_token_ids, dtype=torch.long, device=dev)
        placeholder = real & torch.isin(response_ids.to(dev), banned)  # (B, R)
        if bool(placeholder.any()):
            b, t = placeholder.nonzero()[0].tolist()
            raise ValueError(
                f"{fn}: response_ids[{b}, {t}] is {int(response_ids[b, t])}, a multimodal "
                f"placeholder token {self.suppressed_token_ids}; a response may not contain one "
                "(the model would look for image features that do not exist)"
            )
        resp_ids = torch.where(real, response_ids.to(dev), self.pad_token_id)  # (B, R)
        ids = torch.cat([batch.prompt_ids.to(dev), resp_ids], 1)  # (B, P+R)
        mask = torch.cat([batch.prompt_mask.to(dev), real.long()], 1)  # (B, P+R)
        R = response_ids.shape[1]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            **self._model_inputs(batch, ids.shape[1]),
            output_hidden_states=hidden,
            logits_to_keep=R + 1,
            use_cache=False,
        )
        return self._response_outputs(out, R, logits, hidden)

    def _generate_raw(self, batch, gen_config, **kwargs) -> Tensor:
        P = batch.prompt_ids.shape[1]
        out = self.model.generate(
            input_ids=batch.prompt_ids.to(self.device),
            attention_mask=batch.prompt_mask.to(self.device),
            **self._model_inputs(batch, P),
            generation_config=gen_config,
            **kwargs,
        )
        return out.sequences[:, P:]  # (B, R)

    # --- files -------------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        """``model.save_pretrained`` + ``processor.save_pretrained`` into one directory."""
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: str = "float32", use_chat_template: bool = True
    ) -> HFVisionLanguagePolicy:
        """Load a VLM and its processor from a local directory (never downloads)."""
        from transformers import AutoModelForImageTextToText, AutoProcessor

        path = _local_dir("HFVisionLanguagePolicy.from_pretrained", path)
        model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=getattr(torch, dtype), local_files_only=True
        )
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        return cls(model, processor, use_chat_template=use_chat_template)


def tiny_qwen2_vl(
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_depth: int = 2,
    vision_dim: int = 32,
    patch_size: int = 8,
    image_size: int = 32,
) -> HFVisionLanguagePolicy:
    """A random Qwen2-VL with tiny vision and text towers and a processor built in code.

    The processor is ``Qwen2VLProcessor`` made of a ``Qwen2VLImageProcessor`` and
    ``Qwen2VLVideoProcessor`` sized to the vision tower (patch 8, merge 2, images resized to
    at most ``image_size`` x ``image_size`` pixels, so a 32x32 image is 4 LM tokens), the
    character tokenizer of :func:`char_tokenizer` with Qwen's vision special tokens, and a
    small chat template. It saves and reloads with ``AutoProcessor`` like a real checkpoint.
    """
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = char_tokenizer(_QWEN_VISION_TOKENS)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _QWEN_VISION_TOKENS}
    merge = 2
    size = {"shortest_edge": (patch_size * merge) ** 2, "longest_edge": image_size * image_size}
    common = {"patch_size": patch_size, "merge_size": merge, "temporal_patch_size": 2}
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, **common),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(size=size, **common),
        chat_template=_TINY_CHAT_TEMPLATE,
    )
    head_dim = hidden_size // 4
    # mrope_section splits head_dim/2 rotary frequencies among (temporal, height, width)
    half = head_dim // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": section,
                "rope_theta": 10000.0,
            },
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": None,
        },
        vision_config={
            "depth": vision_depth,
            "embed_dim": vision_dim,
            "hidden_size": hidden_size,
            "num_heads": 2,
            "patch_size": patch_size,
            "spatial_merge_size": merge,
            "temporal_patch_size": 2,
            "mlp_ratio": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    return HFVisionLanguagePolicy(model, processor).eval()


# ---------------------------------------------------------------------------------------------
# building from JSON-able specs (what nodes take as constructor arguments)
# ---------------------------------------------------------------------------------------------

_BUILDERS = {"tiny-prefix-vlm": tiny_prefix_vlm, "tiny-qwen2-vl": tiny_qwen2_vl}


def _local_dir(fn: str, path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"{fn}: {str(path)!r} is not a local directory; models load only from local paths "
            "(nothing is downloaded). Save one with policy.save_pretrained(dir)."
        )
    return path


def load_policy(path: str | Path, *, dtype: str = "float32") -> Policy:
    """Load a saved policy: a :class:`PrefixVLM` directory (it has ``prefix_vlm.json``) or any
    HF image-text-to-text checkpoint directory."""
    path = _local_dir("load_policy", path)
    if (path / _PREFIX_MARKER).is_file():
        return PrefixVLM.from_pretrained(path, dtype=dtype)
    return HFVisionLanguagePolicy.from_pretrained(path, dtype=dtype)


def build_policy(spec: str | Mapping[str, Any]) -> Policy:
    """Build a policy from a JSON-able spec.

    * ``"tiny-prefix-vlm"`` / ``"tiny-qwen2-vl"``: the tiny builders with their defaults;
    * ``{"name": "tiny-qwen2-vl", "seed": 1, ...}``: a tiny builder with keyword arguments;
    * ``"/local/dir"`` or ``{"path": "/local/dir", "dtype": "bfloat16"}``: :func:`load_policy`;
    * ``{"builder": "package.module:function", ...}``: any function returning a Policy.
    """
    if isinstance(spec, Policy):
        raise ValueError("build_policy: got a live Policy; pass it as model= instead of a spec")
    if isinstance(spec, str):
        spec = {"name": spec} if spec in _BUILDERS else {"path": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"build_policy: spec must be a str or dict, got {type(spec).__name__}")
    kwargs = dict(spec)
    if "name" in kwargs:
        name = kwargs.pop("name")
        if name not in _BUILDERS:
            raise ValueError(f"build_policy: unknown name {name!r}; known: {sorted(_BUILDERS)}")
        return _BUILDERS[name](**kwargs)
    if "path" in kwargs:
        return load_policy(kwargs.pop("path"), **kwargs)
    if "builder" in kwargs:
        module, _, qualname = str(kwargs.pop("builder")).partition(":")
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        policy = obj(**kwargs)
        if not isinstance(policy, Policy):
            raise ValueError(
                f"build_policy: builder {spec['builder']!r} returned {type(policy).__name__}, not a Policy"
            )
        return policy
    raise ValueError(f"build_policy: spec {dict(spec)!r} needs one of 'name', 'path' or 'builder'")
