"""A generative judge: a causal LM (or a VLM) reads the question and the answer, and its
next-token probabilities of a few score words give the reward.

For each sample the judge fills ``template`` (``{prompt}``, ``{response}`` and the meta keys
named in ``meta_keys``, ``{answer}`` by default), runs one forward pass, and takes the
next-token distribution over ``score_words`` (renormalised over them)::

    reward = sum_w p(w | filled template) * value(w)       p(w) = softmax(logits[score ids])_w

With the default ``{"yes": 1.0, "no": 0.0}`` the reward is the judge's probability of "yes".
Each score word must be one token of the judge's tokenizer (for BPE tokenizers such as GPT-2's,
that often means the word with its leading space, ``" yes"``); :meth:`JudgeReward.setup` checks.

Models: ``"tiny"`` (a random GPT-2 with a word tokenizer, built in code, for tests and
benchmarks), a local causal LM directory (``AutoModelForCausalLM`` + ``AutoTokenizer``), or a
local image-text-to-text VLM directory (``AutoModelForImageTextToText`` + ``AutoProcessor``,
e.g. Qwen2-VL), which also reads the sample's image when ``images`` are given.

Cost: one forward pass per sample over the filled template, so time and memory grow with
prompt + response length (quadratically in attention); samples run in left-padded micro-batches
of ``max_batch``, longest first so that a batch holds texts of similar length. Text inputs
longer than ``max_length`` tokens lose their beginning (the question at the end is kept).
"""

from __future__ import annotations

import math
import os
import string
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
    config_positions,
)
from nodes.models.offload import Offload
from nodes.models.policy_base import _positions
from nodes.rewards.base import RewardNode
from nodes.rewards.models import _TORCH_DTYPES, _set_pad_token
from nodes.seeding import seeded
from yatt_graph import ANY, Port
from yatt_graph.node import Built

__all__ = ["DEFAULT_JUDGE_TEMPLATE", "TINY_JUDGE_CFG", "JudgeReward", "tiny_judge"]

DEFAULT_JUDGE_TEMPLATE = "Question: {prompt}\nAnswer: {response}\nIs the answer correct? "

#: The tiny judge's GPT-2 size (random weights, seeded): for tests and demos only.
TINY_JUDGE_CFG: dict[str, Any] = {"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 256}

#: The tiny judge's chat template (``chat_template=True``): one user turn behind "judge :".
TINY_JUDGE_CHAT = "{% for m in messages %}judge : {{ m['content'] }}{% endfor %}"


def tiny_judge(words: Sequence[str], seed: int = 0) -> tuple[Any, Any]:
    """A random 2-layer GPT-2 causal LM and a word tokenizer over ``words`` plus the shapes
    task's vocabulary (nothing downloads); seeded, so every process builds the same one."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from nodes.data import task_vocabulary
    from nodes.models.policy_base import word_tokenizer

    vocab = list(dict.fromkeys([*words, *task_vocabulary(), "judge", ":"]))
    tokenizer = word_tokenizer(vocab)
    tokenizer.chat_template = TINY_JUDGE_CHAT
    config = GPT2Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **TINY_JUDGE_CFG,
    )
    with seeded(seed):
        model = GPT2LMHeadModel(config)
    return model, tokenizer


class JudgeReward(Offload, RewardNode):
    """A causal LM or VLM judge (see the module docstring for the score).

    Ports: ``texts`` (the responses); ``prompts`` (required when the template has
    ``{prompt}``, as the default does); ``meta`` (for ``{answer}`` and other meta
    placeholders); ``images`` (read by a VLM judge only: ``needs_images`` is True for a VLM
    directory). Out: ``scores`` float32[B] (+ ``bad_samples`` with ``emit_bad_mask``,
    ``token_rewards`` with ``token_level``).

    Args:
        model: ``"tiny"`` (:func:`tiny_judge`: random weights; its vocabulary holds the score
            words and the template's words), or a local directory with a causal LM and its
            tokenizer, or a VLM and its processor (``save_pretrained``).
        template: the judge's input; placeholders ``{prompt}``, ``{response}`` (required) and the
            keys in ``meta_keys``. An unknown placeholder is a ValueError here.
        meta_keys: the meta keys (data columns) the template may use.
        score_words: word -> value; each word one token of the tokenizer. At least two.
        chat_template: wrap the filled template as one user turn of the tokenizer's (or the
            processor's) chat template, with the generation prompt after it.
        max_batch: samples per forward pass.
        micro_batch_tokens: with a value > 0, also at most this many padded tokens of text per
            forward pass (a text judge's tokens; a VLM judge's images add theirs); 0: rows only.
        max_length: longest text input in tokens (None: the model's position limit, else 2048).
        seed: seeds the tiny judge.
        device, dtype: where and in what precision the judge runs.
        options: the RewardNode options (token_level, on_bad_sample, emit_bad_mask, name;
            see :mod:`nodes.rewards`).
    """

    needs_prompts = True  # an instance whose template has no {prompt} sets it False
    model = Built("the causal LM (or VLM) judge, built by setup()")
    tokenizer = Built("its tokenizer (left padding)")

    def __init__(
        self,
        model: str = "tiny",
        *,
        template: str = DEFAULT_JUDGE_TEMPLATE,
        meta_keys: Sequence[str] = ("answer",),
        score_words: Mapping[str, float] | None = None,
        chat_template: bool = False,
        max_batch: int = 16,
        micro_batch_tokens: int = 0,
        max_length: int | None = None,
        seed: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
        **options: Any,
    ) -> None:
        super().__init__(device=device, **options)
        where = f"node {self.name!r}"
        self._set_template(template, meta_keys)
        words = dict(score_words) if score_words is not None else {"yes": 1.0, "no": 0.0}
        if len(words) < 2:
            raise ValueError(
                f"{where}: score_words {words!r} needs at least two words (one word would always "
                "get probability 1)"
            )
        for word, value in words.items():
            if not isinstance(word, str) or not word:
                raise ValueError(f"{where}: score word {word!r} must be a non-empty string")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{where}: score_words[{word!r}] = {value!r} is not a number")
            if not math.isfinite(value):
                raise ValueError(f"{where}: score_words[{word!r}] = {value!r} is not finite")
        if max_batch < 1 or (max_length is not None and max_length < 1) or micro_batch_tokens < 0:
            raise ValueError(
                f"{where}: max_batch and max_length must be >= 1, micro_batch_tokens >= 0"
            )
        self.micro_batch_tokens = int(micro_batch_tokens)
        if dtype not in _TORCH_DTYPES:
            raise ValueError(f"{where}: dtype must be one of {sorted(_TORCH_DTYPES)}")
        if model != "tiny" and not os.path.isdir(model):
            raise FileNotFoundError(
                f"{where}: judge model {model!r} is not a directory; pass a local directory "
                "written by save_pretrained (nothing is downloaded), or 'tiny'"
            )
        self.model_source, self.score_words = model, words
        self.chat_template = bool(chat_template)
        self.max_batch, self.max_length, self.seed, self.dtype = max_batch, max_length, seed, dtype
        self.needs_images = model != "tiny" and self._check_dir(model)
        if self.needs_prompts:
            self.inputs["prompts"] = Port(ANY, doc="list[str]: the B prompts ({prompt})")
        self.word_ids: list[int] = []
        self.vlm: Any = None  # the HFVisionLanguagePolicy of a VLM judge, after setup()

    # --- building -----------------------------------------------------------------------------
    def build(self) -> None:
        fn = f"node {self.name!r}"
        if self.model_source == "tiny":
            model, tokenizer = self._tiny()
        elif self.needs_images:
            from nodes.models.hf_vlm import HFVisionLanguagePolicy

            self.vlm = HFVisionLanguagePolicy.from_pretrained(
                self.model_source, dtype=self.dtype, use_chat_template=self.chat_template
            )
            model, tokenizer = self.vlm.model, self.vlm.tokenizer
        else:
            model, tokenizer = self._load(self.model_source)
        _set_pad_token(fn, tokenizer)
        tokenizer.padding_side = "left"
        tokenizer.truncation_side = "left"
        if self.chat_template:
            owner = self.vlm.processor if self.vlm is not None else tokenizer
            if not getattr(owner, "chat_template", None):
                raise ValueError(
                    f"{fn}: chat_template=True, but the judge in {self.model_source!r} has no "
                    "chat template; pass chat_template=False (the template is read as it is)"
                )
        self.word_ids = self._score_ids(tokenizer)
        if self.max_length is None:
            self.max_length = config_positions(model.config) or 2048
        model = model.to(device=self.device, dtype=_TORCH_DTYPES[self.dtype]).eval()
        self.model, self.tokenizer = model, tokenizer

    def _tiny(self) -> tuple[Any, Any]:
        """:func:`tiny_judge` over the score words and the template's own words."""
        literal = [w for text, *_ in string.Formatter().parse(self.template) for w in text.split()]
        return tiny_judge([*self.score_words, *literal], self.seed)

    def _check_dir(self, path: str) -> bool:
        """What the folder must hold, checked when the node is made (before any step): a
        causal LM with its tokenizer, or a VLM with its processor. Whether it is a VLM."""
        from nodes.models.families import model_family

        fn = f"node {self.name!r}"
        _check_checkpoint_dir(fn, Path(path), reader=None)
        config = _read_json(fn, Path(path) / "config.json", "judge model")
        try:
            vlm = model_family(path) == "vlm"
        except ValueError:
            vlm = False  # (what it is instead is said below)
        archs = [str(a) for a in config.get("architectures") or []]
        if not vlm and archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
            raise ValueError(
                f"{fn}: {path!r} holds a {', '.join(archs)} (model_type "
                f"{config.get('model_type')!r}), not a causal LM; a judge needs a model that "
                "predicts the next token (a sequence classifier is 'model:DIR')"
            )
        _check_reader_files(fn, Path(path), "processor" if vlm else "tokenizer")
        return vlm

    def _load(self, path: str) -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM

        fn = f"node {self.name!r}"
        self._check_dir(path)  # (the folder may have changed since the node was made)
        with _loading(fn, Path(path), "a causal LM judge"):
            tokenizer = _load_tokenizer(Path(path))
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=_TORCH_DTYPES[self.dtype], local_files_only=True
            )
        return model, tokenizer

    def _score_ids(self, tokenizer: Any) -> list[int]:
        ids: list[int] = []
        for word in self.score_words:
            tokens = tokenizer(word, add_special_tokens=False)["input_ids"]
            if len(tokens) != 1:
                pieces = tokenizer.convert_ids_to_tokens(tokens)
                raise ValueError(
                    f"node {self.name!r}: score word {word!r} is {len(tokens)} tokens {pieces} "
                    "of the judge's tokenizer; each score word must be a single token (try it "
                    "with or without a leading space, or another word)"
                )
            if tokenizer.unk_token_id is not None and tokens[0] == tokenizer.unk_token_id:
                raise ValueError(
                    f"node {self.name!r}: score word {word!r} is not in the judge's vocabulary "
                    f"(it tokenizes to {tokenizer.unk_token!r})"
                )
            if tokens[0] in ids:
                other = list(self.score_words)[ids.index(tokens[0])]
                raise ValueError(
                    f"node {self.name!r}: score words {other!r} and {word!r} are the same token"
                )
            ids.append(tokens[0])
        return ids

    def memory(self, load: Any) -> dict[str, int]:
        """The judge and its largest forward (``max_batch`` rows)."""
        from nodes.memory import checkpoint_size, module_size, reading_memory

        if self.model_source == "tiny":
            size = module_size(self._tiny()[0], self.dtype)
        else:
            size = checkpoint_size(self.model_source, self.dtype)
        extra = len(self.template)  # at most a token a character of the template's own text
        return reading_memory(size, load, self.max_batch, self.max_length or 2048, extra=extra,
                              budget=self.micro_batch_tokens)  # fmt: skip

    # --- scoring ------------------------------------------------------------------------------
    def judge_inputs(
        self, texts: list[str], meta: list[dict[str, Any]], prompts: list[str] | None
    ) -> list[str]:
        """What the judge reads for each sample: the filled template, in the tokenizer's chat
        template with ``chat_template=True`` (a VLM judge's processor applies its own)."""
        filled = self._fill(texts, meta, prompts)
        if not self.chat_template:
            return filled
        tokenizer = self.tokenizer  # builds the judge if it is not built yet
        if self.vlm is not None:
            return filled
        return [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            for text in filled
        ]

    def score_samples(self, texts, meta, prompts, images):
        inputs = self.judge_inputs(texts, meta, prompts)
        if not inputs:
            return torch.zeros(0)
        word_ids = torch.tensor(self.word_ids, device=self.device)  # (W,)
        values = torch.tensor(list(self.score_words.values()), dtype=torch.float32)  # (W,)
        scores = torch.zeros(len(inputs), dtype=torch.float32)  # (B,)
        with torch.inference_mode():
            for rows in self._parts(inputs):
                chunk = [inputs[i] for i in rows]
                if self.vlm is not None:
                    logits = self._vlm_logits(
                        chunk, None if images is None else [images[i] for i in rows]
                    )
                else:
                    logits = self._text_logits(chunk)  # (b, V)
                probs = logits.float()[:, word_ids].softmax(dim=-1).cpu()  # (b, W)
                scores[rows] = probs @ values  # (b,)
        return scores  # (B,)

    def _parts(self, inputs: list[str]) -> list[list[int]]:
        """The forward passes: ``max_batch`` texts each, longest first (by characters), or
        with ``micro_batch_tokens`` also within that many padded tokens."""
        if not self.micro_batch_tokens:
            order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))  # longest first
            return [order[s : s + self.max_batch] for s in range(0, len(order), self.max_batch)]
        ids = self.tokenizer(
            inputs, truncation=True, max_length=self.max_length,
            add_special_tokens=not self.chat_template,
        )["input_ids"]  # fmt: skip
        return length_parts([len(x) for x in ids], self.micro_batch_tokens, self.max_batch)

    def _text_logits(self, chunk: list[str]) -> torch.Tensor:
        """Next-token logits (b, V) after each text, left-padded, positions from 0 per row."""
        enc = self.tokenizer(
            chunk,
            padding=True,
            truncation=True,
            max_length=self.max_length,
            add_special_tokens=not self.chat_template,  # the chat template holds its own
            return_tensors="pt",
        )
        ids = enc["input_ids"].to(self.device)  # (b, L) left-padded
        mask = enc["attention_mask"].to(self.device)  # (b, L)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=_positions(mask), logits_to_keep=1
        )
        return out.logits[:, -1, :]  # (b, V)

    def _vlm_logits(self, chunk: list[str], images: list[Any] | None) -> torch.Tensor:
        """Next-token logits (b, V) of a VLM judge, with each sample's image when given."""
        batch = self.vlm.encode_prompts(chunk, images=images)
        extra = self.vlm._model_inputs(batch, batch.prompt_ids.shape[1])
        out = self.model(
            input_ids=batch.prompt_ids.to(self.device),  # (b, L) left-padded
            attention_mask=batch.prompt_mask.to(self.device),  # (b, L)
            logits_to_keep=1,
            **extra,
        )
        return out.logits[:, -1, :]  # (b, V)
