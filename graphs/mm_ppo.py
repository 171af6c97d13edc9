"""Multimodal PPO on the shapes task (or your own models and reward).

images -> vision encoder -> policy rollout -> reward -> reference logprobs + critic values
-> GAE -> PPO update -> weight sync back to the rollout and the critic (next step).

    yatt-graph run graphs/mm_ppo.py --steps 300 --out runs/mm_ppo
    yatt-graph run graphs/mm_ppo.py --policy /models/my-vlm --reward my_rewards.py:score
"""

from __future__ import annotations

from typing import Any

from graphs.advice import memory_plan, run_notes
from graphs.common import shard_beside, train_group, update_options
from graphs.config import MultimodalPPOConfig, PPOConfig
from graphs.front import connect_weights, sample_and_score, sample_columns, update_inputs
from nodes.advantage import GAEAdvantage
from nodes.reference import Critic
from nodes.shared_models import set_share
from nodes.update import PPOUpdate
from yatt_graph import Graph

__all__ = ["CONFIG", "build_graph", "graph_from_config", "build_ppo", "memory_plan", "run_notes"]


CONFIG = MultimodalPPOConfig


def build_graph(**options: Any) -> Graph:
    """Options: the fields of :class:`graphs.config.MultimodalPPOConfig` (the README gives
    the rewards its defaults reach)."""
    return graph_from_config(CONFIG.from_options("mm_ppo", options))


def graph_from_config(config: Any) -> Graph:
    """The graph of a typed config (what ``build_graph`` makes from its options)."""
    return build_ppo("mm_ppo", config, vision=config.vision)


def build_ppo(name: str, config: PPOConfig, *, vision: str | None) -> Graph:
    """The PPO graph; ``vision``: the vision tower, or None for a text-only graph."""
    seed = config.seed
    with Graph(name) as g:
        s = sample_and_score(g, config, vision=vision)
        # one policy and one value model where the executor allows it (nodes/shared_models.py)
        set_share(s.rollout, "policy")
        set_share(g.nodes["reference"], "policy")  # its frozen base, for a LoRA policy
        shard_beside(g.nodes["reference"], config, "ppo")
        critic_spec = {**s.spec, "seed": seed + 1} if "seed" in s.spec else s.spec
        critic = Critic(
            critic=critic_spec, head_seed=seed, share="critic", device=s.device, name="critic",
            micro_batch_tokens=config.micro_batch_tokens, precision=config.mixed_precision,
        )  # fmt: skip
        if config.shard_critic and config.train_ranks > 1:  # on the update's ranks, its model
            critic.configure(ranks=config.train_ranks, rank_with="ppo")
        values = critic(**s.tensors, **s.image_port)
        adv = GAEAdvantage(gamma=config.gamma, lam=config.lam, kl_coef=config.kl_coef, name="gae")(
            scores=s.scores,
            values=values,
            response_mask=s.sample.response_mask,
            logprobs=s.sample.logprobs,
            ref_logprobs=s.ref_logprobs,
        )
        more = {"returns": adv.returns, "values": values, "ref_logprobs": s.ref_logprobs}
        update = PPOUpdate(
            policy=s.spec,
            critic=critic_spec,
            head_seed=seed,
            critic_lr=config.critic_lr,
            device=s.device,
            **update_options(config),
            name="ppo",
            **train_group(config, "policy", critic_share="critic"),
        )(**update_inputs(config, s, adv.advantages, **more))
        connect_weights(g, s, update.weights)
        g.connect(update.critic_weights, critic, "weights", delay=1)
        g.output("scores", s.drawn_scores)
        g.output("metrics", update.metrics)
        g.output("advantage", adv.stats)
        sample_columns(g, config, s, adv.advantages)
    return g
