"""The multi-turn rollout: the policy acts, the environment answers, turn after turn.

Token in, token out: the tokens the policy sampled are kept exactly as sampled, and only the
observations are tokenized (:func:`observation_ids`), so what an update trains on is what the
policy saw and wrote. A trajectory is one row: its first observation is the prompt
(``prompt_ids``), and ``response_ids`` holds every turn of the policy with the observations
between them. ``response_mask`` is 1 on the policy's tokens only (the losses, the logprobs and
the advantages read it) and ``context_mask`` on the observations too (the forward passes of
the update, the reference and the critic read it), so a teacher-forced pass sees exactly the
context each turn was sampled in.

All live trajectories of a call generate their next turn together; finished ones leave the
batch. On the vLLM backend each turn goes to the engine as token ids (the context as it is,
never re-tokenized), and the engine sleeps after the call's last turn; its logprobs are the
sampler's own, and with ``recompute_logprobs`` one teacher-forced pass of the policy over each
whole trajectory gives the ones the update takes. An HF VLM's observations may carry images
(:mod:`nodes.agents.observe`): ``images`` holds each trajectory's in context order, for the
update and the reference; a policy that reads none, and vLLM, refuse them with a reason.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from nodes.agents.env import Environment, Failure, Observation, ToolEnv, call_with_limit
from nodes.agents.observe import observation_ids, reads_images
from nodes.rollout import Rollout
from nodes.seeding import step_seed
from yatt_graph import ANY, BatchPolicy, Node, Port, UsageError
from yatt_graph import Tensor as TensorPort
from yatt_graph.options import reference_problem, unknown_keywords
from yatt_graph.refs import import_ref, ref_of

__all__ = ["AgentRollout", "AgentStats", "load_env"]

log = logging.getLogger(__name__)

GRACE_S = 1.0
"""How long past an environment's ``time_limit_s`` the rollout waits for a ``reset`` or
``step``: time for one that limits its own parts (a :class:`ToolEnv` its tools, to the same
limit) to end a call that ran too long and say which, before the rollout abandons it."""


def load_env(env: str | type, who: str) -> type:
    """The environment class ``env`` names (``"module:Class"``, ``"path/file.py:Class"``) or
    is; it must have ``reset`` and ``step`` and build with no arguments."""
    try:
        cls = import_ref(env) if isinstance(env, str) else env
    except (ImportError, ValueError, FileNotFoundError) as exc:
        problem = reference_problem(env) if isinstance(env, str) else None
        raise UsageError(f"{who}: env {env!r} cannot be loaded: {problem or exc}") from exc
    if not isinstance(cls, type) or not all(
        callable(getattr(cls, m, None)) for m in ("reset", "step")
    ):
        raise UsageError(
            f"{who}: env {env!r} is not an environment class; give a class with reset(row) "
            "and step(action) (nodes.agents.Environment), as 'file.py:Class'"
        )
    limit = getattr(cls, "time_limit_s", Environment.time_limit_s)
    if not _number(limit) or not limit > 0:
        raise UsageError(
            f"{who}: {cls.__name__}.time_limit_s = {limit!r}; give the seconds one reset or "
            "step may run, a number > 0"
        )
    failure = getattr(cls, "failure_reward", Environment.failure_reward)
    if not _number(failure):
        raise UsageError(
            f"{who}: {cls.__name__}.failure_reward = {failure!r}; give a finite number (the "
            "score of a trajectory a failure ended)"
        )
    return cls


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class _Trajectory:
    """One trajectory being sampled: its context, its response so far and what it scored."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.prompt: list[int] = []
        """The first observation's token ids, as the policy encoded it."""
        self.ids: list[int] = []
        self.policy_token: list[bool] = []
        self.logprobs: list[float] = []
        self.reward = 0.0
        self.turns = 0
        self.observation_tokens = 0
        self.done = False
        self.cut = False
        self.transcript: list[str] = []
        self.images: list[Any] = []
        """Every image of the context, in the order of their placeholders."""
        self.turn_times: list[list[float]] = []
        """Per turn: when its sampling began (``time.time()``), the seconds the batch's
        sampling took, and the seconds this trajectory's environment step took."""
        self.error: str | None = None
        """Why the environment ended it: its ``reset`` or ``step`` raised or ran too long."""
        self.failure: Failure | None = None
        """That failure, with the exception it raised."""
        self.tool_calls: list[Any] | None = None
        """A :class:`ToolEnv`'s calls when a failure ended it (its thread may go on)."""

    @property
    def context(self) -> list[int]:
        """What the next turn is sampled after: the prompt, then every token so far."""
        return self.prompt + self.ids

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.ids += ids
        self.policy_token += [logprobs is not None] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


_ROLLOUT_OPTIONS = frozenset(inspect.signature(Rollout.__init__).parameters) - {"self"}
"""The options of :class:`nodes.rollout.Rollout`, which an agent rollout passes on."""
_NOT_TAKEN = {
    "stop_token_ids": "a turn stops at the stop strings",
    "stream_every": "a streamed call hands out what each turn ended",
}
"""The options of a Rollout an agent rollout does not take, and why."""


class AgentRollout(Rollout):
    """Sample multi-turn trajectories against an environment (see the module docstring).

    Inputs: ``prompts`` (the data's, shown to ``env.reset`` as the row's ``prompt``), ``meta``
    (one dict per prompt: the rest of the row) and ``weights``. Outputs: the rollout's ports
    (``texts`` is each trajectory's transcript), ``context_mask``, ``scores`` (each
    trajectory's summed rewards) and ``trajectories`` (one record a trajectory: its turns,
    observation tokens, the tools it called, their errors and seconds; :class:`AgentStats`
    sums them up for the metrics).

    Args:
        env: the environment class (``"module:Class"``, ``"path/file.py:Class"`` or the class).
        max_turns: the most turns of the policy (None: the environment's ``max_turns``).
        max_new_tokens: the longest turn of the policy.
        stream: hand out the trajectories that ended after each turn (HF backend, without
            ``recompute_logprobs``), so the nodes after it start on them while the rest go on.
        options: the others of :class:`nodes.rollout.Rollout` (``n``, ``temperature``, ...,
            ``precision``), but ``stop_token_ids`` and ``stream_every``.
    """

    kind = "rollout"
    inputs = {  # noqa: RUF012
        "prompts": ANY,
        "meta": Port(ANY, required=False, doc="list[dict], one per prompt: the data row"),
        "images": Port(
            ANY,
            required=False,
            doc="list[PIL.Image], one per prompt: the row's image (its 'image')",
        ),
        "weights": Port(ANY, required=False, doc="a state dict loaded before sampling"),
    }
    outputs = {  # noqa: RUF012
        **Rollout.outputs,
        "context_mask": Port(
            TensorPort("float32", "B", "R"),
            doc="1 on every real response token: the policy's turns and the observations",
        ),
        "scores": TensorPort("float32", "B"),
        "images": Port(
            ANY, doc="list[list[PIL.Image]], one a trajectory: its images in context order"
        ),
        "trajectories": Port(
            ANY,
            doc="list[dict], one a trajectory: turns, observation tokens, tool calls, and "
            "each turn's [start (time.time()), sampling s, environment s] (turn_times)",
        ),
    }
    batch_policy = BatchPolicy(max_batch_size=64, splittable=False)

    def __init__(
        self,
        policy: str | Mapping[str, Any] = "tiny-qwen2",
        env: str | type = "nodes.agents.lookup:LookEnv",
        *,
        max_new_tokens: int = 8,
        max_turns: int | None = None,
        **options: Any,
    ) -> None:
        for name, why in _NOT_TAKEN.items():
            if name in options:
                raise TypeError(f"AgentRollout() takes no {name!r}: {why}")
        unknown = {k: v for k, v in options.items() if k not in _ROLLOUT_OPTIONS}
        if unknown:
            raise unknown_keywords(type(self), unknown)
        super().__init__(policy, max_new_tokens=max_new_tokens, **options)
        where = f"node {self.name!r}"
        self.env_class = load_env(env, where)
        self.env = env if isinstance(env, str) else ref_of(env)
        turns = getattr(self.env_class, "max_turns", None) if max_turns is None else max_turns
        if not isinstance(turns, int) or isinstance(turns, bool) or turns < 1:
            raise UsageError(
                f"{where}: max_turns={turns!r}; give an int >= 1 (or set max_turns on the env)"
            )
        self.max_turns = turns
        self._env_error_said = False  # (the first failure of an environment is printed)

    def forward(self, prompts, meta, images, weights) -> dict[str, Any]:
        call, batch, trajectories = self._begin(prompts, meta, images, weights)
        for _ in self._turns(call, trajectories):
            pass
        out = self._on_device(self._pack(batch, trajectories, torch.arange(len(trajectories))))
        own = self._vllm is None or self._vllm.own_logprobs  # the sampler reported logprobs
        if self.recompute_logprobs or not own:
            if any(out["images"]):  # the prompts' and the observations' images, in order
                batch = self.policy.prepare(
                    batch.prompt_ids, batch.prompt_mask, images=out["images"]
                )
            logprobs = self._teacher_logprobs(batch, out["response_ids"], out["context_mask"])
            logprobs = logprobs.to(self.device)  # (B, R) every token read, observations too
            logprobs = torch.where(out["response_mask"] > 0, logprobs, 0.0)  # the turns'
            out["rollout_logprobs"] = out["logprobs"] if own else logprobs
            out["logprobs"] = logprobs
        self.counter.done(call.N)
        return out

    def forward_stream(self, prompts, meta, images, weights) -> Iterator[Any]:
        """Yield ``(rows, outputs, B)`` after each turn: the trajectories that ended in it."""
        call, batch, trajectories = self._begin(prompts, meta, images, weights)
        for rows in self._turns(call, trajectories):
            ended = [trajectories[i] for i in rows]
            out = self._on_device(self._pack(batch, ended, torch.tensor(rows)))
            yield rows, out, len(trajectories)
        self.counter.done(call.N)

    def _begin(self, prompts, meta, images, weights) -> tuple[Any, Any, list[_Trajectory]]:
        """Each trajectory's first observation, from its data row, encoded as the policy's
        prompt: the call, its batch of prompts and the B = N * n trajectories."""
        for port, value in (("meta", meta), ("images", images)):
            if value is not None and len(value) != len(prompts):
                raise ValueError(
                    f"node {self.name!r}: input {port!r} has {len(value)} rows for "
                    f"{len(prompts)} prompts"
                )
        rows = [
            {
                **(meta[i] if meta is not None else {}),
                **({"image": images[i]} if images is not None else {}),
                "prompt": p,
            }
            for i, p in enumerate(prompts)
        ]
        rows_b = [row for row in rows for _ in range(self.n)]  # B = N * n, grouped
        trajectories = [self._start(row) for row in rows_b]
        if all(t.error is not None for t in trajectories):  # no turn to train on
            raise UsageError(
                f"node {self.name!r}: the environment's reset failed for every trajectory of "
                f"the call ({len(trajectories)}), which leaves nothing to train on; the first: "
                f"{trajectories[0].error}. Fix the environment (a reset that fails for some rows "
                "ends only their trajectories)"
            )
        self._say_first_failure(trajectories)
        firsts = trajectories[:: self.n]  # one a prompt
        counts = {len(t.images) for t in firsts}
        if counts == {0, 1}:
            raise UsageError(
                f"node {self.name!r}: some first observations have an image and some none; "
                "a call's prompts take one image each, or none"
            )
        images = [t.images[0] for t in firsts] if counts == {1} else None
        call = self._prepare([t.transcript[0] for t in firsts], images, None, weights)
        batch = call.batch
        for t, ids, mask in zip(
            trajectories, batch.prompt_ids.tolist(), batch.prompt_mask.tolist()
        ):
            t.prompt = [i for i, m in zip(ids, mask) if m]
        return call, batch, trajectories

    def _turns(self, call: Any, trajectories: list[_Trajectory]) -> Iterator[list[int]]:
        """Run the turns; after each, yield the rows of the trajectories that ended in it."""
        for turn in range(self.max_turns):
            live = [i for i, t in enumerate(trajectories) if not t.done]
            if not live:
                break
            last = turn == self.max_turns - 1
            self._turn([trajectories[i] for i in live], step_seed(call.seed, turn), last)
            ended = [i for i in live if trajectories[i].done]
            if ended:
                yield ended
        if self._vllm is not None:
            self._vllm.sleep()  # with enable_sleep_mode: the device is free until the next call

    # --- the turns ---------------------------------------------------------------------------
    def _batch(self, ids: Tensor, mask: Tensor, trajectories: list[_Trajectory]) -> Any:
        """The policy's batch of contexts (int64[b, T], left-padded), with every image each
        trajectory has shown so far where the policy reads images."""
        images = [t.images for t in trajectories]
        if not reads_images(self.policy) or not any(images):
            return self.policy.prepare(ids, mask).to(self.device)
        return self.policy.prepare(ids, mask, images=images).to(self.device)

    def _start(self, row: Mapping[str, Any]) -> _Trajectory:
        env = self.env_class()
        t = _Trajectory(env)
        obs, failure = self._env_call(env, "reset", row)
        if failure is not None:  # ended before its first turn; the row's prompt stands in
            t.transcript.append(str(row.get("prompt", "")))
            self._fail(t, "reset", failure, cut=False)
            return t
        first = self._observe(obs, env, "reset")
        if len(first.images) > 1:
            raise UsageError(
                f"node {self.name!r}: {type(env).__name__}.reset returned "
                f"{len(first.images)} images; a first observation (the prompt) takes one"
            )
        t.transcript.append(first.text)
        t.images = list(first.images)
        return t

    def _env_call(self, env: Any, method: str, arg: Any) -> tuple[Any, Failure | None]:
        """``env.<method>(arg)`` under the environment's time limit (:func:`call_with_limit`):
        its result, or why it failed. A UsageError it raises stops the run as it is."""
        limit = float(getattr(env, "time_limit_s", Environment.time_limit_s))
        what = f"{type(env).__name__}.{method}"
        result, failure, _ = call_with_limit(getattr(env, method), [arg], {}, limit + GRACE_S, what)
        if failure is not None and isinstance(failure.error, UsageError):
            raise failure.error
        if failure is not None and failure.error is None:  # (said with the limit it has)
            failure = Failure(f"ran past its time limit of {limit:g} s")
        return result, failure

    def _fail(self, t: _Trajectory, method: str, failure: Failure, cut: bool) -> None:
        """End ``t`` on a failure of its environment: ``failure_reward``, and the reason kept
        for the metrics (``agent/env_errors``) and the samples."""
        env = t.env
        t.error, t.failure = f"{type(env).__name__}.{method} {failure.reason}", failure
        t.reward += float(getattr(env, "failure_reward", Environment.failure_reward))
        t.done, t.cut = True, cut
        if isinstance(env, ToolEnv):  # what it called up to now; its thread may go on
            t.tool_calls = list(getattr(env, "calls", []))

    def _say_first_failure(self, trajectories: list[_Trajectory]) -> None:
        """The node's first failure of an environment, on stderr once, with its exception and
        the line it was raised at."""
        t = next((t for t in trajectories if t.failure is not None), None)
        if t is None or self._env_error_said:
            return
        self._env_error_said = True
        where, error = "", t.failure.error
        if error is not None and error.__traceback__ is not None:
            last = traceback.extract_tb(error.__traceback__)[-1]
            where = f" (at {last.filename}:{last.lineno} in {last.name})"
        log.warning(
            "node %r: %s%s; its trajectory ended with failure_reward %g and the run goes on. "
            "Each such failure is counted in agent/env_errors and kept in the samples' "
            "env_error column; only this first one is printed",
            self.name, t.error, where,
            float(getattr(t.env, "failure_reward", Environment.failure_reward)),
        )  # fmt: skip

    def _observe(self, obs: Any, env: Any, what: str) -> Observation:
        if isinstance(obs, str):
            obs = Observation(obs)
        if not isinstance(obs, Observation):
            raise UsageError(
                f"node {self.name!r}: {type(env).__name__}.{what} returned a "
                f"{type(obs).__name__}; return an Observation(text, images)"
            )
        if obs.images and not reads_images(self.policy):
            raise UsageError(
                f"node {self.name!r}: {type(env).__name__}.{what} returned an observation "
                f"with images and the {type(self.policy).__name__} policy reads none; use an "
                "image-text-to-text policy (--policy DIR of a VLM, or tiny-qwen2-vl)"
            )
        if obs.images and self._vllm is not None:
            raise UsageError(
                f"node {self.name!r}: {type(env).__name__}.{what} returned an observation "
                "with images; on vLLM this rollout takes text observations only (use the hf "
                "rollout)"
            )
        return obs

    def _turn(self, live: list[_Trajectory], seed: int, last: bool) -> None:
        """One turn of every live trajectory: sample it together, then step each env."""
        pad = self.policy.pad_token_id
        contexts = [t.context for t in live]
        width = max(map(len, contexts))
        ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
        start, t0 = time.time(), time.perf_counter()
        batch = self._batch(ids, mask, live)
        if self._vllm is not None:  # text only: the engine takes the contexts' token ids
            gen = self._vllm.generate([""] * len(live), None, seed, batch)
        else:
            with self._seeded(seed):
                gen = self.policy.generate(batch, **self.sampling, precision=self.precision)
        sampling = time.perf_counter() - t0
        for i, t in enumerate(live):
            n = int(gen.response_lengths[i])
            t.add(gen.response_ids[i, :n].tolist(), gen.logprobs[i, :n].tolist())
            t.turns += 1
            t.transcript.append(gen.texts[i])
            t0 = time.perf_counter()
            self._step(t, gen.texts[i], bool(gen.truncated[i]), last)
            t.turn_times.append([start, sampling, time.perf_counter() - t0])
        self._say_first_failure(live)

    def _step(self, t: _Trajectory, action: str, cut: bool, last: bool) -> None:
        result, failure = self._env_call(t.env, "step", action)
        if failure is not None:
            self._fail(t, "step", failure, cut)
            return
        try:
            obs, reward, done = result
            reward = float(reward)
        except (TypeError, ValueError) as exc:
            raise UsageError(
                f"node {self.name!r}: {type(t.env).__name__}.step must return "
                f"(observation or None, reward, done): {exc}"
            ) from exc
        t.reward += reward
        if done or obs is None:  # the trajectory ended (its last turn may have been cut)
            t.done, t.cut = True, cut
            return
        if last:  # out of turns with the environment still waiting
            t.done, t.cut = True, True
            return
        obs = self._observe(obs, t.env, "step")
        observed = observation_ids(self.policy, obs)
        t.add(observed, None)
        t.images += obs.images
        t.observation_tokens += len(observed)
        t.transcript.append(obs.text)

    # --- the outputs -------------------------------------------------------------------------
    def _pack(self, batch: Any, trajectories: list[_Trajectory], rows: Tensor) -> dict[str, Any]:
        B, R = len(trajectories), max(max(len(t.ids) for t in trajectories), 1)
        pad = self.policy.pad_token_id
        ids = torch.full((B, R), pad, dtype=torch.int64)
        policy_mask = torch.zeros(B, R)
        context = torch.zeros(B, R)
        logprobs = torch.zeros(B, R)
        for i, t in enumerate(trajectories):
            n = len(t.ids)
            ids[i, :n] = torch.tensor(t.ids, dtype=torch.int64)
            policy_mask[i, :n] = torch.tensor(t.policy_token, dtype=torch.float32)
            context[i, :n] = 1.0
            logprobs[i, :n] = torch.tensor(t.logprobs)
        lengths = policy_mask.sum(1).long()  # (B,) the policy's tokens
        return {
            "prompt_ids": batch.prompt_ids[rows].cpu(),
            "prompt_mask": batch.prompt_mask[rows].cpu(),
            "response_ids": ids,
            "response_mask": policy_mask,
            "context_mask": context,
            "logprobs": logprobs,
            "rollout_logprobs": logprobs,  # the sampler's: the same ones, unless recomputed
            "response_lengths": lengths,
            "texts": [" | ".join(t.transcript[1:]) for t in trajectories],
            "group_ids": self.counter.group_ids(rows),
            "truncated": torch.tensor([float(t.cut) for t in trajectories]),
            "images": [list(t.images) for t in trajectories],
            "scores": torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
            "trajectories": [_record(t) for t in trajectories],
            "weight_sync": self._weight_sync(),
        }


def _record(t: _Trajectory) -> dict[str, Any]:
    """What a trajectory did, as plain values (it travels between controllers and joins
    with the other rows of a call cut across replicas)."""
    calls = t.env.calls if isinstance(t.env, ToolEnv) else []
    if t.tool_calls is not None:
        calls = t.tool_calls
    return {
        "prompt": t.transcript[0],
        "turns": t.turns,
        "observation_tokens": t.observation_tokens,
        "tool_calls": [c.name for c in calls],
        "tool_errors": [f"{c.name}: {c.error}" for c in calls if c.error is not None],
        "tool_seconds": sum(c.seconds for c in calls),
        "uses_tools": isinstance(t.env, ToolEnv),
        "env_error": t.error,
        "turn_times": t.turn_times,
    }


class AgentStats(Node):
    """A step's trajectory records (:class:`AgentRollout`'s ``trajectories``) as metrics:
    ``turns_mean``, ``observation_tokens_mean``, ``env_errors`` (the trajectories a failure
    of their environment's ``reset`` or ``step`` ended) and, for tool environments,
    ``tool_use_rate`` (the share that called a tool), ``tool_calls_per_trajectory``,
    ``tool_calls/<name>``, ``tool_errors`` and ``tool_seconds``."""

    inputs = {"trajectories": ANY}  # noqa: RUF012
    outputs = {"stats": Port(ANY, doc="dict[str, float]")}  # noqa: RUF012

    def forward(self, trajectories) -> dict[str, Any]:
        records = list(trajectories)
        B = max(len(records), 1)
        stats = {
            "turns_mean": sum(r["turns"] for r in records) / B,
            "observation_tokens_mean": sum(r["observation_tokens"] for r in records) / B,
            "env_errors": float(sum(r.get("env_error") is not None for r in records)),
        }
        if any(r["uses_tools"] for r in records):
            names = [n for r in records for n in r["tool_calls"]]
            stats["tool_use_rate"] = sum(bool(r["tool_calls"]) for r in records) / B
            stats["tool_calls_per_trajectory"] = len(names) / B
            stats["tool_errors"] = float(sum(len(r["tool_errors"]) for r in records))
            stats["tool_seconds"] = sum(r["tool_seconds"] for r in records)
            for name in sorted(set(names)):
                stats[f"tool_calls/{name}"] = float(names.count(name))
        return {"stats": stats}
