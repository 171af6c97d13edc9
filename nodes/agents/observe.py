"""An observation turn as token ids, the way the policy's family reads it.

Only observations are tokenized in a multi-turn trajectory (the policy's own tokens are kept as
sampled). With a chat template the observation is the template's own rendering of a ``tool``
message after the policy's turn, up to the next assistant turn (the text the template adds
between two renderings of the same conversation); without one, its text between newlines.
An HF VLM's observation images go in as the template's image parts and its processor expands
each into its placeholder tokens, as it does for a prompt's image.
"""

from __future__ import annotations

from typing import Any

from nodes.agents.env import Observation
from nodes.models.hf_vlm import HFVisionLanguagePolicy
from nodes.models.policy import Policy

__all__ = ["observation_ids", "reads_images"]


def reads_images(policy: Policy) -> bool:
    """Whether an observation's images can enter the policy's context (an HF VLM's)."""
    return isinstance(policy, HFVisionLanguagePolicy)


def observation_ids(policy: Policy, observation: Observation | str) -> list[int]:
    """The token ids of an observation turn (see the module docstring)."""
    obs = Observation(observation) if isinstance(observation, str) else observation
    if reads_images(policy):
        return _vlm_ids(policy, obs)
    if obs.images:
        raise ValueError(
            f"a {type(policy).__name__} policy reads no images; an environment that shows "
            "images needs an image-text-to-text policy (--policy DIR of a VLM, or tiny-qwen2-vl)"
        )
    tokenizer = policy.tokenizer
    text = None
    if getattr(policy, "_templated", False) and getattr(tokenizer, "chat_template", None):
        text = _tool_turn(tokenizer.apply_chat_template, obs.text)
    text = f"\n{obs.text}\n" if text is None else text
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _vlm_ids(policy: HFVisionLanguagePolicy, obs: Observation) -> list[int]:
    processor = policy.processor
    text = None
    if policy.use_chat_template and getattr(processor, "chat_template", None):
        parts = [{"type": "image"}] * len(obs.images) + [{"type": "text", "text": obs.text}]
        text = _tool_turn(processor.apply_chat_template, parts, parts_content=True)
    if text is None:
        text = (policy.image_token or "") * len(obs.images) + f"\n{obs.text}\n"
    images = list(obs.images) or None
    enc = processor(text=[text], images=images, return_tensors="pt")
    return enc["input_ids"][0].tolist()


def _tool_turn(render: Any, content: Any, parts_content: bool = False) -> str | None:
    """The text a chat template adds for a ``tool`` message (``content``) after an assistant
    turn, and the next assistant turn's header; None where the template renders the shorter
    conversation as other than a prefix of the longer one."""

    def say(text: str) -> Any:
        return [{"type": "text", "text": text}] if parts_content else text

    head = [{"role": "user", "content": say("x")}, {"role": "assistant", "content": say("y")}]
    base = render(head, tokenize=False)
    full = render([*head, {"role": "tool", "content": content}], tokenize=False,
                  add_generation_prompt=True)  # fmt: skip
    return full[len(base) :] if full.startswith(base) else None
