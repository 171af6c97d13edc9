"""Rule rewards: a user function of the response text and the sample's metadata."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from nodes.chat import chat_messages
from nodes.rewards.base import RewardNode
from nodes.rewards.calls import CallFailure, call_policy, run_calls
from yatt_graph import UsageError
from yatt_graph.refs import import_ref

__all__ = ["RuleReward", "contains_answer", "exact_match", "regex_format"]

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# rule rewards
# ---------------------------------------------------------------------------------------------


def _normalize(s: str) -> str:
    return " ".join(str(s).strip().lower().split())


def _answers(meta: Mapping[str, Any], key: str, rule: str) -> list[str]:
    if key not in meta:
        raise ValueError(f"{rule}: meta has no {key!r} key (its keys: {sorted(meta)})")
    answer = meta[key]
    return [str(a) for a in answer] if isinstance(answer, list | tuple) else [str(answer)]


def exact_match(
    text: str, meta: Mapping[str, Any], *, key: str = "answer", normalize: bool = True
) -> float:
    """1.0 if the response equals ``meta[key]`` (or one of them, if a list), else 0.0.

    With ``normalize`` both sides are stripped, lower-cased and whitespace-collapsed.
    """
    fix = _normalize if normalize else str
    return float(any(fix(text) == fix(a) for a in _answers(meta, key, "exact_match")))


def contains_answer(
    text: str, meta: Mapping[str, Any], *, key: str = "answer", case_sensitive: bool = False
) -> float:
    """1.0 if ``meta[key]`` (or one of them, if a list) occurs in the response, else 0.0."""
    fix = (lambda s: s) if case_sensitive else (lambda s: s.lower())
    return float(any(fix(a) in fix(text) for a in _answers(meta, key, "contains_answer")))


def regex_format(
    text: str, meta: Mapping[str, Any], *, pattern: str, full_match: bool = False
) -> float:
    """1.0 if the response matches ``pattern`` (``re.search``, or ``re.fullmatch`` with
    ``full_match``; DOTALL, so ``.`` spans lines), else 0.0. ``meta`` is not read."""
    match = re.fullmatch if full_match else re.search
    return float(match(pattern, text, flags=re.DOTALL) is not None)


def batched(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is a TRL-style reward, ``fn(prompts, completions, **columns) ->
    list[float]`` (called once per batch), told apart from ``fn(text, meta)`` by its
    ``completions`` parameter."""
    import inspect

    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _check_signature(fn: Callable[..., Any], params: Mapping[str, Any], where: str) -> None:
    """Refuse a reward that cannot be called as ``fn(text, meta, **params)`` (or, TRL-style,
    ``fn(prompts=..., completions=..., **params)``), before a step."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin with no signature: its first call will tell
        return
    try:
        if batched(fn):  # the data's columns come as more keywords: only these must fit
            signature.bind_partial(prompts=[], completions=[], **params)
        else:
            signature.bind("text", {}, **params)
    except TypeError as exc:
        name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
        raise TypeError(
            f"{where}: the reward {name}{signature} cannot be called as fn(text, meta"
            f"{', **params' if params else ''}) ({exc}); a reward takes the response text and "
            "the row's meta dict"
        ) from None


class RuleReward(RewardNode):
    """Scores each sample with a user function ``fn(text, meta, **params) -> float | dict``.

    A TRL-style reward, ``fn(prompts, completions, **kwargs) -> list[float | None]`` (a
    ``completions`` parameter tells it apart), is taken as it is: called once per batch with
    the prompts, the responses and every other column of the rows as lists (as TRL passes a
    dataset's columns), plus ``params``; a None score is a bad sample (``on_bad_sample``).

    ``fn`` may be an ``async def``, and may declare how its calls run with
    ``@reward(concurrency=..., timeout_s=..., retries=...)`` (:mod:`nodes.rewards.calls`); a
    call that raises or runs out of time after its retries is a bad sample (``on_bad_sample``).

    Args:
        fn: a module-level function, or its reference ``"package.module:function"`` (imported,
            never evaluated). It returns a number (bools count as 0/1) or a dict
            ``{"score": x, "token_rewards": [...]?, ...}``; other dict keys are ignored.
        params: keyword arguments passed to ``fn`` (JSON values), e.g. ``{"pattern": "..."}``.
        concurrency, timeout_s, retries: how the calls run, over what ``fn`` declares (None:
            its declaration, else one call at a time, no limit, no retry; an ``async def``: 16
            at a time).
        options: the RewardNode options (token_level, on_bad_sample, emit_bad_mask, name;
            see the module docstring).
    """

    execution_options = ("concurrency", "timeout_s", "retries")

    def __init__(
        self,
        fn: Callable[..., Any] | str,
        *,
        params: Mapping[str, Any] | None = None,
        concurrency: int | None = None,
        timeout_s: float | None = None,
        retries: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        if isinstance(fn, str):
            fn = import_ref(fn)
        if not callable(fn):
            raise TypeError(
                f"node {self.name!r}: fn must be callable or 'module:function', got {fn!r}"
            )
        if "<" in getattr(fn, "__qualname__", "<"):
            raise TypeError(
                f"node {self.name!r}: fn {getattr(fn, '__qualname__', fn)!r} is a lambda or a local "
                "function; define it at module level so that a plan can rebuild this node elsewhere"
            )
        self.fn = fn
        self.params = dict(params or {})
        _check_signature(fn, self.params, f"node {self.name!r}")
        self.reads_meta = frozenset(getattr(fn, "reads_meta", ()))  # a rule's declared keys
        self._fn_name = f"{getattr(fn, '__module__', '?')}:{fn.__qualname__}"
        self.batched = batched(fn)
        self.needs_prompts = self.batched
        self.calls = call_policy(
            fn, f"node {self.name!r}", concurrency=concurrency, timeout_s=timeout_s, retries=retries
        )

    def score_samples(self, texts, meta, prompts, images):
        if self.batched:
            return self._score_batch(texts, meta, prompts)
        # each call its own copy of the row's meta: a reward may change it freely
        calls = [((text, dict(m) if m is not None else {}), self.params) for text, m in zip(texts, meta)]  # fmt: skip
        return run_calls(self.fn, calls, self.calls)

    def _score_batch(self, texts, meta, prompts) -> list[Any]:
        rows = [m or {} for m in meta]
        columns = {k: [row.get(k) for row in rows] for k in dict.fromkeys(k for r in rows for k in r)}  # fmt: skip
        clash = sorted({"prompts", "completions"} & set(columns))
        if clash:
            raise ValueError(
                f"node {self.name!r}: the data has columns named {clash}, which a TRL-style reward "
                "takes as its own arguments; rename those columns"
            )
        prompts = list(prompts or [""] * len(texts))
        # As TRL: where a prompt is chat messages, its completion is one assistant message.
        completions = [
            [{"role": "assistant", "content": text}] if chat_messages(p) is not None else text
            for p, text in zip(prompts, texts)
        ]
        kwargs = {"prompts": prompts, "completions": completions, **columns, **self.params}
        (got,) = run_calls(self.fn, [((), kwargs)], self.calls)
        if isinstance(got, CallFailure):
            if self.on_bad_sample == "raise":
                error = UsageError if got.user_error else ValueError
                raise error(
                    f"node {self.name!r}: reward function {self._fn_name} failed on the batch: "
                    f"{got.reason}. Fix the reward, or pass on_bad_sample='skip' to score the "
                    "batch's samples 0 and count them"
                ) from got.error
            return [got] * len(texts)
        if _is_vector(got):  # a 1-D numpy array or tensor: its numbers, as a list
            got = got.tolist()
        if isinstance(got, list | tuple) and len(got) == len(texts):
            return list(got)
        if isinstance(got, list | tuple):
            what = f"a {type(got).__name__} of {len(got)} score(s)"
        else:
            shown = repr(got)
            what = f"a {type(got).__name__} ({shown if len(shown) <= 60 else shown[:56] + ' ...'})"
        message = (
            f"node {self.name!r}: reward function {self._fn_name} returned {what} for "
            f"{len(texts)} completions; a TRL-style reward returns a list of one score per "
            "completion, in their order (a number, or None for a bad sample)"
        )
        if self.on_bad_sample == "raise":
            raise UsageError(
                f"{message}. Fix the reward, or pass on_bad_sample='skip' to score the batch's "
                "samples 0 and count them"
            )
        log.warning("%s; its %d samples are scored 0 and counted as bad", message, len(texts))
        return [None] * len(texts)

    def scorer(self) -> str:
        return f" from reward function {self._fn_name}"


def _is_vector(value: Any) -> bool:
    """A 1-D numpy array or torch tensor (what a batched reward may return for a list)."""
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) == 1 and callable(getattr(value, "tolist", None))
