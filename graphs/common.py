"""Options shared by the ready graphs: which policy, vision tower and reward to use.

Defaults build tiny models from configs in code (nothing downloads), sized for the
synthetic shapes task; real models come from local paths:

* ``policy``: ``"tiny"`` (a 2-layer GPT-2 prefix-VLM with the task's word vocabulary), a
  local directory (a saved prefix-VLM, or any Hugging Face image-text-to-text checkpoint such
  as Qwen2-VL), or a :func:`nodes.policy.build_policy` spec dict.
* ``vision``: ``"tiny"`` or ``"open_clip:NAME[:WEIGHTS]"`` (weights: a local file). Only a
  prefix-VLM policy uses it; an HF VLM reads the images with its own tower.
* ``reward``: ``"module:function"``, a rule ``fn(text, meta) -> float``; default
  :func:`nodes.data.answer_reward`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nodes.data import task_vocabulary
from nodes.rewards import RuleReward
from nodes.vision import TINY_OPEN_CLIP_CFG, VisionEncoder

__all__ = ["is_prefix_policy", "policy_spec", "reward_node", "vision_encoder"]


def policy_spec(policy: str | dict[str, Any], seed: int, image_dim: int | None) -> dict[str, Any]:
    """A JSON-able spec that every node holding the policy builds identically."""
    if isinstance(policy, dict):
        return policy
    if policy == "tiny":
        spec: dict[str, Any] = {"name": "tiny-prefix-vlm", "seed": seed, "words": task_vocabulary()}
        if image_dim is not None:
            spec["image_dim"] = image_dim
        return spec
    path = Path(policy)
    if not path.is_dir():
        raise ValueError(
            f"policy {policy!r} is neither 'tiny' nor a local model directory; models load only "
            "from local paths (nothing is downloaded)"
        )
    return {"path": str(path)}


def is_prefix_policy(spec: dict[str, Any]) -> bool:
    """Whether the policy reads image embeddings from a separate vision encoder."""
    if spec.get("name") == "tiny-prefix-vlm":
        return True
    return "path" in spec and (Path(spec["path"]) / "prefix_vlm.json").is_file()


def vision_encoder(vision: str, seed: int) -> VisionEncoder:
    if vision == "tiny":
        return VisionEncoder("ViT-S-32", model_cfg=TINY_OPEN_CLIP_CFG, seed=seed, name="vision")
    kind, _, rest = vision.partition(":")
    if kind != "open_clip" or not rest:
        raise ValueError(f"vision {vision!r}: use 'tiny' or 'open_clip:NAME[:WEIGHTS_FILE]'")
    name, _, weights = rest.partition(":")
    return VisionEncoder(name, pretrained=weights or None, seed=seed, name="vision")


def reward_node(reward: str, on_bad_sample: str = "error") -> RuleReward:
    """The rule reward; ``on_bad_sample``: ``"error"`` (a NaN/inf score stops the run, naming the
    sample) or ``"skip"`` (the sample scores 0, and a ``bad_samples`` output counts it)."""
    if on_bad_sample not in ("error", "skip"):
        raise ValueError(f"on_bad_sample must be 'error' or 'skip', got {on_bad_sample!r}")
    if on_bad_sample == "skip":
        return RuleReward(reward, on_bad_sample="skip", emit_bad_mask=True, name="reward")
    return RuleReward(reward, on_bad_sample="raise", name="reward")
