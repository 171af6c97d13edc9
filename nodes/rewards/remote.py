"""A reward served over HTTP: ``--reward http://HOST:PORT/PATH``.

Each sample is one ``POST`` to the URL, ``Content-Type: application/json``::

    request   {"prompt": "...", "response": "...", "meta": {"answer": "...", ...}}
    reply     {"score": 0.75}

* ``prompt``: the sample's prompt (a string, or the row's chat messages, a list of
  ``{"role", "content"}``); ``response``: the policy's response; ``meta``: the data row's other
  columns (a value JSON cannot hold is sent as its ``str()``).
* The reply is status 200 with a JSON object whose ``score`` is a number; other keys are
  ignored. A reply that is not that (another status, no JSON, no number) is a bad sample,
  named with the URL and what came back (``on_bad_sample``).
* Calls run 16 at a time, each try within 30 s, with 2 retries after an error or a 5xx status
  (a 4xx status is not retried: the request itself was refused); ``concurrency``,
  ``timeout_s`` and ``retries`` change that (:mod:`nodes.rewards.calls`).
* A server that cannot be reached (nothing listens there, an unknown host) stops the run
  under either ``on_bad_sample``, naming the URL: no sample is at fault.

The standard library's ``urllib.request`` does the posting, one thread per call at once.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

import msgspec

from nodes.rewards.base import RewardNode
from nodes.rewards.calls import CallFailure, CallPolicy, SampleError, call_policy, run_calls
from yatt_graph import UsageError

__all__ = ["HTTP_CALLS", "HttpReward", "ScoreReply", "ScoreRequest"]

HTTP_CALLS = CallPolicy(concurrency=16, timeout_s=30.0, retries=2)
"""How the posts run unless the node's options say otherwise."""


class ScoreRequest(msgspec.Struct):
    """What is posted for one sample."""

    prompt: Any
    """The prompt: a string, or chat messages (a list of ``{"role", "content"}``)."""
    response: str
    """The policy's response."""
    meta: dict[str, Any]
    """The data row's other columns (``answer``, ...)."""


class ScoreReply(msgspec.Struct):
    """What the server answers (other keys are ignored)."""

    score: float
    """The sample's reward."""


_REPLY = msgspec.json.Decoder(ScoreReply)
_SCHEMA = 'the JSON {"score": number} a reward server answers (nodes.rewards.remote)'


class _Unreachable(Exception):
    """No server answered at the URL (refused, unknown host): the run's error, not a sample's."""


class HttpReward(RewardNode):
    """Scores each sample by posting ``{prompt, response, meta}`` to ``url`` and reading
    ``{"score": x}`` (the module's docstring has the schema).

    Args:
        url: ``http://HOST:PORT/PATH`` or ``https://...``.
        concurrency, timeout_s, retries: how the posts run (None: :data:`HTTP_CALLS`).
        options: the RewardNode options (on_bad_sample, emit_bad_mask, name).
    """

    needs_prompts = True
    execution_options = ("concurrency", "timeout_s", "retries")

    def __init__(
        self,
        url: str,
        *,
        concurrency: int | None = None,
        timeout_s: float | None = None,
        retries: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"node {self.name!r}: url must start with http:// or https://, got {url!r}")  # fmt: skip
        host = url.split("://", 1)[1].split("/", 1)[0]
        if not host:
            raise ValueError(
                f"node {self.name!r}: url {url!r} has no host; write http://HOST:PORT/PATH"
            )
        self.url = url
        self.calls = call_policy(
            self._post,
            f"node {self.name!r}",
            declared=HTTP_CALLS,
            concurrency=concurrency,
            timeout_s=timeout_s,
            retries=retries,
        )

    def score_samples(self, texts, meta, prompts, images):
        prompts = prompts if prompts is not None else [""] * len(texts)
        calls = [((p, t, m or {}), {}) for p, t, m in zip(prompts, texts, meta)]
        scores = run_calls(self._post, calls, self.calls)
        for failure in scores:
            if isinstance(failure, CallFailure) and isinstance(failure.error, _Unreachable):
                raise UsageError(
                    f"node {self.name!r}: reward {self.url}: {failure.error}; start the reward "
                    "server there, or give --reward the URL it listens on"
                )
        return scores

    def _post(self, prompt: Any, response: str, meta: dict[str, Any]) -> float:
        body = msgspec.json.encode(ScoreRequest(prompt, response, dict(meta)), enc_hook=str)
        request = urllib.request.Request(
            self.url, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.calls.timeout_s) as answer:
                status, reply = answer.status, answer.read()
        except urllib.error.HTTPError as exc:
            status, reply = exc.code, exc.read()
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, OSError) and not isinstance(exc.reason, TimeoutError):
                raise _Unreachable(f"no server answers ({exc.reason})") from exc
            raise
        shown = reply[:80].decode("utf-8", "replace")
        if status >= 500:  # the server's trouble: tried again
            raise RuntimeError(f"the server answered status {status} ({shown!r})")
        if status != 200:
            raise SampleError(f"the server answered status {status} ({shown!r}), not {_SCHEMA}")
        try:
            return _REPLY.decode(reply).score
        except msgspec.DecodeError as exc:
            raise SampleError(f"the server answered {shown!r} ({exc}), not {_SCHEMA}") from None

    def scorer(self) -> str:
        return f" from {self.url}"
