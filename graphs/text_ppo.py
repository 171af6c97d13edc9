"""Text-only PPO: the shapes task with the answer described in the prompt, no images.

prompts -> policy rollout -> reward -> reference logprobs + critic values -> GAE
-> PPO update -> weight sync back to the rollout and the critic (next step).

    yatt-graph run graphs/text_ppo.py --steps 200 --out runs/text_ppo
"""

from __future__ import annotations

from graphs.common import policy_spec, reward_node
from nodes.advantage_nodes import GAEAdvantage
from nodes.data import ShapesSource
from nodes.reference import Critic, ReferenceLogprobs
from nodes.rollout import Rollout
from nodes.sync import WeightSync
from nodes.update import PPOUpdate
from yatt_graph import Graph

__all__ = ["build_graph"]


def build_graph(
    batch_size: int = 32,
    task: str = "color",
    seed: int = 0,
    policy: str = "tiny",
    reward: str = "nodes.data:answer_reward",
    on_bad_sample: str = "error",
    lr: float = 1e-3,
    critic_lr: float = 1e-3,
    max_new_tokens: int = 2,
    temperature: float = 1.0,
    kl_coef: float = 0.0,
    entropy_coef: float = 0.01,
    epochs: int = 2,
) -> Graph:
    with Graph("text_ppo") as g:
        data = ShapesSource(
            batch_size=batch_size, task=task, seed=seed, text_hint=True, name="data"
        )()
        g.discard(data.images)
        spec = policy_spec(policy, seed, None)
        critic_spec = {**spec, "seed": seed + 1} if "seed" in spec else spec
        rollout = Rollout(
            policy=spec,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            name="rollout",
        )
        sample = rollout(prompts=data.prompts)
        scores = reward_node(reward, on_bad_sample)(texts=sample.texts, meta=data.meta)
        if on_bad_sample == "skip":  # the reward has a second output: which samples it skipped
            scores, skipped = scores
            g.output("bad_samples", skipped)
        tensors = {
            "prompt_ids": sample.prompt_ids,
            "prompt_mask": sample.prompt_mask,
            "response_ids": sample.response_ids,
            "response_mask": sample.response_mask,
        }
        ref = ReferenceLogprobs(policy=spec, temperature=temperature, name="reference")(**tensors)
        critic = Critic(critic=critic_spec, head_seed=seed, name="critic")
        values = critic(**tensors)
        adv = GAEAdvantage(kl_coef=kl_coef, name="gae")(
            scores=scores,
            values=values,
            response_mask=sample.response_mask,
            logprobs=sample.logprobs,
            ref_logprobs=ref,
        )
        update = PPOUpdate(
            policy=spec,
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
            **tensors,
            logprobs=sample.logprobs,
            advantages=adv.advantages,
            returns=adv.returns,
            values=values,
            ref_logprobs=ref,
        )
        g.connect(WeightSync(name="sync")(update.weights), rollout, "weights", delay=1)
        g.connect(update.critic_weights, critic, "weights", delay=1)
        g.output("scores", scores)
        g.output("metrics", update.metrics)
        g.output("advantage", adv.stats)
        g.discard(sample.group_ids, sample.response_lengths)
    return g
