"""Multimodal GRPO on the shapes task: n samples per prompt, group-normalized advantages, no critic.

images -> vision encoder -> policy rollout (n per prompt) -> reward -> reference logprobs
-> group advantages -> GRPO update -> weight sync back to the rollout (next step).

    yatt-graph run graphs/mm_grpo.py --steps 200 --out runs/mm_grpo
"""

from __future__ import annotations

from graphs.common import is_prefix_policy, policy_spec, reward_node, vision_encoder
from nodes.advantage_nodes import GroupAdvantage
from nodes.data import ShapesSource
from nodes.reference import ReferenceLogprobs
from nodes.rollout import Rollout
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
    kl_coef: float = 0.0,
    entropy_coef: float = 0.01,
    epochs: int = 2,
    estimator: str = "grpo",
) -> Graph:
    """``batch_size`` prompts per step, ``group_size`` samples each; ``estimator``: grpo or rloo."""
    with Graph("mm_grpo") as g:
        data = ShapesSource(batch_size=batch_size, task=task, seed=seed, name="data")()
        encoder = vision_encoder(vision, seed)
        spec = policy_spec(policy, seed, encoder.embed_dim)
        image_port = (
            {"image_embeds": encoder(data.images)}
            if is_prefix_policy(spec)
            else {"images": data.images}
        )
        rollout = Rollout(
            policy=spec,
            n=group_size,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            name="rollout",
        )
        sample = rollout(prompts=data.prompts, **image_port)
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
        ref = ReferenceLogprobs(policy=spec, temperature=temperature, name="reference")(
            **tensors, **image_port
        )
        adv = GroupAdvantage(estimator, name="group_advantage")(
            scores=scores, group_ids=sample.group_ids, response_mask=sample.response_mask
        )
        update = GRPOUpdate(
            policy=spec,
            lr=lr,
            kl_coef=kl_coef,
            entropy_coef=entropy_coef,
            epochs=epochs,
            temperature=temperature,
            seed=seed,
            name="grpo",
        )(
            **tensors,
            logprobs=sample.logprobs,
            advantages=adv.advantages,
            ref_logprobs=ref,
            **image_port,
        )
        g.connect(WeightSync(name="sync")(update.weights), rollout, "weights", delay=1)
        g.output("scores", scores)
        g.output("metrics", update.metrics)
        g.output("advantage", adv.stats)
        g.output("response_lengths", sample.response_lengths)
    return g
