"""The vision encoder node: an open_clip image tower turning PIL images into ``image_embeds``.

Any open_clip architecture name works (``open_clip.list_models()``); weights come from a local
file (``pretrained="/path/to/open_clip_model.safetensors"``) or stay random (``pretrained=None``).
``model_cfg`` overrides fields of the named config (``embed_dim``, ``vision_cfg``,
``text_cfg``), which is how :func:`tiny_vision_encoder` gets a 2-layer, 64-wide ViT on 32x32
images that runs in milliseconds on a CPU. Only the image tower is kept.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from nodes.models.offload import Offload
from nodes.seeding import seeded
from yatt_graph import ANY, BatchPolicy, Node
from yatt_graph import Tensor as TensorPort
from yatt_graph.node import Built

__all__ = ["TINY_OPEN_CLIP_CFG", "VisionEncoder", "tiny_vision_encoder"]

#: Overrides that shrink an open_clip ViT to a test-sized model (D = 32, 32x32 images, 4x4
#: patches of 8 pixels, 2 layers of width 64). The text tower is shrunk too: open_clip always
#: builds one, and it is dropped after construction.
TINY_OPEN_CLIP_CFG: dict[str, Any] = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
    "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1},
}

#: PIL modes converted to RGB; every other mode is refused (16-bit and float images would be
#: silently clipped by PIL's conversion).
_CONVERTIBLE_MODES = frozenset({"RGB", "RGBA", "RGBX", "L", "LA", "P", "PA", "CMYK", "YCbCr", "1"})


@functools.cache
def _open_clip_configs() -> dict[str, dict[str, Any]]:
    """open_clip's architecture configs by model name, read from its package folder without
    importing it (the import takes seconds; only the process that builds the tower needs it).
    Read once per process; callers copy what they change."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.find_spec("open_clip")
    folders = [Path(p) / "model_configs" for p in (spec.submodule_search_locations or [])]
    files = sorted(f for folder in folders for f in folder.glob("*.json"))
    if not files:  # an install that keeps them elsewhere: ask open_clip itself
        import open_clip

        return {n: open_clip.get_model_config(n) for n in open_clip.list_models()}
    return {f.stem: json.loads(f.read_text()) for f in files}


def _open_clip_model(
    node: Any, name: str, pretrained: str | None, overrides: Mapping[str, Any], hint: str = ""
) -> tuple[Any, Any]:
    """open_clip's model ``name`` and its evaluation transforms, built on ``node.device`` with
    ``node.seed``; a weights file that does not load is a ValueError (``hint`` ends it)."""
    import open_clip

    with seeded(node.seed, node.device):
        try:
            model, _, preprocess = open_clip.create_model_and_transforms(
                name, pretrained=pretrained, device=node.device, **copy.deepcopy(dict(overrides))
            )
        except Exception as exc:
            if pretrained is None:
                raise
            why = (str(exc).strip().splitlines() or [""])[0]
            raise ValueError(
                f"node {node.name!r}: open_clip weights file {pretrained!r} could not be loaded "
                f"into {name!r} ({type(exc).__name__}: {why}){hint}"
            ) from exc
    return model, preprocess


class VisionEncoder(Offload, Node):
    """PIL images -> ``image_embeds: float32[B, D]`` with an open_clip image tower.

    The constructor checks the options and reads the architecture's config (``embed_dim``,
    ``image_size``); the tower is built by :meth:`setup`, in the process that runs the node.

    Images are preprocessed by the model's own evaluation transforms (resize, center crop,
    normalize). Modes L/LA/P/PA/RGBA/RGBX/CMYK/YCbCr/1 are converted to RGB (alpha dropped);
    others (``I;16``, ``I``, ``F``, ...) are refused with an error naming the image's index.

    Args:
        model_name: an open_clip architecture, e.g. ``"ViT-B-32"``.
        pretrained: None (random weights) or a local weights file for that architecture.
        model_cfg: overrides merged into the architecture's config (see TINY_OPEN_CLIP_CFG).
        trainable: False (default) keeps the tower frozen: eval mode, no grad, no
            ``requires_grad`` parameters. True leaves it in train mode and differentiable.
        normalize: L2-normalize the embeddings (as CLIP scores do); off by default.
        seed: seeds the random initialization (without touching the global RNG), so that a
            node rebuilt from its config in another process has the same random weights.
        device: where the tower runs; the embeddings are on it.
    """

    kind = "encoder"
    inputs = {"images": ANY}  # noqa: RUF012 - list[PIL.Image.Image]
    outputs = {"image_embeds": TensorPort("float32", "B", "D")}  # noqa: RUF012
    batch_policy = BatchPolicy(max_batch_size=64)
    tower = Built("the open_clip image tower (the text tower is dropped)")
    preprocess = Built("the model's evaluation transforms, PIL image -> float32[3, H, W]")

    def __init__(
        self,
        model_name: str = "ViT-B-32",
        pretrained: str | None = None,
        model_cfg: Mapping[str, Any] | None = None,
        trainable: bool = False,
        normalize: bool = False,
        seed: int = 0,
        device: str = "cpu",
        name: str | None = None,
        *,
        placement: str | int | None = None,
        batch_policy: BatchPolicy | None = None,
    ) -> None:
        super().__init__(name, placement=placement, batch_policy=batch_policy)
        if pretrained is not None and not os.path.isfile(pretrained):
            raise ValueError(
                f"node {self.name!r}: pretrained={pretrained!r} is not a local file; pass the "
                "path of an open_clip weights file (nothing is downloaded), or None"
            )
        configs = _open_clip_configs()
        known = sorted(configs)
        if model_name not in configs:
            raise ValueError(
                f"node {self.name!r}: unknown open_clip model {model_name!r}; "
                f"choose one of open_clip.list_models() (e.g. {known[:4]})"
            )
        self.model_name = model_name
        self.pretrained = pretrained
        self.overrides = copy.deepcopy(dict(model_cfg or {}))
        # open_clip replaces top-level config keys with the overrides (a shallow update)
        config = {**configs[model_name], **self.overrides}
        self.embed_dim = int(config["embed_dim"])
        size = dict(config.get("vision_cfg") or {}).get("image_size", 224)
        self.image_size = tuple(size) if isinstance(size, tuple | list) else (size, size)
        self.seed = int(seed)
        self.device = torch.device(device)
        self.trainable = bool(trainable)
        self.normalize = bool(normalize)

    def build(self) -> None:
        model, preprocess = _open_clip_model(
            self, self.model_name, self.pretrained, self.overrides,
            "; give an open_clip checkpoint of that architecture, or no file for random weights",
        )  # fmt: skip
        tower = model.visual  # the text tower is not needed
        del model
        tower.train(self.trainable)
        tower.requires_grad_(self.trainable)
        self.tower, self.preprocess = tower, preprocess

    # --- the work ----------------------------------------------------------------------------
    def _to_rgb(self, image: Any, index: int) -> Any:
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise ValueError(
                f"node {self.name!r}: images[{index}] is a {type(image).__name__}, not a "
                "PIL.Image.Image; load it with PIL.Image.open(path)"
            )
        if image.width == 0 or image.height == 0:
            raise ValueError(
                f"node {self.name!r}: images[{index}] has size {image.size}; it is empty"
            )
        if image.mode not in _CONVERTIBLE_MODES:
            raise ValueError(
                f"node {self.name!r}: images[{index}] has mode {image.mode!r}, which cannot be "
                f"turned into RGB without losing range; convert it yourself first (accepted "
                f"modes: {sorted(_CONVERTIBLE_MODES)})"
            )
        try:
            image.load()  # a lazily opened file is read here, so damage shows up here
            return image if image.mode == "RGB" else image.convert("RGB")
        except (OSError, SyntaxError) as exc:  # PIL's errors for truncated or corrupt data
            raise ValueError(
                f"node {self.name!r}: images[{index}] cannot be read ({exc}); the file is "
                "truncated or corrupt: replace it, or drop the sample before this node"
            ) from exc

    def pixels(self, images: Sequence[Any]) -> Tensor:
        """Checked, preprocessed images: float32[B, 3, H, W]."""
        if isinstance(images, str | bytes) or not isinstance(images, Sequence):
            raise ValueError(
                f"node {self.name!r}: images must be a list of PIL images, got {type(images).__name__}"
            )
        if len(images) == 0:
            raise ValueError(
                f"node {self.name!r}: images is an empty list; give at least one image"
            )
        rgb = [self._to_rgb(img, i) for i, img in enumerate(images)]
        return torch.stack([self.preprocess(img) for img in rgb])  # (B, 3, H, W)

    def encode(self, images: Sequence[Any]) -> Tensor:
        """float32[B, D] embeddings on the node's device (with grad when trainable)."""
        pixels = self.pixels(images).to(self.device)  # (B, 3, H, W)
        with torch.set_grad_enabled(self.trainable and torch.is_grad_enabled()):
            embeds = self.tower(pixels).float()  # (B, D)
            if self.normalize:
                embeds = torch.nn.functional.normalize(embeds, dim=-1)  # (B, D)
        return embeds

    def memory(self, load: Any) -> dict[str, int]:
        """The tower (float32) and the step's images in flight."""
        from nodes.memory import image_memory, vision_params

        params = vision_params(self.model_name, json.dumps(self.overrides, sort_keys=True))
        return {"weights@": params * 4, **image_memory(load, self.image_size)}

    def forward(self, images: Sequence[Any]) -> dict[str, Tensor]:
        return {"image_embeds": self.encode(images)}

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"tower": {k: v.detach().cpu() for k, v in self.tower.state_dict().items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state) != {"tower"}:
            raise ValueError(
                f"node {self.name!r}: expected a state with key 'tower', got keys {sorted(state)}"
            )
        self.tower.load_state_dict(state["tower"])


def tiny_vision_encoder(
    trainable: bool = False, name: str | None = None, **kwargs: Any
) -> VisionEncoder:
    """A test-sized encoder (D = 32, 32x32 images; ~0.1M parameters, random weights)."""
    return VisionEncoder(
        "ViT-S-32",
        pretrained=None,
        model_cfg=TINY_OPEN_CLIP_CFG,
        trainable=trainable,
        name=name,
        **kwargs,
    )
