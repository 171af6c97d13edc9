"""The front half of the ready graphs, and how their policy, vision and reward options load.

Defaults build tiny models from configs in code (nothing downloads), sized for the
synthetic shapes task; real models come from local paths:

* ``policy``: ``"tiny"`` (a 2-layer GPT-2 prefix-VLM with the task's word vocabulary), a
  local directory (a saved prefix-VLM, or any Hugging Face image-text-to-text checkpoint such
  as Qwen2-VL), or a :func:`nodes.models.policy.build_policy` spec dict.
* ``vision``: ``"tiny"`` or ``"open_clip:NAME[:WEIGHTS]"`` (weights: a local file). Only a
  prefix-VLM policy uses it; an HF VLM reads the images with its own tower.
* ``reward``: ``"module:function"``, a rule ``fn(text, meta) -> float``; default
  :func:`nodes.data.answer_reward`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from graphs.config import RLConfig
from nodes.data import ShapesSource, task_vocabulary
from nodes.reference import ReferenceLogprobs
from nodes.rewards import RuleReward
from nodes.rollout import Rollout
from nodes.vision import TINY_OPEN_CLIP_CFG, VisionEncoder
from yatt_graph import Graph, Handle, Node

__all__ = [
    "Sampled",
    "is_prefix_policy",
    "policy_spec",
    "reward_node",
    "sample_and_score",
    "vision_encoder",
]


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


def reward_node(reward: str, on_bad_sample: str = "raise") -> RuleReward:
    """The rule reward; ``on_bad_sample``: ``"raise"`` (a NaN/inf score stops the run, naming the
    sample) or ``"skip"`` (the sample scores 0, and a ``bad_samples`` output counts it)."""
    if on_bad_sample == "skip":
        return RuleReward(reward, on_bad_sample="skip", emit_bad_mask=True, name="reward")
    return RuleReward(reward, on_bad_sample=on_bad_sample, name="reward")


class Sampled(NamedTuple):
    """The front half every ready graph shares: data, rollout, reward and reference."""

    spec: dict[str, Any]
    """The policy spec, for every node that holds a copy of the policy."""
    rollout: Node
    sample: Any
    """The rollout's outputs (``sample.texts``, ``sample.logprobs``, ...)."""
    scores: Handle
    tensors: dict[str, Handle]
    """prompt_ids, prompt_mask, response_ids, response_mask: what model nodes read."""
    image_port: dict[str, Handle]
    """``image_embeds`` (prefix-VLM), ``images`` (HF VLM) or nothing (text only)."""
    ref_logprobs: Handle


def sample_and_score(
    g: Graph, config: RLConfig, *, vision: str | None = None, n: int = 1
) -> Sampled:
    """Declare data -> (vision) -> rollout -> reward, and the reference logprobs, in ``g``.

    ``vision``: the vision tower (``config.vision`` of a graph with images), or None for a
    text-only graph; ``n``: samples per prompt.
    ``config.stream``: the rollout hands out responses as they end (``Rollout(stream=True)``);
    with one sample per prompt the reward, the reference and the critic then take them piece by
    piece (runtime/engine/streams.py), which overlaps generation when they run on another
    controller (``--placement partial``).
    """
    text_only = vision is None
    data = ShapesSource(
        batch_size=config.batch_size,
        task=config.task,
        seed=config.seed,
        text_hint=text_only,
        name="data",
    )()
    if text_only:
        g.discard(data.images)
        spec, image_port = policy_spec(config.policy, config.seed, None), {}
    else:
        encoder = vision_encoder(vision, config.seed)
        spec = policy_spec(config.policy, config.seed, encoder.embed_dim)
        prefix = is_prefix_policy(spec)
        image_port = {"image_embeds": encoder(data.images)} if prefix else {"images": data.images}
    rollout = Rollout(
        policy=spec,
        n=n,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        seed=config.seed,
        stream=config.stream,
        name="rollout",
    )
    sample = rollout(prompts=data.prompts, **image_port)
    scores = reward_node(config.reward, config.on_bad_sample)(texts=sample.texts, meta=data.meta)
    if config.on_bad_sample == "skip":  # the reward has a second output: which samples it skipped
        scores, skipped = scores
        g.output("bad_samples", skipped)
    tensors = {
        "prompt_ids": sample.prompt_ids,
        "prompt_mask": sample.prompt_mask,
        "response_ids": sample.response_ids,
        "response_mask": sample.response_mask,
    }
    reference = ReferenceLogprobs(policy=spec, temperature=config.temperature, name="reference")
    ref = reference(**tensors, **image_port)
    g.output("response_lengths", sample.response_lengths)
    return Sampled(spec, rollout, sample, scores, tensors, image_port, ref)
