"""Model rewards: a learned reward model and the CLIP image-text score."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from nodes.models.files import _check_checkpoint_dir, _loading, _read_json
from nodes.rewards.base import RewardNode
from yatt_graph import ANY, Port
from yatt_graph.node import Built

__all__ = ["ClipScoreReward", "RewardModel", "char_tokenizer", "clip_score"]

# ---------------------------------------------------------------------------------------------
# learned reward model
# ---------------------------------------------------------------------------------------------


def char_tokenizer(extra_chars: str = "") -> Any:
    """A character-level ``PreTrainedTokenizerFast`` built offline: printable ASCII, tab and
    newline (plus ``extra_chars``) and ``<pad>`` (id 0), ``<unk>`` (1), ``<eos>`` (2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = _char_vocab(extra_chars)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )


def _char_vocab(extra_chars: str = "") -> dict[str, int]:
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2}
    for c in [chr(i) for i in range(32, 127)] + ["\t", "\n"] + list(extra_chars):
        vocab.setdefault(c, len(vocab))
    return vocab


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
            vocab = len(_char_vocab())
            if config.get("vocab_size", vocab) < vocab:
                raise ValueError(
                    f"node {self.name!r}: config vocab_size={config['vocab_size']} is smaller "
                    f"than the character tokenizer's {vocab}"
                )
        self.path, self.model_config, self.seed, self.dtype = path, config, int(seed), dtype
        self.needs_prompts = "{prompt}" in template
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
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
        tokenizer.truncation_side = "left"
        model.config.pad_token_id = tokenizer.pad_token_id
        self._check_head(model)
        self.model = model.to(device=self.device, dtype=_TORCH_DTYPES[self.dtype]).eval()
        self.tokenizer = tokenizer

    def _load(self, path: str) -> tuple[Any, Any]:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        fn = f"node {self.name!r}"
        _check_checkpoint_dir(fn, Path(path))
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
        with _loading(fn, Path(path)):
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True)
        return model, tokenizer

    def _build(self, config: dict[str, Any], seed: int) -> tuple[Any, Any]:
        from transformers import AutoConfig, AutoModelForSequenceClassification

        tokenizer = char_tokenizer()
        config.setdefault("vocab_size", len(tokenizer))
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
    needs_images = True
    needs_prompts = False  # True on an instance with text_source="prompts"
    model = Built("the open_clip model, built by setup()")
    preprocess = Built("its image transforms")
    tokenizer = Built("its text tokenizer")

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
        self.needs_prompts = text_source == "prompts"
        self.micro_batch_size = micro_batch_size
        self.model_name, self.pretrained, self.seed = model_name, pretrained, int(seed)
        self.overrides = dict(model_overrides or {})

    def build(self) -> None:
        import open_clip

        name = self.model_name
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            try:
                model, _, preprocess = open_clip.create_model_and_transforms(
                    name, pretrained=self.pretrained, device=self.device, **self.overrides
                )
            except Exception as exc:
                if self.pretrained is None:
                    raise
                raise ValueError(
                    f"node {self.name!r}: open_clip weights file {self.pretrained!r} could not be "
                    f"loaded into {name!r} ({type(exc).__name__}: "
                    f"{(str(exc).strip().splitlines() or [''])[0]})"
                ) from exc
        try:
            tokenizer = open_clip.get_tokenizer(
                name, context_length=getattr(model, "context_length", None)
            )
        except Exception as exc:  # HF-hub tokenizers fail offline in many ways
            raise ValueError(
                f"node {self.name!r}: the tokenizer of {name!r} could not be made offline "
                f"({type(exc).__name__}: {exc}); use a model with open_clip's built-in "
                "SimpleTokenizer (e.g. ViT-B-32, ViT-S-32)"
            ) from exc
        vocab = len(getattr(tokenizer, "encoder", ()))
        if vocab and getattr(model, "vocab_size", vocab) < vocab:
            raise ValueError(
                f"node {self.name!r}: the text tower's vocab_size {model.vocab_size} is smaller than "
                f"the tokenizer's {vocab}; keep text_cfg.vocab_size at {vocab}"
            )
        self.model, self.preprocess, self.tokenizer = model.eval(), preprocess, tokenizer

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
