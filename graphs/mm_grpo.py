"""Multimodal GRPO on the shapes task: n samples per prompt, group-normalized advantages, no critic.

images -> vision encoder -> policy rollout (n per prompt) -> reward -> reference logprobs
-> group advantages -> GRPO update -> weight sync back to the rollout (next step).

    yatt-graph run graphs/mm_grpo.py --steps 200 --out runs/mm_grpo
"""

from __future__ import annotations

from typing import Any

from graphs.advice import memory_plan, run_notes
from graphs.common import group_advantage, shard_beside, train_group, update_options
from graphs.config import GRPOConfig, TextGRPOConfig
from graphs.front import connect_weights, sample_and_score, sample_columns, update_inputs
from nodes.shared_models import set_share
from nodes.update import GRPOUpdate
from yatt_graph import Graph

__all__ = ["CONFIG", "build_graph", "graph_from_config", "build_grpo", "memory_plan", "run_notes"]


CONFIG = GRPOConfig


def build_graph(**options: Any) -> Graph:
    """Options: the fields of :class:`graphs.config.GRPOConfig`: ``batch_size`` prompts per
    step, ``group_size`` samples each; ``estimator``: grpo or rloo (the README gives the
    rewards its defaults reach)."""
    return graph_from_config(CONFIG.from_options("mm_grpo", options))


def graph_from_config(config: Any) -> Graph:
    """The graph of a typed config (what ``build_graph`` makes from its options)."""
    return build_grpo("mm_grpo", config, vision=config.vision)


def build_grpo(name: str, config: TextGRPOConfig, *, vision: str | None) -> Graph:
    """The GRPO graph; ``vision``: the vision tower, or None for a text-only graph."""
    with Graph(name) as g:
        # the reference only for the KL term: with kl_coef=0 nothing reads it
        s = sample_and_score(
            g, config, vision=vision, n=config.group_size, reference=config.kl_coef > 0
        )
        set_share(s.rollout, "policy")  # one policy module on an on-policy executor
        if s.ref_logprobs is not None:
            set_share(g.nodes["reference"], "policy")  # its frozen base, for a LoRA policy
            shard_beside(g.nodes["reference"], config, "grpo")
        ref = {"ref_logprobs": s.ref_logprobs} if s.ref_logprobs is not None else {}
        adv = group_advantage(config, s.scores, s.sample.group_ids, s.sample.response_mask)
        update = GRPOUpdate(
            policy=s.spec,
            kl_coef=config.kl_coef,
            aggregation=config.aggregation,
            horizon=config.max_new_tokens,  # seq-mean-token-sum-norm's constant
            kl_estimator=config.kl_estimator,
            device=s.device,
            **update_options(config),
            name="grpo",
            **train_group(config, "policy"),
        )(**update_inputs(config, s, adv.advantages, **ref))
        connect_weights(g, s, update.weights)
        g.output("scores", s.drawn_scores)
        g.output("metrics", update.metrics)
        g.output("advantage", adv.stats)
        sample_columns(g, config, s, adv.advantages)
    return g
