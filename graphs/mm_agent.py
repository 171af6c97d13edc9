"""GRPO for a multimodal agent: the environment shows images, and a tool shows more.

data rows with images -> agent rollout (n trajectories per row: the policy looks, the
environment answers with images) -> group advantages -> (reference logprobs) -> GRPO update
-> weight sync to the rollout. Every image of a trajectory enters the policy's context where it
was shown (the processor's placeholder tokens), and the update reads them all.

    yatt-graph run mm_agent --steps 300 --out runs/mm_agent
    yatt-graph run mm_agent --env my_env.py:MyEnv --policy /models/qwen2-vl

By default it runs the look task with images (:class:`nodes.agents.lookup.LookImageEnv`): the
prompt's picture is dark, and only the ``look`` tool shows the shape's colour. The policy is
an image-text-to-text model: ``tiny-qwen2-vl`` (built in code, a word tokenizer over the
task's words) or a local VLM directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from graphs.advice import memory_plan, run_notes
from graphs.common import policy_spec
from graphs.config import users_model
from graphs.text_agent import AgentConfig, build_agent
from nodes.data import task_vocabulary
from yatt_graph import Graph

__all__ = [
    "CONFIG",
    "MultimodalAgentConfig",
    "build_graph",
    "graph_from_config",
    "memory_plan",
    "run_notes",
]


class MultimodalAgentConfig(AgentConfig, kw_only=True, forbid_unknown_fields=True):
    """The agent graph with images: the fields of AgentConfig, with a VLM policy."""

    policy: str | dict[str, Any] = "tiny-qwen2-vl"
    """An image-text-to-text model: tiny-qwen2-vl (built in code) or a local VLM directory."""
    env: str = "nodes.agents.lookup:LookImageEnv"
    """The environment class, as path/to/file.py:Class or module:Class (nodes.agents)."""
    group_size: int = 8
    """Trajectories per prompt (>= 2); eight, where the other GRPO graphs take four.

    With four the tiny VLM learned the look task several times slower (the README's figures)."""


CONFIG = MultimodalAgentConfig


def build_graph(**options: Any) -> Graph:
    """Options: the fields of :class:`MultimodalAgentConfig`."""
    return graph_from_config(CONFIG.from_options("mm_agent", options))


def graph_from_config(config: Any) -> Graph:
    """The graph of a typed config (what ``build_graph`` makes from its options)."""
    return build_agent("mm_agent", config, _vlm_spec(config), images=True)


def _vlm_spec(config: MultimodalAgentConfig) -> dict[str, Any]:
    policy = config.policy
    if policy == "tiny-qwen2-vl":  # the tiny text LM's spec and options, with a vision tower
        text = policy_spec(msgspec.structs.replace(config, policy="tiny-qwen2"), None)
        return {**text, "name": "tiny-qwen2-vl", "words": task_vocabulary()}
    if isinstance(policy, dict):
        return policy
    from nodes.models.families import model_family

    if not users_model(policy) or model_family(Path(policy)) != "vlm":
        raise ValueError(
            f"policy {policy!r} is not an image-text-to-text model; mm_agent takes "
            "tiny-qwen2-vl or a local VLM directory (Qwen2-VL and the like); a text LM goes "
            "in text_agent"
        )
    return policy_spec(config, 0)
