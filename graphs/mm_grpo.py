"""Multimodal GRPO on the shapes task: n samples per prompt, group-normalized advantages, no critic.

images -> vision encoder -> policy rollout (n per prompt) -> reward -> reference logprobs
-> group advantages -> GRPO update -> weight sync back to the rollout (next step).

    yatt-graph run graphs/mm_grpo.py --steps 200 --out runs/mm_grpo
"""

from __future__ import annotations

from graphs.common import sample_and_score
from nodes.advantage import GroupAdvantage
from nodes.sync import WeightSync
from nodes.update import GRPOUpdate
from yatt_graph import Graph

__all__ = ["build_graph"]


def build_graph(
    batch_size: int = 16,
    group_size: int = 4,
    task: str = "color",
    seed: int = 0,
    policy: str = "tiny",
    vision: str = "tiny",
    reward: str = "nodes.data:answer_reward",
    on_bad_sample: str = "error",
    lr: float = 1e-3,
    max_new_tokens: int = 2,
    temperature: float = 1.0,
    kl_coef: float = 0.05,
    entropy_coef: float = 0.01,
    epochs: int = 2,
    estimator: str = "grpo",
    stream: bool = False,
) -> Graph:
    """``batch_size`` prompts per step, ``group_size`` samples each; ``estimator``: grpo or rloo.

    Measured on the CPU (500 steps, means of the first and last 20): reward 0.21-0.23 ->
    0.88-0.95 over seeds 0-4 with ``kl_coef=0.05``, against 0.75-0.97 without the penalty."""
    with Graph("mm_grpo") as g:
        s = sample_and_score(
            g,
            batch_size=batch_size,
            task=task,
            seed=seed,
            policy=policy,
            vision=vision,
            reward=reward,
            on_bad_sample=on_bad_sample,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            n=group_size,
            stream=stream,
        )
        adv = GroupAdvantage(estimator, name="group_advantage")(
            scores=s.scores, group_ids=s.sample.group_ids, response_mask=s.sample.response_mask
        )
        update = GRPOUpdate(
            policy=s.spec,
            lr=lr,
            kl_coef=kl_coef,
            entropy_coef=entropy_coef,
            epochs=epochs,
            temperature=temperature,
            seed=seed,
            name="grpo",
        )(
            **s.tensors,
            logprobs=s.sample.logprobs,
            advantages=adv.advantages,
            ref_logprobs=s.ref_logprobs,
            **s.image_port,
        )
        g.connect(WeightSync(name="sync")(update.weights), s.rollout, "weights", delay=1)
        g.output("scores", s.scores)
        g.output("metrics", update.metrics)
        g.output("advantage", adv.stats)
    return g
