"""Reward nodes: rule functions, a learned reward model, and CLIP image-text score.

All of them take the data conventions' reward inputs and give one score per sample::

    in:  texts list[str] (B responses), meta list[dict]?, prompts list[str]?, images list[PIL]?,
         response_mask float32[B, R]?
    out: scores float32[B]
         token_rewards float32[B, R]    only with token_level=True (then response_mask is required)
         bad_samples bool[B]            only with emit_bad_mask=True

Bad scores. A score that is NaN, inf or not a number at all is refused: ``ValueError`` naming
the node, the sample index and the value. With ``on_bad_sample="skip"`` such a sample scores 0
instead, and the node reports how many it replaced: ``node.last_bad_count`` (last call) and
``node.total_bad_count`` (since construction) in this process, a ``logging`` warning naming the
indices, and, where the count has to travel through a graph, the optional ``bad_samples`` output
(True where a score was replaced), enabled with ``emit_bad_mask=True``.

Token rewards. With ``token_level=True`` a sequence score is placed on the last real token of
``response_mask`` (:func:`place_on_last_token`); a rule may instead return its own per-token
rewards (``{"score": s, "token_rewards": [...]}``, one per real response token).

Nothing here downloads: models come from a local path or are built from a config in code.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from yatt_graph import ANY, BatchPolicy, Node, Port, Resources, Tensor
from yatt_graph.refs import import_ref

__all__ = [
    "ClipScoreReward",
    "RewardModel",
    "RewardNode",
    "RuleReward",
    "char_tokenizer",
    "clip_score",
    "contains_answer",
    "exact_match",
    "place_on_last_token",
    "regex_format",
]

log = logging.getLogger(__name__)

_BAD_POLICIES = ("raise", "skip")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token rewards that are 0 everywhere but ``scores[i]`` on the last real token of row i.

    Args:
        scores: (B,) one score per sample.
        response_mask: (B, R); nonzero on real response tokens.

    Returns:
        (B, R) float32.
    """
    if scores.dim() != 1 or response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"place_on_last_token: scores {tuple(scores.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must be (B,) and (B, R)"
        )
    real = response_mask != 0  # (B, R)
    empty = (~real.any(dim=1)).nonzero().reshape(-1)  # (K,)
    if empty.numel():
        raise ValueError(
            f"place_on_last_token: response_mask row {int(empty[0])} has no real token "
            f"({empty.numel()} empty rows); every response needs at least one (its EOS)"
        )
    positions = torch.arange(real.shape[1], device=real.device)  # (R,)
    last = (positions * real).argmax(dim=1)  # (B,) index of the last real token
    out = torch.zeros(real.shape, dtype=torch.float32, device=scores.device)  # (B, R)
    out[torch.arange(real.shape[0]), last] = scores.to(torch.float32)
    return out


def _as_number(value: Any) -> float | None:
    """A float from a Python/numpy number, a bool or a 1-element tensor; None if not a number."""
    if isinstance(value, torch.Tensor):
        return float(value.reshape(-1)[0]) if value.numel() == 1 else None
    if isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
        return float(value)
    return None


def _check_list(node: str, port: str, values: Any, n: int | None) -> list[Any]:
    if isinstance(values, tuple):
        values = list(values)
    if not isinstance(values, list):
        raise ValueError(
            f"node {node!r}: input {port!r} must be a list, got {type(values).__name__}"
        )
    if n is not None and len(values) != n:
        # One item per prompt (N) for B = N * n samples: repeat, as the rollout groups rows.
        if values and n % len(values) == 0:
            return [v for v in values for _ in range(n // len(values))]
        raise ValueError(
            f"node {node!r}: input {port!r} has {len(values)} items but 'texts' has {n}; "
            "give one item per sample, or one per prompt when each prompt has the same number "
            "of samples"
        )
    return values


# ---------------------------------------------------------------------------------------------
# the shared base
# ---------------------------------------------------------------------------------------------


class RewardNode(Node):
    """Base of the reward nodes: input checks, bad-score policy and token rewards.

    A subclass implements :meth:`score_samples`, returning B raw scores (a list of numbers or
    dicts, or a tensor); this class turns them into ``scores`` float32[B].
    """

    kind = "reward"
    batch_policy = BatchPolicy(max_batch_size=256)
    """Scores are per sample: a call may take any part of a batch (split, or fed per piece of a
    streaming rollout)."""
    inputs = {
        "texts": Port(ANY, doc="list[str]: the B decoded responses"),
        "meta": Port(ANY, required=False, doc="list[dict]: per-sample metadata (e.g. answer)"),
        "prompts": Port(ANY, required=False, doc="list[str]: the B prompts"),
        "images": Port(ANY, required=False, doc="list[PIL.Image.Image]: the B images"),
        "response_mask": Port(Tensor("float32", "B", "R"), required=False),
    }
    outputs = {"scores": Tensor("float32", "B")}

    def __init__(
        self,
        *,
        token_level: bool = False,
        on_bad_sample: str = "raise",
        emit_bad_mask: bool = False,
        name: str | None = None,
        device: str = "cpu",
    ) -> None:
        if on_bad_sample not in _BAD_POLICIES:
            raise ValueError(f"on_bad_sample must be one of {_BAD_POLICIES}, got {on_bad_sample!r}")
        kind = "cuda" if str(device).startswith("cuda") else "cpu"
        super().__init__(name=name, resources=Resources(device=kind))
        self.token_level = token_level
        self.on_bad_sample = on_bad_sample
        self.emit_bad_mask = emit_bad_mask
        self.device = torch.device(device)
        self.last_bad_count = 0
        self.total_bad_count = 0
        if token_level:
            self.inputs["response_mask"] = Port(Tensor("float32", "B", "R"), required=True)
            self.outputs["token_rewards"] = Port(Tensor("float32", "B", "R"))
        if emit_bad_mask:
            self.outputs["bad_samples"] = Port(Tensor("bool", "B"))

    def score_samples(
        self,
        texts: list[str],
        meta: list[dict[str, Any]],
        prompts: list[str] | None,
        images: list[Any] | None,
    ) -> Sequence[Any] | torch.Tensor:
        """B raw scores: numbers, dicts ``{"score": x, ...}``, or a (B,) tensor."""
        raise NotImplementedError

    def forward(self, texts, meta=None, prompts=None, images=None, response_mask=None):
        texts = _check_list(self.name, "texts", texts, None)
        n = len(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise ValueError(
                    f"node {self.name!r}: texts[{i}] is a {type(t).__name__}; texts must be strings"
                )
        meta = [{}] * n if meta is None else _check_list(self.name, "meta", meta, n)
        prompts = None if prompts is None else _check_list(self.name, "prompts", prompts, n)
        images = None if images is None else _check_list(self.name, "images", images, n)
        if response_mask is not None and response_mask.shape[0] != n:
            raise ValueError(
                f"node {self.name!r}: response_mask has {response_mask.shape[0]} rows but texts "
                f"has {n} samples"
            )
        raw = self.score_samples(texts, meta, prompts, images)
        return self._finish(raw, n, response_mask)

    # --- raw scores -> outputs ----------------------------------------------------------------
    def _bad(self, i: int, what: str, value: Any) -> None:
        if self.on_bad_sample == "raise":
            raise ValueError(
                f"node {self.name!r}: sample {i} got {what} {value!r}; a reward must be a finite "
                "number. Fix the reward, or pass on_bad_sample='skip' to score such samples 0 "
                "and count them"
            )

    def _finish(self, raw: Any, n: int, response_mask: torch.Tensor | None) -> dict[str, Any]:
        if isinstance(raw, torch.Tensor):
            values: list[Any] = raw.detach().float().cpu().reshape(-1).tolist()
        else:
            values = list(raw)
        if len(values) != n:
            raise ValueError(f"node {self.name!r}: produced {len(values)} scores for {n} samples")
        scores = torch.zeros(n, dtype=torch.float32)  # (B,)
        bad = torch.zeros(n, dtype=torch.bool)  # (B,)
        token_rows: dict[int, list[float]] = {}
        for i, value in enumerate(values):
            per_token = None
            if isinstance(value, Mapping):
                if "score" not in value:
                    raise ValueError(
                        f"node {self.name!r}: sample {i} returned a dict without 'score' "
                        f"(keys {sorted(value)}); return a number or {{'score': x, ...}}"
                    )
                per_token = value.get("token_rewards")
                value = value["score"]
            number = _as_number(value)
            if number is None:
                self._bad(i, f"a non-numeric score ({type(value).__name__})", value)
                bad[i] = True
                continue
            if not math.isfinite(number):
                self._bad(i, "a non-finite score", number)
                bad[i] = True
                continue
            if per_token is not None and self.token_level:
                row = [_as_number(v) for v in per_token]
                broken = [v for v in row if v is None or not math.isfinite(v)]
                if broken:
                    self._bad(i, "a non-finite or non-numeric token reward", broken[0])
                    bad[i] = True
                    continue
                token_rows[i] = row
            scores[i] = number
        self._count(bad)
        out: dict[str, Any] = {"scores": scores}
        if self.token_level:
            out["token_rewards"] = self._token_rewards(scores, response_mask, token_rows)
        if self.emit_bad_mask:
            out["bad_samples"] = bad
        return out

    def _count(self, bad: torch.Tensor) -> None:
        self.last_bad_count = int(bad.sum())
        self.total_bad_count += self.last_bad_count
        if self.last_bad_count:
            where = bad.nonzero().reshape(-1).tolist()
            log.warning(
                "node %r: %d sample(s) had a NaN/inf/non-numeric reward and were scored 0: %s",
                self.name,
                self.last_bad_count,
                where[:20],
            )

    def _token_rewards(
        self, scores: torch.Tensor, mask: torch.Tensor, rows: dict[int, list[float]]
    ) -> torch.Tensor:
        try:
            out = place_on_last_token(scores, mask.cpu())  # (B, R)
        except ValueError as exc:
            raise ValueError(f"node {self.name!r}: {exc}") from exc
        for i, row in rows.items():
            real = (mask[i] != 0).nonzero().reshape(-1).cpu()  # (L,) positions of real tokens
            if len(row) != len(real):
                raise ValueError(
                    f"node {self.name!r}: sample {i} returned {len(row)} token rewards but its "
                    f"response_mask has {len(real)} real tokens; give one per real token"
                )
            out[i].zero_()
            out[i, real] = torch.tensor(row, dtype=torch.float32)
        return out


# ---------------------------------------------------------------------------------------------
# rule rewards
# ---------------------------------------------------------------------------------------------


def _normalize(s: str) -> str:
    return " ".join(str(s).strip().lower().split())


def _answers(meta: Mapping[str, Any], key: str, rule: str) -> list[str]:
    if key not in meta:
        raise ValueError(f"{rule}: meta has no {key!r} key (its keys: {sorted(meta)})")
    answer = meta[key]
    return [str(a) for a in answer] if isinstance(answer, list | tuple) else [str(answer)]


def exact_match(
    text: str, meta: Mapping[str, Any], *, key: str = "answer", normalize: bool = True
) -> float:
    """1.0 if the response equals ``meta[key]`` (or one of them, if a list), else 0.0.

    With ``normalize`` both sides are stripped, lower-cased and whitespace-collapsed.
    """
    fix = _normalize if normalize else str
    return float(any(fix(text) == fix(a) for a in _answers(meta, key, "exact_match")))


def contains_answer(
    text: str, meta: Mapping[str, Any], *, key: str = "answer", case_sensitive: bool = False
) -> float:
    """1.0 if ``meta[key]`` (or one of them, if a list) occurs in the response, else 0.0."""
    fix = (lambda s: s) if case_sensitive else (lambda s: s.lower())
    return float(any(fix(a) in fix(text) for a in _answers(meta, key, "contains_answer")))


def regex_format(
    text: str, meta: Mapping[str, Any], *, pattern: str, full_match: bool = False
) -> float:
    """1.0 if the response matches ``pattern`` (``re.search``, or ``re.fullmatch`` with
    ``full_match``; DOTALL, so ``.`` spans lines), else 0.0. ``meta`` is not read."""
    match = re.fullmatch if full_match else re.search
    return float(match(pattern, text, flags=re.DOTALL) is not None)


class RuleReward(RewardNode):
    """Scores each sample with a user function ``fn(text, meta, **params) -> float | dict``.

    Args:
        fn: a module-level function, or its reference ``"package.module:function"`` (imported,
            never evaluated). It returns a number (bools count as 0/1) or a dict
            ``{"score": x, "token_rewards": [...]?, ...}``; other dict keys are ignored.
        params: keyword arguments passed to ``fn`` (JSON values), e.g. ``{"pattern": "..."}``.
        token_level, on_bad_sample, emit_bad_mask: see the module docstring.
    """

    def __init__(
        self,
        fn: Callable[..., Any] | str,
        *,
        params: Mapping[str, Any] | None = None,
        token_level: bool = False,
        on_bad_sample: str = "raise",
        emit_bad_mask: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__(
            token_level=token_level,
            on_bad_sample=on_bad_sample,
            emit_bad_mask=emit_bad_mask,
            name=name,
        )
        if isinstance(fn, str):
            fn = import_ref(fn)
        if not callable(fn):
            raise TypeError(
                f"node {self.name!r}: fn must be callable or 'module:function', got {fn!r}"
            )
        if "<" in getattr(fn, "__qualname__", "<"):
            raise TypeError(
                f"node {self.name!r}: fn {getattr(fn, '__qualname__', fn)!r} is a lambda or a local "
                "function; define it at module level so that a plan can rebuild this node elsewhere"
            )
        self.fn = fn
        self.params = dict(params or {})
        self._fn_name = f"{getattr(fn, '__module__', '?')}:{fn.__qualname__}"

    def score_samples(self, texts, meta, prompts, images):
        out = []
        for i, (text, m) in enumerate(zip(texts, meta)):
            try:
                out.append(self.fn(text, m if m is not None else {}, **self.params))
            except Exception as exc:
                raise ValueError(
                    f"node {self.name!r}: reward function {self._fn_name} failed on sample {i}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        return out


# ---------------------------------------------------------------------------------------------
# learned reward model
# ---------------------------------------------------------------------------------------------


def char_tokenizer(extra_chars: str = "") -> Any:
    """A character-level ``PreTrainedTokenizerFast`` built offline: printable ASCII, tab and
    newline (plus ``extra_chars``) and ``<pad>`` (id 0), ``<unk>`` (1), ``<eos>`` (2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2}
    for c in [chr(i) for i in range(32, 127)] + ["\t", "\n"] + list(extra_chars):
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RewardModel(RewardNode):
    """A learned reward: a transformers sequence classifier with one logit, on prompt + response.

    Exactly one of:

    * ``path``: a local directory with the model and its tokenizer (``save_pretrained``);
    * ``config``: transformers config keyword arguments with ``"model_type"``, e.g.
      ``{"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32}``: a randomly initialized
      model (seeded with ``seed``, so every process builds the same one) with
      :func:`char_tokenizer`; for tests and demos;
    * ``model`` (+ ``tokenizer``): live objects, an in-process escape hatch (not rebuildable).

    Args:
        template: how the scored text is made, with ``{prompt}`` and ``{response}``.
        max_length: longest input in tokens; longer inputs lose their beginning (left truncation,
            so that the end of the response is kept).
        micro_batch_size: samples per forward pass.
        device, dtype: where and in what precision the model runs (``"float32"``, ``"bfloat16"``).
    """

    def __init__(
        self,
        path: str | None = None,
        *,
        config: Mapping[str, Any] | None = None,
        seed: int = 0,
        template: str = "{prompt}{response}",
        max_length: int = 512,
        micro_batch_size: int = 16,
        device: str = "cpu",
        dtype: str = "float32",
        token_level: bool = False,
        on_bad_sample: str = "raise",
        emit_bad_mask: bool = False,
        name: str | None = None,
        model: Any = None,
        tokenizer: Any = None,
    ) -> None:
        super().__init__(
            token_level=token_level,
            on_bad_sample=on_bad_sample,
            emit_bad_mask=emit_bad_mask,
            name=name,
            device=device,
        )
        if sum(x is not None for x in (path, config, model)) != 1:
            raise ValueError(
                f"node {self.name!r}: give exactly one of path= (a local model directory), "
                "config= (transformers config kwargs with 'model_type') or model="
            )
        if "{response}" not in template:
            raise ValueError(f"node {self.name!r}: template {template!r} must contain {{response}}")
        if dtype not in _TORCH_DTYPES:
            raise ValueError(f"node {self.name!r}: dtype must be one of {sorted(_TORCH_DTYPES)}")
        if micro_batch_size < 1 or max_length < 1:
            raise ValueError(f"node {self.name!r}: micro_batch_size and max_length must be >= 1")
        self.template, self.max_length, self.micro_batch_size = (
            template,
            max_length,
            micro_batch_size,
        )
        if model is not None:
            if tokenizer is None:
                raise ValueError(f"node {self.name!r}: model= needs tokenizer= too")
            self.model, self.tokenizer = model, tokenizer
        elif path is not None:
            self.model, self.tokenizer = self._load(path)
        else:
            self.model, self.tokenizer = self._build(dict(config), seed)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if getattr(self.model.config, "num_labels", 1) != 1:
            raise ValueError(
                f"node {self.name!r}: the model has num_labels={self.model.config.num_labels}; "
                "a reward model needs a single-logit head (num_labels=1)"
            )
        self.model.to(device=self.device, dtype=_TORCH_DTYPES[dtype]).eval()

    def _load(self, path: str) -> tuple[Any, Any]:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"node {self.name!r}: reward model path {path!r} is not a directory; pass a local "
                "directory written by save_pretrained (nothing is downloaded)"
            )
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True)
        return model, tokenizer

    def _build(self, config: dict[str, Any], seed: int) -> tuple[Any, Any]:
        from transformers import AutoConfig, AutoModelForSequenceClassification

        if "model_type" not in config:
            raise ValueError(f"node {self.name!r}: config needs 'model_type' (e.g. 'gpt2')")
        tokenizer = char_tokenizer()
        vocab = len(tokenizer)
        config.setdefault("vocab_size", vocab)
        if config["vocab_size"] < vocab:
            raise ValueError(
                f"node {self.name!r}: config vocab_size={config['vocab_size']} is smaller than the "
                f"character tokenizer's {vocab}"
            )
        ids = {"pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 2}
        cfg = AutoConfig.for_model(config.pop("model_type"), num_labels=1, **{**ids, **config})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForSequenceClassification.from_config(cfg)
        return model, tokenizer

    def score_samples(self, texts, meta, prompts, images):
        prompts = prompts if prompts is not None else [""] * len(texts)
        inputs = [self.template.format(prompt=p, response=t) for p, t in zip(prompts, texts)]
        scores = []
        with torch.inference_mode():
            for start in range(0, len(inputs), self.micro_batch_size):
                chunk = inputs[start : start + self.micro_batch_size]
                enc = self.tokenizer(
                    chunk,
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                ).to(self.device)
                logits = self.model(**enc).logits  # (b, 1)
                scores.append(logits[:, 0].float().cpu())  # (b,)
        return torch.cat(scores) if scores else torch.zeros(0)  # (B,)


# ---------------------------------------------------------------------------------------------
# CLIP score
# ---------------------------------------------------------------------------------------------


def clip_score(
    image_embeds: torch.Tensor,
    text_embeds: torch.Tensor,
    scale: float = 2.5,
    clamp_negative: bool = True,
) -> torch.Tensor:
    """Per-sample ``scale * cos(image_i, text_i)`` (CLIPScore, Hessel et al. 2021: w=2.5, and
    negative similarities clamped to 0). A zero or non-finite embedding gives NaN (not 0), so
    that broken inputs are caught by the reward's bad-score check.

    Args:
        image_embeds: (B, D).
        text_embeds: (B, D).

    Returns:
        (B,) float32, in [0, scale] (or [-scale, scale] without ``clamp_negative``).
    """
    a, b = image_embeds.float(), text_embeds.float()  # (B, D)
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))  # (B,)
    cos = cos.clamp(-1.0, 1.0)  # (B,) rounding can leave |cos| a hair above 1
    if clamp_negative:
        cos = cos.clamp(min=0.0)  # (B,)
    return scale * cos  # (B,)


class ClipScoreReward(RewardNode):
    """Image-text agreement through open_clip: ``scale * max(cos(image, text), 0)`` per sample.

    Args:
        model_name: an open_clip architecture (``open_clip.list_models()``) or ``"local-dir:PATH"``.
            Its tokenizer must work offline: the built-in ``SimpleTokenizer`` (CLIP ViT/RN models)
            does; SigLIP and HF-text models need the hub and are refused with a message.
        pretrained: None (random weights, seeded with ``seed``) or a local checkpoint file.
            Named tags (``"openai"``, ...) would download weights and are refused.
        model_overrides: open_clip model-config overrides (``embed_dim``, ``vision_cfg``,
            ``text_cfg``), e.g. a tiny tower for tests.
        text_source: score ``"texts"`` (the responses, e.g. captions) or ``"prompts"``.
        scale, clamp_negative: see :func:`clip_score`.
    """

    inputs = {**RewardNode.inputs, "images": Port(ANY, doc="list[PIL.Image.Image]: B images")}

    def __init__(
        self,
        model_name: str = "ViT-B-32",
        pretrained: str | None = None,
        *,
        model_overrides: Mapping[str, Any] | None = None,
        seed: int = 0,
        text_source: str = "texts",
        scale: float = 2.5,
        clamp_negative: bool = True,
        micro_batch_size: int = 32,
        device: str = "cpu",
        token_level: bool = False,
        on_bad_sample: str = "raise",
        emit_bad_mask: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__(
            token_level=token_level,
            on_bad_sample=on_bad_sample,
            emit_bad_mask=emit_bad_mask,
            name=name,
            device=device,
        )
        import open_clip

        if text_source not in ("texts", "prompts"):
            raise ValueError(f"node {self.name!r}: text_source must be 'texts' or 'prompts'")
        if model_name.startswith("hf-hub:"):
            raise ValueError(
                f"node {self.name!r}: {model_name!r} would download; use a local-dir: path"
            )
        if pretrained is not None and not os.path.isfile(pretrained):
            raise ValueError(
                f"node {self.name!r}: pretrained={pretrained!r} is not a local file; named tags "
                "download weights, which this project never does. Pass a checkpoint file, or None "
                "for random weights"
            )
        self.text_source, self.scale, self.clamp_negative = text_source, scale, clamp_negative
        self.micro_batch_size = micro_batch_size
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model, _, preprocess = open_clip.create_model_and_transforms(
                model_name, pretrained=pretrained, device=self.device, **dict(model_overrides or {})
            )
        self.model, self.preprocess = model.eval(), preprocess
        try:
            self.tokenizer = open_clip.get_tokenizer(
                model_name, context_length=getattr(model, "context_length", None)
            )
        except Exception as exc:  # HF-hub tokenizers fail offline in many ways
            raise ValueError(
                f"node {self.name!r}: the tokenizer of {model_name!r} could not be made offline "
                f"({type(exc).__name__}: {exc}); use a model with open_clip's built-in "
                "SimpleTokenizer (e.g. ViT-B-32, ViT-S-32)"
            ) from exc
        vocab = len(getattr(self.tokenizer, "encoder", ()))
        if vocab and getattr(model, "vocab_size", vocab) < vocab:
            raise ValueError(
                f"node {self.name!r}: the text tower's vocab_size {model.vocab_size} is smaller than "
                f"the tokenizer's {vocab}; keep text_cfg.vocab_size at {vocab}"
            )

    def embed(
        self, images: Sequence[Any], texts: Sequence[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Image and text embeddings, (B, D) each, unnormalized, float32."""
        from PIL import Image

        for i, im in enumerate(images):
            if not isinstance(im, Image.Image):
                raise ValueError(
                    f"node {self.name!r}: images[{i}] is a {type(im).__name__}; expected a PIL image"
                )
        image_parts, text_parts = [], []
        with torch.inference_mode():
            for start in range(0, len(texts), self.micro_batch_size):
                stop = start + self.micro_batch_size
                pixels = torch.stack(
                    [self.preprocess(im) for im in images[start:stop]]
                )  # (b, 3, H, W)
                tokens = self.tokenizer(list(texts[start:stop]))  # (b, context_length)
                image_parts.append(self.model.encode_image(pixels.to(self.device)).float().cpu())
                text_parts.append(self.model.encode_text(tokens.to(self.device)).float().cpu())
        if not image_parts:
            return torch.zeros(0, 0), torch.zeros(0, 0)
        return torch.cat(image_parts), torch.cat(text_parts)  # (B, D), (B, D)

    def score_samples(self, texts, meta, prompts, images):
        if self.text_source == "prompts":
            if prompts is None:
                raise ValueError(f"node {self.name!r}: text_source='prompts' but no prompts given")
            texts = prompts
        if not texts:
            return torch.zeros(0)
        image_embeds, text_embeds = self.embed(images, texts)  # (B, D), (B, D)
        return clip_score(image_embeds, text_embeds, self.scale, self.clamp_negative)  # (B,)
