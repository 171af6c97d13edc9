"""GRPO for a multi-turn, tool-using agent: the policy acts, the environment answers.

data rows -> agent rollout (n trajectories per row, turns against the environment, scored by
it) -> group advantages -> (reference logprobs) -> GRPO update -> weight sync to the rollout.

    yatt-graph run text_agent --steps 300 --out runs/agent
    yatt-graph run text_agent --set env=my_env.py:MyEnv --data rows.jsonl --policy /models/lm

By default it runs the look task (:mod:`nodes.agents.lookup`): the prompt asks for a shape's
colour, and only the ``look`` tool tells it. The update and the reference read each
trajectory's observations as context (``context_mask``) and train on the policy's own tokens
(``response_mask``).
"""

from __future__ import annotations

from typing import Any

from graphs.advice import memory_plan, run_notes
from graphs.common import (
    data_source,
    group_advantage,
    policy_spec,
    resolve_device,
    rollout_options,
    shard_beside,
    train_group,
    update_options,
)
from graphs.config import VAL_OPTIONS, TextGRPOConfig, at_least, refuse
from graphs.front import TOKENS, teacher_logprobs
from nodes.agents import AgentRollout, AgentStats, load_env
from nodes.data import ShapesSource
from nodes.reference import ReferenceLogprobs
from nodes.sample_stats import SampleStats
from nodes.shared_models import set_share
from nodes.update import GRPOUpdate
from yatt_graph import Graph

__all__ = [
    "AgentConfig",
    "CONFIG",
    "build_agent",
    "build_graph",
    "graph_from_config",
    "memory_plan",
    "run_notes",
]


class AgentConfig(TextGRPOConfig, kw_only=True, forbid_unknown_fields=True):
    """GRPO with an environment: the fields of TextGRPOConfig, less the reward (the
    environment scores each trajectory), plus the environment and its turns."""

    policy: str | dict[str, Any] = "tiny-qwen2"
    """A text causal LM: tiny-qwen2 (built in code), a local model directory, or a spec."""
    env: str = "nodes.agents.lookup:LookEnv"
    """The environment class, as path/to/file.py:Class or module:Class (nodes.agents)."""
    max_turns: int | None = None
    """The most turns of the policy in a trajectory (>= 1); none: the environment's."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_turns is not None:
            at_least("max_turns", self.max_turns, 1)
        for name, set_ in self._unsupported().items():
            if set_:
                refuse(
                    name,
                    getattr(self, name),
                    "left at its default: the agent graph's environment scores each "
                    "trajectory (write the reward in its step()), whole, with no validation",
                )

    def _unsupported(self) -> dict[str, bool]:
        """The options of GRPO's graph this one does not take, each with whether it is set."""
        return {
            "reward": self.reward != "nodes.data:answer_reward",
            "dynamic_sampling": self.dynamic_sampling > 0,
            "val_data": self.val_data is not None,
        }

    def idle_options(self) -> dict[str, str]:
        idle = super().idle_options()
        for name in (*self._unsupported(), *VAL_OPTIONS):
            idle[name] = "a graph without an environment (text_grpo)"
        if self.data is None:  # the environment scores; only a row of --data can be bad
            idle["on_bad_sample"] = "data (it skips bad rows of --data)"
        return idle


CONFIG = AgentConfig


def build_graph(**options: Any) -> Graph:
    """Options: the fields of :class:`AgentConfig`."""
    return graph_from_config(CONFIG.from_options("text_agent", options))


def graph_from_config(config: Any) -> Graph:
    """The graph of a typed config (what ``build_graph`` makes from its options)."""
    return build_agent("text_agent", config, policy_spec(config, None), images=False)


def build_agent(name: str, config: AgentConfig, spec: dict[str, Any], *, images: bool) -> Graph:
    """The agent graph for a policy ``spec``; ``images``: the data's images go to the
    environment (its rows' ``image``) and the trajectories' images to the update."""
    device = resolve_device(config.device)
    words = getattr(load_env(config.env, name), "words", ())
    if "words" in spec:  # a tiny policy's vocabulary: the environment's words too
        spec["words"] = list(dict.fromkeys([*spec["words"], *words]))
    with Graph(name) as g:
        if config.data is None:  # the shapes task, its answer left out of the prompt
            source = ShapesSource(
                batch_size=config.batch_size, task=config.task, seed=config.seed,
                emit_rows=True, name="data",
            )  # fmt: skip
        else:
            source = data_source(config, text_only=not images)
        data = source()
        g.output("data_rows", data.rows)  # each prompt's file and row, for the samples file
        if images:
            g.output("images", data.images)  # thumbnails in the samples file
        else:
            g.discard(data.images)
        if config.data is not None:
            g.output("data", data.stats)
        rollout = AgentRollout(
            policy=spec, env=config.env, n=config.group_size, max_turns=config.max_turns,
            device=device, name="rollout", **rollout_options(config),
        )  # fmt: skip
        set_share(rollout, "policy")
        shown = {"images": data.images} if images else {}
        sample = rollout(prompts=data.prompts, meta=data.meta, **shown)
        g.output("weight_sync", sample.weight_sync)  # seconds and bytes of the weights it loaded
        seen = {"images": sample.images} if images else {}  # every image of each trajectory
        if not images:
            g.discard(sample.images)
        sampled = {}  # the sampler's logprobs beside the recomputed ones: the gap, and TIS
        if config.recompute_logprobs:
            sampled["rollout_logprobs"] = sample.rollout_logprobs
        else:
            g.discard(sample.rollout_logprobs)
        tensors = {name: getattr(sample, name) for name in (*TOKENS, "context_mask")}
        adv = group_advantage(config, sample.scores, sample.group_ids, sample.response_mask)
        ref = {}
        if config.kl_coef > 0:
            reference = ReferenceLogprobs(
                policy=spec, temperature=config.temperature, device=device, name="reference",
                micro_batch_tokens=config.micro_batch_tokens, precision=config.mixed_precision,
            )  # fmt: skip
            set_share(reference, "policy")
            shard_beside(reference, config, "grpo")
            ref["ref_logprobs"] = reference(**tensors, **seen)
        taught = {}
        if config.teacher is not None:
            image_dim = 0 if images else None  # (an image-text-to-text teacher reads them itself)
            inputs = {**tensors, **seen}
            taught["teacher_logprobs"] = teacher_logprobs(config, spec, image_dim, device, inputs)
        update = GRPOUpdate(
            policy=spec, kl_coef=config.kl_coef, aggregation=config.aggregation,
            horizon=config.max_new_tokens * rollout.max_turns, kl_estimator=config.kl_estimator,
            device=device, **update_options(config), name="grpo", **train_group(config, "policy"),
        )(
            **tensors, logprobs=sample.logprobs, truncated=sample.truncated,
            advantages=adv.advantages, **ref, **taught, **sampled, **seen,
        )  # fmt: skip
        g.connect(update.weights, rollout, "weights", delay=1)
        g.output("texts", sample.texts)
        g.output("prompts", data.prompts)
        g.output("scores", sample.scores)
        g.output("response_lengths", sample.response_lengths)
        g.output("agent", AgentStats(name="agent_stats")(trajectories=sample.trajectories))
        g.output("trajectories", sample.trajectories)  # each one's turns and tools, kept
        g.output("truncated", sample.truncated)
        stats = SampleStats(name="sample_stats")(
            response_mask=sample.response_mask, group_ids=sample.group_ids,
            advantages=adv.advantages, logprobs=sample.logprobs, **ref, **sampled,
        )  # fmt: skip
        g.output("sample_stats", stats)
        g.output("metrics", update.metrics)
        g.output("advantage", adv.stats)
    return g
