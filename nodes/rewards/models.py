"""The learned reward model: a sequence classifier with one logit, on prompt + response.

The CLIP score lives in :mod:`nodes.rewards.clip` (re-exported here for plans that name
``nodes.rewards.models:ClipScoreReward``); the LLM judge in :mod:`nodes.rewards.judge`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from nodes.batches import length_parts
from nodes.models.files import (
    _check_checkpoint_dir,
    _check_reader_files,
    _load_tokenizer,
    _loading,
    _read_json,
)
from nodes.models.offload import Offload
from nodes.models.policy_base import char_tokenizer
from nodes.rewards.base import RewardNode
from nodes.rewards.clip import ClipScoreReward, clip_score  # noqa: F401 (older plans name them here)
from nodes.seeding import seeded
from yatt_graph.node import Built

__all__ = ["RewardModel"]

# ---------------------------------------------------------------------------------------------
# learned reward model
# ---------------------------------------------------------------------------------------------


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _set_pad_token(fn: str, tokenizer: Any) -> None:
    """Pad with the EOS token when the tokenizer has no pad token (GPT-2, Llama)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"{fn}: the tokenizer has neither a pad nor an EOS token; set one "
                "(tokenizer.pad_token = ...) and save it again"
            )
        tokenizer.pad_token = tokenizer.eos_token


class RewardModel(Offload, RewardNode):
    """A learned reward: a transformers sequence classifier with one logit, on prompt + response.

    Exactly one of:

    * ``path``: a local directory with the model and its tokenizer (``save_pretrained``);
    * ``config``: transformers config keyword arguments with ``"model_type"``, e.g.
      ``{"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32}``: a randomly initialized
      model (seeded with ``seed``, so every process builds the same one) with
      :func:`char_tokenizer`; for tests and demos;
    * ``model`` (+ ``tokenizer``): live objects, an in-process escape hatch (not rebuildable).

    Args:
        template: how the scored text is made, with ``{prompt}`` and ``{response}`` (and meta
            keys in ``meta_keys``); without prompts given, ``{prompt}`` is empty.
        meta_keys: the meta keys the template may use.
        max_length: longest input in tokens; longer inputs lose their beginning (left truncation,
            so that the end of the response is kept).
        micro_batch_size: samples per forward pass.
        micro_batch_tokens: with a value > 0, also at most this many padded tokens per forward
            pass (texts sorted by length, longest first); 0: rows only.
        device, dtype: where and in what precision the model runs (``"float32"``, ``"bfloat16"``).
        options: the RewardNode options (token_level, on_bad_sample, emit_bad_mask, name).
    """

    needs_prompts = True  # an instance whose template has no {prompt} sets it False
    model = Built("the sequence classifier, built by setup()")
    tokenizer = Built("its tokenizer")

    def __init__(
        self,
        path: str | None = None,
        *,
        config: Mapping[str, Any] | None = None,
        seed: int = 0,
        template: str = "{prompt}{response}",
        meta_keys: Sequence[str] = ("answer",),
        max_length: int = 512,
        micro_batch_size: int = 16,
        micro_batch_tokens: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
        model: Any = None,
        tokenizer: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(device=device, **options)
        if sum(x is not None for x in (path, config, model)) != 1:
            raise ValueError(
                f"node {self.name!r}: give exactly one of path= (a local model directory), "
                "config= (transformers config kwargs with 'model_type') or model="
            )
        self._set_template(template, meta_keys)
        if dtype not in _TORCH_DTYPES:
            raise ValueError(f"node {self.name!r}: dtype must be one of {sorted(_TORCH_DTYPES)}")
        if micro_batch_size < 1 or max_length < 1 or micro_batch_tokens < 0:
            raise ValueError(
                f"node {self.name!r}: micro_batch_size and max_length must be >= 1 and "
                f"micro_batch_tokens >= 0 (got {micro_batch_size}, {max_length}, "
                f"{micro_batch_tokens})"
            )
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.max_length, self.micro_batch_size = max_length, micro_batch_size
        if model is not None and tokenizer is None:
            raise ValueError(f"node {self.name!r}: model= needs tokenizer= too")
        if path is not None and not os.path.isdir(path):
            raise FileNotFoundError(
                f"node {self.name!r}: reward model path {path!r} is not a directory; pass a local "
                "directory written by save_pretrained (nothing is downloaded)"
            )
        if config is not None:
            if "model_type" not in config:
                raise ValueError(f"node {self.name!r}: config needs 'model_type' (e.g. 'gpt2')")
            vocab = len(char_tokenizer())
            if config.get("vocab_size", vocab) < vocab:
                raise ValueError(
                    f"node {self.name!r}: config vocab_size={config['vocab_size']} is smaller "
                    f"than the character tokenizer's {vocab}"
                )
        if path is not None:
            self._check_dir(path)
        self.path, self.model_config, self.seed, self.dtype = path, config, int(seed), dtype
        self._given = (model, tokenizer) if model is not None else None
        if model is not None:
            self._check_head(model)

    def _check_head(self, model: Any) -> None:
        if getattr(model.config, "num_labels", 1) != 1:
            raise ValueError(
                f"node {self.name!r}: the model has num_labels={model.config.num_labels}; "
                "a reward model needs a single-logit head (num_labels=1)"
            )

    def build(self) -> None:
        if self._given is not None:
            model, tokenizer = self._given
        elif self.path is not None:
            model, tokenizer = self._load(self.path)
        else:
            model, tokenizer = self._build(dict(self.model_config), self.seed)
        _set_pad_token(f"node {self.name!r}", tokenizer)
        tokenizer.padding_side = "right"
        tokenizer.truncation_side = "left"
        model.config.pad_token_id = tokenizer.pad_token_id
        self._check_head(model)
        self.model = model.to(device=self.device, dtype=_TORCH_DTYPES[self.dtype]).eval()
        self.tokenizer = tokenizer

    def _check_dir(self, path: str) -> None:
        """What the folder must hold, checked when the node is made (before any step): a
        sequence classifier with one logit, its weights and its tokenizer."""
        fn = f"node {self.name!r}"
        _check_checkpoint_dir(fn, Path(path), reader=None)
        config = _read_json(fn, Path(path) / "config.json", "reward model")
        architectures = config.get("architectures") or []
        if architectures and not any(
            str(a).endswith("ForSequenceClassification") for a in architectures
        ):
            raise ValueError(
                f"{fn}: {path!r} holds a {', '.join(map(str, architectures))} "
                f"(model_type {config.get('model_type')!r}), not a sequence classifier; a reward "
                "model is an AutoModelForSequenceClassification with num_labels=1 (a causal LM "
                "can judge instead: 'judge:DIR')"
            )
        if config.get("num_labels", len(config.get("id2label") or {0: 0})) != 1:
            n = config.get("num_labels", len(config.get("id2label") or {}))
            raise ValueError(
                f"{fn}: {path!r} is a sequence classifier with {n} labels; a reward model "
                "needs a single-logit head (num_labels=1)"
            )
        _check_reader_files(fn, Path(path), "tokenizer")

    def _load(self, path: str) -> tuple[Any, Any]:
        from transformers import AutoModelForSequenceClassification

        fn = f"node {self.name!r}"
        self._check_dir(path)  # (the folder may have changed since the node was made)
        with _loading(fn, Path(path), "a sequence classifier"):
            tokenizer = _load_tokenizer(Path(path))
            model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True)
        return model, tokenizer

    def _build(self, config: dict[str, Any], seed: int) -> tuple[Any, Any]:
        from transformers import AutoConfig, AutoModelForSequenceClassification

        tokenizer = char_tokenizer()
        config.setdefault("vocab_size", len(tokenizer))
        eos = tokenizer.eos_token_id
        ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": eos, "eos_token_id": eos}
        cfg = AutoConfig.for_model(config.pop("model_type"), num_labels=1, **{**ids, **config})
        with seeded(seed):
            model = AutoModelForSequenceClassification.from_config(cfg)
        return model, tokenizer

    def memory(self, load: Any) -> dict[str, int]:
        """The classifier and its largest forward (``micro_batch_size`` rows)."""
        from nodes.memory import checkpoint_size, module_size, reading_memory

        if self._given is not None:
            return {}
        if self.path is not None:
            size = checkpoint_size(self.path, self.dtype)
        else:
            size = module_size(self._build(dict(self.model_config), self.seed)[0], self.dtype)
        extra = len(self.template)  # at most a token a character of the template's own text
        return reading_memory(size, load, self.micro_batch_size, self.max_length, extra=extra,
                              logits=False, budget=self.micro_batch_tokens)  # fmt: skip

    def score_samples(self, texts, meta, prompts, images):
        """Scores in forward passes of ``micro_batch_size`` rows in order, or with
        ``micro_batch_tokens`` of at most that many padded tokens too, longest first."""
        prompts = prompts if prompts is not None else [""] * len(texts)
        inputs = self._fill(texts, meta, prompts)
        if not inputs:
            return torch.zeros(0)
        enc = self.tokenizer(inputs, truncation=True, max_length=self.max_length)
        ids, masks = enc["input_ids"], enc["attention_mask"]
        rows = self.micro_batch_size
        if self.micro_batch_tokens:
            parts = length_parts([len(x) for x in ids], self.micro_batch_tokens, rows)
        else:
            parts = [list(range(s, min(s + rows, len(ids)))) for s in range(0, len(ids), rows)]
        scores = torch.zeros(len(inputs), dtype=torch.float32)  # (B,)
        with torch.inference_mode():
            for part in parts:
                chunk = {
                    "input_ids": [ids[i] for i in part],
                    "attention_mask": [masks[i] for i in part],
                }
                batch = self.tokenizer.pad(chunk, return_tensors="pt").to(self.device)
                scores[part] = self.model(**batch).logits[:, 0].float().cpu()  # (b,)
        return scores  # (B,)
