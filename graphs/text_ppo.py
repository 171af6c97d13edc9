"""Text-only PPO: the shapes task with the answer described in the prompt, no images.

prompts -> policy rollout -> reward -> reference logprobs + critic values -> GAE
-> PPO update -> weight sync back to the rollout and the critic (next step).

    yatt-graph run graphs/text_ppo.py --steps 200 --out runs/text_ppo
"""

from __future__ import annotations

from typing import Any

from graphs.advice import memory_plan, run_notes
from graphs.config import PPOConfig
from graphs.mm_ppo import build_ppo
from yatt_graph import Graph

__all__ = ["CONFIG", "build_graph", "graph_from_config", "memory_plan", "run_notes"]


CONFIG = PPOConfig


def build_graph(**options: Any) -> Graph:
    """Options: the fields of :class:`graphs.config.PPOConfig`; defaults as in mm_ppo (the
    README gives the rewards they reach)."""
    return graph_from_config(CONFIG.from_options("text_ppo", options))


def graph_from_config(config: Any) -> Graph:
    """The graph of a typed config (what ``build_graph`` makes from its options)."""
    return build_ppo("text_ppo", config, vision=None)
