"""What a multi-turn rollout talks to: an :class:`Environment` and its :class:`Observation`.

An environment is a plain class, one instance per trajectory (built with no arguments)::

    class MyEnv(Environment):
        max_turns = 3

        def reset(self, row):            # a data row: its prompt, answer and other columns
            self.answer = row["answer"]
            return Observation(row["prompt"])

        def step(self, action):          # the text the policy wrote this turn
            if action.startswith("look"):
                return Observation("it is red ."), 0.0, False   # the next observation
            return None, float(action.split()[:1] == [self.answer]), True

``step`` returns ``(observation, reward, done)``; the rewards of a trajectory's turns add up
to its score. A trajectory also ends after ``max_turns`` turns of the policy.

The rollout calls ``reset`` and ``step`` through :func:`call_with_limit`: one that raises, or
runs past the class's ``time_limit_s``, ends that trajectory with ``failure_reward`` and the
reason, and the run goes on (a :class:`~yatt_graph.UsageError` is the exception: it stops
the run with its message, for a data row the environment cannot take at all).

:class:`ToolEnv` is the common case of tools: plain Python functions by name, called when the
policy writes a tool call (:func:`parse_tool_call`); a tool's return value (text, or an image)
is the next observation, and an action that calls no tool is the final answer, scored by
:meth:`ToolEnv.score`. A tool that raises, runs past ``time_limit_s`` or returns something
that is neither text nor an image ends the trajectory with ``failure_reward`` and its reason
(in :attr:`ToolEnv.calls`), by the same :func:`call_with_limit`; the run goes on.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Environment",
    "Failure",
    "Observation",
    "ToolCall",
    "ToolEnv",
    "call_with_limit",
    "parse_tool_call",
]


@dataclass
class Observation:
    """What the environment shows the policy: text, and images (PIL) where it has any."""

    text: str
    images: list[Any] = field(default_factory=list)


class Environment:
    """The environment protocol (see the module docstring): subclass it, or write any class
    with ``reset``, ``step`` and ``max_turns``."""

    max_turns: int = 4
    """The most turns of the policy in one trajectory."""
    words: tuple[str, ...] = ()
    """Words the environment's actions use beyond the data's (a tool's name): a tiny policy
    built in code with a word-level tokenizer gets them in its vocabulary."""
    time_limit_s: float = 60.0
    """The longest one ``reset`` or ``step`` may run; a longer one ends its trajectory with
    ``failure_reward`` (its thread is left to finish alone)."""
    failure_reward: float = 0.0
    """The score of a trajectory that a failure ended (a ``reset`` or ``step`` that raised or
    ran past ``time_limit_s``)."""

    def reset(self, row: Mapping[str, Any]) -> Observation:
        """The first observation (the prompt) for a data row."""
        raise NotImplementedError

    def step(self, action: str) -> tuple[Observation | None, float, bool]:
        """The policy's turn ``action`` -> (the next observation or None, reward, done)."""
        raise NotImplementedError


@dataclass
class ToolCall:
    """One call of a tool in a trajectory, for the metrics and the trace."""

    name: str
    seconds: float
    error: str | None = None
    """Why the call failed (it raised, ran too long, or returned something unusable)."""


_PUNCTUATION = ".,;:!?()\"'`"
_TAGGED = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def parse_tool_call(action: str, tools: Mapping[str, Any]) -> tuple[str, list[Any], dict] | None:
    """The tool call an action makes, as ``(name, args, kwargs)``, or None (a final answer).

    Two forms are read: the chat templates' ``<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>`` (Qwen, Hermes), and a plain one for models without a template: an action
    whose first word is a tool's name calls it with the words after it, up to the end of the
    line, as string arguments (``zoom 2`` is ``zoom("2")``; punctuation around a word is
    dropped, so ``look?`` calls ``look()``).
    """
    tagged = _TAGGED.search(action)
    if tagged is not None:
        try:
            call = json.loads(tagged.group(1))
        except json.JSONDecodeError:
            return None
        name = call.get("name") if isinstance(call, dict) else None
        args = call.get("arguments", {}) if isinstance(call, dict) else {}
        if name in tools and isinstance(args, dict):
            return name, [], args
        return None
    line = action.strip().split("\n", 1)[0].split()
    name = line[0].strip(_PUNCTUATION) if line else ""
    if name in tools:
        return name, [w for w in (x.strip(_PUNCTUATION) for x in line[1:]) if w], {}
    return None


class ToolEnv(Environment):
    """An environment of tools (see the module docstring). Subclasses set :attr:`tools` and
    write :meth:`score`; :meth:`reset` shows the row's ``prompt``."""

    tools: Mapping[str, Callable[..., Any]] = {}  # noqa: RUF012
    """Tool name -> function."""
    time_limit_s: float = 10.0
    """The longest one tool call may run (and one ``reset`` or ``step``); a call running
    longer ends the trajectory (its thread is left to finish alone)."""

    def reset(self, row: Mapping[str, Any]) -> Observation:
        self.row = row
        self.calls: list[ToolCall] = []
        return Observation(str(row["prompt"]))

    def score(self, answer: str) -> float:
        """The reward of the final answer (an action that calls no tool)."""
        raise NotImplementedError

    def step(self, action: str) -> tuple[Observation | None, float, bool]:
        call = parse_tool_call(action, self.tools)
        if call is None:
            return None, float(self.score(action)), True
        name, args, kwargs = call
        result, failure, seconds = call_with_limit(
            self.tools[name], args, kwargs, self.time_limit_s, f"tool {name!r}"
        )
        error = None if failure is None else failure.reason
        observation = None if error else _as_observation(result)
        if error is None and observation is None:
            error = f"returned a {type(result).__name__}, neither text nor an image"
        self.calls.append(ToolCall(name, seconds, error))
        if error is not None:
            return None, float(self.failure_reward), True
        return observation, 0.0, False


@dataclass
class Failure:
    """Why a call of an environment's (or a tool's) code failed."""

    reason: str
    """``raised ValueError: ...`` or ``ran past its time limit of 10 s``."""
    error: BaseException | None = None
    """The exception it raised (None: it ran too long)."""


def call_with_limit(
    fn: Callable[..., Any], args: list[Any], kwargs: dict, limit: float, what: str = "call"
) -> tuple[Any, Failure | None, float]:
    """``fn(*args, **kwargs)`` in a thread of its own, waited for at most ``limit`` seconds:
    ``(result, failure or None, seconds)``. The one way environments' code is called, by the
    rollout (``reset``, ``step``) and by :class:`ToolEnv` (its tools). A call past the limit
    is left to finish alone (a daemon thread, ``what`` in its name)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # (SystemExit too) its failure ends a trajectory
            box["error"] = exc

    start = time.perf_counter()
    worker = threading.Thread(target=run, daemon=True, name=f"yatt-env {what}")
    worker.start()
    worker.join(limit)
    seconds = time.perf_counter() - start
    if worker.is_alive():
        return None, Failure(f"ran past its time limit of {limit:g} s"), seconds
    exc = box.get("error")
    if exc is not None:
        return None, Failure(f"raised {type(exc).__name__}: {exc}", exc), seconds
    return box.get("result"), None, seconds


def _as_observation(result: Any) -> Observation | None:
    if isinstance(result, Observation):
        return result
    if isinstance(result, str):
        return Observation(result)
    if hasattr(result, "convert") and hasattr(result, "size"):  # a PIL image
        return Observation("", [result])
    return None
