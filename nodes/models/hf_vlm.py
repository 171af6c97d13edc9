"""transformers' own image-text-to-text models (Qwen2-VL, ...) as a policy family.

See :mod:`nodes.models.policy_base` for the interface every family implements.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nodes.chat import chat_messages, needs_template
from nodes.models.files import _load_pretrained, _no_bars, _pin_tokenizer_json
from nodes.models.policy_base import (
    _QWEN_VISION_TOKENS,
    _TINY_CHAT_TEMPLATE,
    TINY_MARK,
    Policy,
    PromptBatch,
    _check_response,
    char_tokenizer,
    word_tokenizer,
)
from nodes.seeding import seeded

__all__ = ["HFVisionLanguagePolicy", "tiny_qwen2_vl"]


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
    def _format(self, prompt: Any, with_image: bool) -> str:
        template = getattr(self.processor, "chat_template", None)
        messages = chat_messages(prompt)
        if self.use_chat_template and template:
            if messages is None:
                messages = [{"role": "user", "content": prompt}]
            if with_image:  # the image goes first in the first user message
                first = next(i for i, m in enumerate(messages) if m["role"] == "user")
                text = messages[first]["content"]
                parts = [{"type": "text", "text": text}] if isinstance(text, str) else list(text)
                messages[first] = {**messages[first], "content": [{"type": "image"}, *parts]}
            return self.processor.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        if messages is not None:
            why = "chat_template=false" if template else "its processor has none"
            raise needs_template(why)
        return (self.image_token or "") + prompt if with_image else prompt

    def _check_images(self, fn: str, images: Sequence[Any] | None, n: int) -> None:
        if images is not None and len(images) != n:
            raise ValueError(
                f"{fn}: {len(images)} images for {n} prompts; give one image per prompt"
            )

    def _pixels(self, images: Sequence[Any]) -> dict[str, Tensor]:
        """The image processor's inputs for one image a row, or a list of images a row (a
        multi-turn trajectory's, in the order their placeholders appear): row after row."""
        flat = [im for row in images for im in (row if isinstance(row, list | tuple) else [row])]
        if not flat:
            return {}
        return dict(self.processor.image_processor(flat, return_tensors="pt"))

    def image_token_count(self, image_grid_thw: Tensor) -> int:
        """The placeholder tokens that images of these grids take in the text (int)."""
        merge = int(getattr(self.processor.image_processor, "merge_size", 1))
        return int(image_grid_thw.prod(-1).sum()) // (merge * merge)

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
        extra: dict[str, Tensor] = {} if images is None else self._pixels(images)
        extra.update(self._token_types(prompt_ids))
        return PromptBatch(prompt_ids, prompt_mask.long(), extra)

    def _token_types(self, ids: Tensor) -> dict[str, Tensor]:
        """The per-token type ids the processor gives ``ids`` (int64[B, T]): text 0, image 1,
        video 2 (``mm_token_type_ids``, Qwen2-VL) or image 1 (``token_type_ids``, Gemma-3)."""
        names = set(getattr(self.processor, "model_input_names", ()))
        is_image = ids == self.image_token_id if self.image_token_id is not None else None
        out = {}
        if "mm_token_type_ids" in names:
            types = torch.zeros_like(ids)
            if is_image is not None:
                types[is_image] = 1
            if self.video_token_id is not None:
                types[ids == self.video_token_id] = 2
            out["mm_token_type_ids"] = types
        if "token_type_ids" in names and is_image is not None:
            out["token_type_ids"] = is_image.long()
        return out

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
        images = bool(placeholder.any())  # a multi-turn trajectory's observation images
        if images:
            held, filled = self._placeholders(batch, response_ids, placeholder)
            video = bool((response_ids.to(dev)[placeholder] == self.video_token_id).any())
            if held != filled or video or self.image_token_id is None:
                b, t = placeholder.nonzero()[0].tolist()
                raise ValueError(
                    f"{fn}: response_ids[{b}, {t}] is {int(response_ids[b, t])}, a multimodal "
                    f"placeholder token {self.suppressed_token_ids}; a response may hold one "
                    "only where an observation's image fills it, and the prompts and "
                    f"responses hold {held} image placeholder tokens and the images given fill "
                    f"{filled} (the model would look for image features that do not exist)"
                )
        extra = self._model_inputs(batch, batch.prompt_ids.shape[1] + response_ids.shape[1])
        if images:  # the types of the observations' image tokens in the response, too
            resp = torch.where(real, response_ids.to(dev), self.pad_token_id)  # (B, R)
            full = torch.cat([batch.prompt_ids.to(dev), resp], 1)  # (B, P+R)
            extra.update({k: v.to(dev) for k, v in self._token_types(full).items()})
        return self._token_pass(batch, response_ids, real, logits, hidden, False, **extra)

    def _placeholders(
        self, batch: PromptBatch, response_ids: Tensor, placeholder: Tensor
    ) -> tuple[int, int]:
        """(image placeholder tokens in the prompts and the responses, the tokens the batch's
        images fill)."""
        grid = batch.model_inputs.get("image_grid_thw")
        filled = 0 if grid is None else self.image_token_count(grid)
        is_image = response_ids.to(placeholder.device) == self.image_token_id
        held = int((batch.prompt_ids == self.image_token_id).sum())
        return held + int((placeholder & is_image).sum()), filled

    def _generate_raw(self, batch, gen_config, **kwargs) -> Tensor:
        extra = self._model_inputs(batch, batch.prompt_ids.shape[1])
        return super()._generate_raw(batch, gen_config, **extra, **kwargs)

    # --- files -------------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        """``model.save_pretrained`` + ``processor.save_pretrained`` into one directory (a LoRA
        policy is saved merged, so ``AutoModelForImageTextToText`` loads it; a tiny policy's
        tokenizer, built in code, loads as it is: :func:`nodes.models.files.save_tokenizer`)."""
        with _no_bars():
            self._export_model().save_pretrained(path)
        self.processor.save_pretrained(path)
        if getattr(self.model.config, TINY_MARK, False):  # a tokenizer built in code
            _pin_tokenizer_json(Path(path))

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: str = "float32", use_chat_template: bool = True
    ) -> HFVisionLanguagePolicy:
        """Load a VLM and its processor from a local directory (never downloads)."""
        from transformers import AutoProcessor

        fn = "HFVisionLanguagePolicy.from_pretrained"
        model, processor = _load_pretrained(
            fn, path, "AutoModelForImageTextToText", dtype,
            lambda p: AutoProcessor.from_pretrained(p, local_files_only=True), "processor",
        )  # fmt: skip
        return cls(model, processor, use_chat_template=use_chat_template)


def tiny_qwen2_vl(
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_depth: int = 2,
    vision_dim: int = 32,
    patch_size: int = 8,
    image_size: int = 32,
    words: Sequence[str] | None = None,
) -> HFVisionLanguagePolicy:
    """A random Qwen2-VL with tiny vision and text towers and a processor built in code.

    The processor is ``Qwen2VLProcessor`` made of a ``Qwen2VLImageProcessor`` and
    ``Qwen2VLVideoProcessor`` sized to the vision tower (patch 8, merge 2, images resized to
    at most ``image_size`` x ``image_size`` pixels, so a 32x32 image is 4 LM tokens), the
    character tokenizer of :func:`char_tokenizer` (or, given ``words``, the word-level one of
    :func:`word_tokenizer` over them) with Qwen's vision special tokens, and a
    small chat template. It saves and reloads with ``AutoProcessor`` like a real checkpoint.
    """
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = (
        char_tokenizer(_QWEN_VISION_TOKENS)
        if words is None
        else word_tokenizer(words, _QWEN_VISION_TOKENS)
    )
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
        **{TINY_MARK: True},
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
    with seeded(seed):
        model = Qwen2VLForConditionalGeneration(config)
    return HFVisionLanguagePolicy(model, processor).eval()
