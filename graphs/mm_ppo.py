"""Multimodal PPO on the shapes task (or your own models and reward).

images -> vision encoder -> policy rollout -> reward -> reference logprobs + critic values
-> GAE -> PPO update -> weight sync back to the rollout and the critic (next step).

    yatt-graph run graphs/mm_ppo.py --steps 300 --out runs/mm_ppo
    yatt-graph run graphs/mm_ppo.py --policy /models/my-vlm --reward my_rewards.py:score
"""

from __future__ import annotations

from typing import Any

from graphs.common import sample_and_score
from nodes.advantage import GAEAdvantage
from nodes.reference import Critic
from nodes.sync import WeightSync
from nodes.update import PPOUpdate
from yatt_graph import Graph

__all__ = ["build_graph", "build_ppo"]


def build_graph(
    batch_size: int = 32,
    task: str = "color",
    seed: int = 0,
    policy: str = "tiny",
    vision: str = "tiny",
    reward: str = "nodes.data:answer_reward",
    on_bad_sample: str = "error",
    lr: float = 1e-3,
    critic_lr: float = 1e-3,
    max_new_tokens: int = 2,
    temperature: float = 1.0,
    kl_coef: float = 0.05,
    entropy_coef: float = 0.01,
    epochs: int = 2,
    gamma: float = 1.0,
    lam: float = 0.95,
    stream: bool = False,
) -> Graph:
    """Defaults tuned on measured runs (CPU, 500 steps, means of the first and last 20):
    reward 0.16 -> 0.95-0.97 over seeds 0-4. ``kl_coef=0.05`` keeps the per-token KL to the
    reference at 1.5-1.7 nats; without the penalty it grew to 2.4-3.0 and seeds 1-3 ended
    at 0.54-0.78."""
    options = dict(locals())
    return build_ppo("mm_ppo", text_only=False, **options)


def build_ppo(
    name: str,
    *,
    text_only: bool,
    lr: float,
    critic_lr: float,
    kl_coef: float,
    entropy_coef: float,
    epochs: int,
    gamma: float,
    lam: float,
    **front: Any,
) -> Graph:
    """The PPO graph; ``front`` goes to :func:`graphs.common.sample_and_score`."""
    seed, temperature = front["seed"], front["temperature"]
    with Graph(name) as g:
        s = sample_and_score(g, text_only=text_only, **front)
        critic_spec = {**s.spec, "seed": seed + 1} if "seed" in s.spec else s.spec
        critic = Critic(critic=critic_spec, head_seed=seed, name="critic")
        values = critic(**s.tensors, **s.image_port)
        adv = GAEAdvantage(gamma=gamma, lam=lam, kl_coef=kl_coef, name="gae")(
            scores=s.scores,
            values=values,
            response_mask=s.sample.response_mask,
            logprobs=s.sample.logprobs,
            ref_logprobs=s.ref_logprobs,
        )
        update = PPOUpdate(
            policy=s.spec,
            critic=critic_spec,
            head_seed=seed,
            lr=lr,
            critic_lr=critic_lr,
            entropy_coef=entropy_coef,
            epochs=epochs,
            temperature=temperature,
            seed=seed,
            name="ppo",
        )(
            **s.tensors,
            logprobs=s.sample.logprobs,
            advantages=adv.advantages,
            returns=adv.returns,
            values=values,
            ref_logprobs=s.ref_logprobs,
            **s.image_port,
        )
        g.connect(WeightSync(name="sync")(update.weights), s.rollout, "weights", delay=1)
        g.connect(update.critic_weights, critic, "weights", delay=1)
        g.output("scores", s.scores)
        g.output("metrics", update.metrics)
        g.output("advantage", adv.stats)
        g.discard(s.sample.group_ids)
    return g
