"""Text-only PPO: the shapes task with the answer described in the prompt, no images.

prompts -> policy rollout -> reward -> reference logprobs + critic values -> GAE
-> PPO update -> weight sync back to the rollout and the critic (next step).

    yatt-graph run graphs/text_ppo.py --steps 200 --out runs/text_ppo
"""

from __future__ import annotations

from graphs.mm_ppo import build_ppo
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
    kl_coef: float = 0.05,
    entropy_coef: float = 0.01,
    epochs: int = 2,
    gamma: float = 1.0,
    lam: float = 0.95,
    stream: bool = False,
) -> Graph:
    """Defaults as in mm_ppo; reward 0.15-0.18 -> 0.996-0.999 over seeds 0-2 (CPU, 500 steps,
    means of the first and last 20; without the KL penalty 0.59-0.998)."""
    options = dict(locals())
    return build_ppo("text_ppo", text_only=True, **options)
