"""Multi-turn agents: the environment protocol, tools, and the rollout that runs them."""

from nodes.agents.env import Environment, Observation, ToolCall, ToolEnv, parse_tool_call
from nodes.agents.observe import observation_ids
from nodes.agents.rollout import AgentRollout, AgentStats, load_env

__all__ = [
    "AgentRollout",
    "AgentStats",
    "Environment",
    "Observation",
    "ToolCall",
    "ToolEnv",
    "load_env",
    "observation_ids",
    "parse_tool_call",
]
