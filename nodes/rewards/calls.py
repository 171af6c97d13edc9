"""How a reward's calls run: several at once, each with a time limit and retries.

A rule reward ``fn(text, meta)`` is called once per sample. By default a ``def`` is called one
sample after another in the node's thread, with no time limit, as a plain loop would; a reward
that waits (on a server, a sandbox, a slow check) declares how its calls may run::

    from nodes.rewards import reward

    @reward(concurrency=16, timeout_s=10, retries=2)
    def score(text, meta): ...

    @reward(timeout_s=30)
    async def judge(text, meta): ...

* ``concurrency``: calls at once. A ``def`` runs each call in a thread of its own; an ``async
  def`` runs on one event loop in a background thread (it must not block: put blocking work in
  a ``def``). Default 1 for a ``def``, :data:`ASYNC_CONCURRENCY` for an ``async def``.
* ``timeout_s``: the most one try may take, in seconds (None: no limit). An ``async def`` past
  it is cancelled; a ``def`` cannot be stopped (Python has no way to kill a thread), so its
  thread is left to finish in the background and its result is dropped: a reward that may
  never return should run its work in a subprocess it can kill (as
  ``examples/code_reward.py`` does).
* ``retries``: more tries after a try that raised or ran out of time (default 0), after
  0.1 s, 0.2 s, ... (at most 2 s). A reward raises :class:`SampleError` to fail its sample at
  once, with no retry.

The node's own options (``RuleReward(fn, concurrency=..., timeout_s=..., retries=...)``, for a
graph of one's own) win over what the function declares, which wins over the defaults. Scores keep the samples' order whatever order the calls end in. A call that
still fails after its retries is a bad sample (:mod:`nodes.rewards`: ``on_bad_sample``).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "ASYNC_CONCURRENCY",
    "CallFailure",
    "CallPolicy",
    "SampleError",
    "call_policy",
    "reward",
    "run_calls",
]

ASYNC_CONCURRENCY = 16
"""Calls at once of an ``async def`` reward that declares no concurrency: an async reward waits
on IO, so several overlap where one at a time would leave the loop idle."""

_BACKOFF_S = 0.1
_BACKOFF_MAX_S = 2.0


class SampleError(Exception):
    """Raised by a reward to fail its sample at once, without retries; the message is why."""


@dataclass(frozen=True)
class CallPolicy:
    """How the calls of one reward run (see the module's docstring)."""

    concurrency: int = 1
    """Calls at once (>= 1)."""
    timeout_s: float | None = None
    """The most one try may take, in seconds (> 0); None: no limit."""
    retries: int = 0
    """More tries after a try that raised or ran out of time (>= 0)."""

    def verify(self, where: str) -> CallPolicy:
        """This policy, or a ValueError naming ``where`` and the value out of range."""
        if not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ValueError(f"{where}: concurrency must be an int >= 1, got {self.concurrency!r}")
        if self.timeout_s is not None and not (
            isinstance(self.timeout_s, int | float)
            and math.isfinite(self.timeout_s)
            and self.timeout_s > 0
        ):
            raise ValueError(
                f"{where}: timeout_s must be a finite number of seconds > 0, or None for no "
                f"limit, got {self.timeout_s!r}"
            )
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"{where}: retries must be an int >= 0, got {self.retries!r}")
        return self


@dataclass(frozen=True)
class CallFailure:
    """What a call that gave no value left: why (one phrase) and the exception, if it raised."""

    reason: str
    """E.g. ``"it raised KeyError: 'answer'"`` or ``"no answer within timeout_s=10"``."""
    error: BaseException | None = None
    """The exception of the last try (None when it ran out of time)."""
    user_error: bool = False
    """Whether the fix is the user's setting, not a bug in the reward's code (a time limit, a
    server that is down): reported in one line, with no traceback."""


def reward(
    fn: Callable[..., Any] | None = None,
    *,
    concurrency: int | None = None,
    timeout_s: float | None = None,
    retries: int | None = None,
) -> Any:
    """Declare how a reward's calls run: ``@reward(concurrency=16, timeout_s=10, retries=2)``.

    Returns the function itself with a ``call_policy`` attribute (:class:`CallPolicy`); an
    option left None takes its default. ``@reward`` alone declares nothing new.
    """

    def declare(f: Callable[..., Any]) -> Callable[..., Any]:
        where = f"@reward on {getattr(f, '__name__', f)!r}"
        base = default_policy(f)
        given = {"concurrency": concurrency, "timeout_s": timeout_s, "retries": retries}
        f.call_policy = replace(base, **{k: v for k, v in given.items() if v is not None})  # type: ignore[attr-defined]
        f.call_policy.verify(where)  # type: ignore[attr-defined]
        return f

    return declare if fn is None else declare(fn)


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` gives a coroutine (an ``async def``, or an object whose
    ``__call__`` is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 (a callable object's method)
    )


def default_policy(fn: Callable[..., Any]) -> CallPolicy:
    """The policy of a reward that declares none: one call at a time for a ``def``,
    :data:`ASYNC_CONCURRENCY` for an ``async def``; no time limit, no retries."""
    return CallPolicy(concurrency=ASYNC_CONCURRENCY if is_async(fn) else 1)


def call_policy(
    fn: Callable[..., Any],
    where: str,
    *,
    declared: CallPolicy | None = None,
    concurrency: int | None = None,
    timeout_s: float | None = None,
    retries: int | None = None,
) -> CallPolicy:
    """The policy ``fn``'s calls run under: the options given (not None) over what ``fn``
    declares (``@reward``, or ``declared`` for a node's own function) over the defaults; a
    ValueError naming ``where`` when one is out of range."""
    declared = declared or getattr(fn, "call_policy", None)
    policy = declared if isinstance(declared, CallPolicy) else default_policy(fn)
    given = {"concurrency": concurrency, "timeout_s": timeout_s, "retries": retries}
    return replace(policy, **{k: v for k, v in given.items() if v is not None}).verify(where)


# ---------------------------------------------------------------------------------------------
# running the calls
# ---------------------------------------------------------------------------------------------

Call = tuple[tuple[Any, ...], dict[str, Any]]
"""One call's positional and keyword arguments."""


def run_calls(fn: Callable[..., Any], calls: Sequence[Call], policy: CallPolicy) -> list[Any]:
    """``fn(*args, **kwargs)`` for each call under ``policy``: the values in the calls' order,
    a :class:`CallFailure` where a call gave none after its retries. Never raises for a call."""
    if not is_async(fn) and policy.concurrency == 1 and policy.timeout_s is None:
        return [_call_here(fn, args, kwargs, policy) for args, kwargs in calls]  # (no threads)
    future = asyncio.run_coroutine_threadsafe(_all(fn, calls, policy), _event_loop())
    return future.result()


def _call_here(fn: Callable[..., Any], args: Any, kwargs: Any, policy: CallPolicy) -> Any:
    for attempt in range(policy.retries + 1):
        try:
            return fn(*args, **kwargs)
        except (Exception, SystemExit) as exc:  # (a reward that calls sys.exit)
            if isinstance(exc, SampleError) or attempt == policy.retries:
                return _raised(exc, attempt + 1)
            time.sleep(_backoff(attempt))
    raise AssertionError("unreachable")


async def _all(fn: Callable[..., Any], calls: Sequence[Call], policy: CallPolicy) -> list[Any]:
    gate = asyncio.Semaphore(policy.concurrency)

    async def one(args: Any, kwargs: Any) -> Any:
        async with gate:
            return await _with_retries(fn, args, kwargs, policy)

    return list(await asyncio.gather(*(one(args, kwargs) for args, kwargs in calls)))


async def _with_retries(fn: Callable[..., Any], args: Any, kwargs: Any, policy: CallPolicy) -> Any:
    for attempt in range(policy.retries + 1):
        tries = attempt + 1
        try:
            call = fn(*args, **kwargs) if is_async(fn) else _in_thread(fn, args, kwargs)
            task = asyncio.ensure_future(call)
            # asyncio.wait, not wait_for: a TimeoutError the reward raises itself is its error
            done, _ = await asyncio.wait({task}, timeout=policy.timeout_s)
            if done:
                return task.result()
            task.cancel()
            if attempt == policy.retries:
                more = f" ({tries} tries)" if tries > 1 else ""
                return CallFailure(
                    f"no answer within timeout_s={policy.timeout_s:g}{more} (make it faster, or "
                    "give it more time: a larger timeout_s)",
                    user_error=True,
                )
        except (Exception, SystemExit) as exc:
            if isinstance(exc, SampleError) or attempt == policy.retries:
                return _raised(exc, tries)
        await asyncio.sleep(_backoff(attempt))
    raise AssertionError("unreachable")


def _in_thread(fn: Callable[..., Any], args: Any, kwargs: Any) -> asyncio.Future:
    """``fn(*args, **kwargs)`` in a thread of its own, as a future of the loop. A thread
    rather than a pool's: a call past its time limit keeps its thread (nothing can stop it), and
    must not hold a pool's worker that the next call waits for."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # it ran out of time: nobody waits for it
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def work() -> None:
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 (SystemExit too: handed to the caller)
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, value, None)

    threading.Thread(target=work, name="reward-call", daemon=True).start()
    return future


def _raised(exc: BaseException, tries: int) -> CallFailure:
    more = f" ({tries} tries)" if tries > 1 else ""
    if isinstance(exc, SampleError):
        return CallFailure(f"{exc}{more}", exc, user_error=True)
    return CallFailure(f"it raised {type(exc).__name__}: {exc}{more}", exc)


def _backoff(attempt: int) -> float:
    return min(_BACKOFF_S * 2**attempt, _BACKOFF_MAX_S)


_loop_lock = threading.Lock()
_loop: tuple[int, asyncio.AbstractEventLoop] | None = None


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's reward event loop, running in a daemon thread (started on first use, and
    again in a forked child, whose copy of the thread is gone). One loop for every batch, so
    that an async reward may keep clients bound to it between calls; its own thread, so that a
    caller already inside a loop (a notebook) can wait on it."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="reward-loop", daemon=True).start()
            _loop = (os.getpid(), loop)
        return _loop[1]
