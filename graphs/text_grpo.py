"""Text-only GRPO: n samples per prompt, group-normalized advantages, no critic, no images.

prompts -> policy rollout (n per prompt) -> reward -> reference logprobs -> group advantages
-> GRPO update -> weight sync back to the rollout (next step).

    yatt-graph run graphs/text_grpo.py --steps 200 --out runs/text_grpo
    yatt-graph run graphs/text_grpo.py --policy /models/my-lm --data prompts.jsonl \\
        --reward my_rewards.py:score --out runs/mine

Without ``--data`` it trains on the shapes task with the answer described in the prompt.
"""

from __future__ import annotations

from typing import Any

from graphs.advice import memory_plan, run_notes
from graphs.config import TextGRPOConfig
from graphs.mm_grpo import build_grpo
from yatt_graph import Graph

__all__ = ["CONFIG", "build_graph", "graph_from_config", "memory_plan", "run_notes"]


CONFIG = TextGRPOConfig


def build_graph(**options: Any) -> Graph:
    """Options: the fields of :class:`graphs.config.TextGRPOConfig`; defaults as in mm_grpo."""
    return graph_from_config(CONFIG.from_options("text_grpo", options))


def graph_from_config(config: Any) -> Graph:
    """The graph of a typed config (what ``build_graph`` makes from its options)."""
    return build_grpo("text_grpo", config, vision=None)
