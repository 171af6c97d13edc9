"""The CLIP score reward: how well the response names what the sample's image shows."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nodes.models.offload import Offload
from nodes.rewards.base import RewardNode
from nodes.vision import _open_clip_model
from yatt_graph import ANY, Port
from yatt_graph.node import Built

__all__ = ["TINY_CLIP_REWARD_CFG", "ClipScoreReward", "clip_score"]

#: open_clip overrides for a test-sized ViT-S-32 (the ``clip`` reward spelling): its text tower
#: keeps the built-in tokenizer's vocabulary (49408), so it tokenizes offline.
TINY_CLIP_REWARD_CFG: dict[str, Any] = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


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


class ClipScoreReward(Offload, RewardNode):
    """Image-text agreement through open_clip: ``scale * max(cos(image, text), 0)`` per sample.

    The text is ``template`` filled with the sample's response (and, if the template says so,
    its prompt and meta values), so the reward is high when the response names what the image
    shows: with a real CLIP, "a red circle" against a picture of a red circle. The answer is not
    read by default: the image is the reference. ``"a photo of {response}"`` suits short answers
    ("red circle") with real CLIP weights.

    Ports: ``texts`` and ``images`` (required), ``meta`` (for meta placeholders), ``prompts``
    (only for a template with ``{prompt}``).

    Args:
        model_name: an open_clip architecture (``open_clip.list_models()``) or ``"local-dir:PATH"``.
            Its tokenizer must work offline: the built-in ``SimpleTokenizer`` (CLIP ViT/RN models)
            does; SigLIP and HF-text models need the hub and are refused with a message.
        pretrained: None (random weights, seeded with ``seed``) or a local checkpoint file.
            Named tags (``"openai"``, ...) would download weights and are refused.
        model_overrides: open_clip model-config overrides (``embed_dim``, ``vision_cfg``,
            ``text_cfg``), e.g. :data:`TINY_CLIP_REWARD_CFG`.
        template: the scored text, with ``{response}`` and/or ``{prompt}`` and meta keys.
        meta_keys: the meta keys the template may use (default: ``answer``).
        text_source: ``"prompts"`` is the older spelling of ``template="{prompt}"``.
        scale, clamp_negative: see :func:`clip_score`.
        options: the RewardNode options (token_level, on_bad_sample, emit_bad_mask, name).
    """

    inputs = {**RewardNode.inputs, "images": Port(ANY, doc="list[PIL.Image.Image]: B images")}
    needs_images = True
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
        template: str = "{response}",
        meta_keys: Sequence[str] = ("answer",),
        text_source: str = "texts",
        scale: float = 2.5,
        clamp_negative: bool = True,
        micro_batch_size: int = 32,
        device: str = "cpu",
        **options: Any,
    ) -> None:
        super().__init__(device=device, **options)
        if text_source not in ("texts", "prompts"):
            raise ValueError(f"node {self.name!r}: text_source must be 'texts' or 'prompts'")
        if text_source == "prompts":
            if template != "{response}":
                raise ValueError(
                    f"node {self.name!r}: give template= or text_source='prompts', not both"
                )
            template = "{prompt}"
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
        if micro_batch_size < 1:
            raise ValueError(f"node {self.name!r}: micro_batch_size must be >= 1")
        self._set_template(template, meta_keys, one_of=("response", "prompt"))
        self.scale, self.clamp_negative = scale, clamp_negative
        self.micro_batch_size = micro_batch_size
        self.model_name, self.pretrained, self.seed = model_name, pretrained, int(seed)
        self.overrides = dict(model_overrides or {})

    def build(self) -> None:
        import open_clip

        name = self.model_name
        model, preprocess = _open_clip_model(self, name, self.pretrained, self.overrides)
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
        if images is None:
            raise ValueError(
                f"node {self.name!r}: a CLIP score compares each response with its image, and no "
                "images were given; wire images= (the data's images), or use a reward that reads "
                "text only (a rule, model:DIR or judge:DIR) in a text-only graph"
            )
        if not texts:
            return torch.zeros(0)
        scored = self._fill(texts, meta, prompts)
        image_embeds, text_embeds = self.embed(images, scored)  # (B, D), (B, D)
        return clip_score(image_embeds, text_embeds, self.scale, self.clamp_negative)  # (B,)
