"""The reward spellings of the CLI and the ready graphs (``--reward``), turned into nodes.

Each spelling, its node, and the input ports the node reads (a graph wires ``prompts=`` and
``images=`` only where the node's ``needs_prompts`` / ``needs_images`` say so):

* ``module:function`` or ``path/to/file.py:function``: :class:`RuleReward`, ``fn(text, meta)``;
  reads texts, meta.
* ``clip``: :class:`ClipScoreReward` with a tiny random CLIP (demos and tests: its scores carry
  no meaning); reads texts, images (meta for template keys).
* ``clip:open_clip:NAME[:WEIGHTS_FILE]``: :class:`ClipScoreReward` of that open_clip model (a
  local weights file; without one the architecture has random weights); reads texts, images.
* ``model:DIR``: :class:`RewardModel`, a local sequence classifier with one logit; reads
  texts, prompts.
* ``judge:DIR`` or ``judge:tiny``: :class:`JudgeReward`, a local causal LM (or VLM) judge, or a
  tiny random one; reads texts, prompts, meta (and images for a VLM directory).
* ``http://HOST:PORT/PATH`` (or ``https://``): :class:`HttpReward`, a reward server that each
  sample is posted to (:mod:`nodes.rewards.remote` has the JSON); reads texts, prompts, meta.

The CLIP rewards score the response text itself (e.g. a caption, or an answer such as "red")
against the sample's image, so they are high when the response names what the image shows.

With ``on_bad_sample="skip"`` every node is built with ``emit_bad_mask=True``: it has a second
output, ``bad_samples`` bool[B], so that a graph can always unpack ``scores, skipped``.
The kinds are registered (:data:`REWARD_KINDS`): a new kind is one decorated function. A
registered kind wins over a rule reference of the same module name.
"""

from __future__ import annotations

from typing import Any

from nodes.registry import Registry
from nodes.rewards.base import RewardNode
from nodes.rewards.clip import TINY_CLIP_REWARD_CFG, ClipScoreReward
from nodes.rewards.judge import JudgeReward
from nodes.rewards.models import RewardModel
from nodes.rewards.remote import HttpReward
from nodes.rewards.rules import RuleReward
from yatt_graph.options import reference_problem

__all__ = ["REWARD_KINDS", "reward_from_option", "spellings"]

REWARD_KINDS: Registry = Registry("reward kind")
"""The rewards ``--reward KIND[:REST]`` names beside a rule reference: ``fn(rest, options) ->
RewardNode``, where ``options`` are the keyword arguments every reward node takes
(``on_bad_sample``, ``emit_bad_mask``, ``name``) and ``rest`` what follows ``KIND:`` (None
when the spelling is ``KIND`` alone)."""

RULE = "module:function or path/file.py:function (a rule fn(text, meta) -> float)"


@REWARD_KINDS.register(
    "clip",
    "clip (a tiny random CLIP score of the response against the image), or "
    "clip:open_clip:NAME[:WEIGHTS_FILE] (an open_clip model; weights: a local file)",
)
def _clip(rest: str | None, options: dict[str, Any]) -> RewardNode:
    if rest is None:
        return ClipScoreReward("ViT-S-32", model_overrides=TINY_CLIP_REWARD_CFG, **options)
    backend, _, model = rest.partition(":")
    arch, _, weights = model.partition(":")
    if backend != "open_clip" or not arch:
        raise _bad(
            f"clip:{rest}", "a CLIP reward is 'clip' or 'clip:open_clip:NAME[:WEIGHTS_FILE]'"
        )
    return ClipScoreReward(arch, weights or None, **options)


@REWARD_KINDS.register("model", "model:DIR (a local sequence classifier with one logit)")
def _model(rest: str | None, options: dict[str, Any]) -> RewardNode:
    if not rest:
        raise _bad("model:", "model: needs a directory after the colon")
    return RewardModel(rest, **options)


@REWARD_KINDS.register(
    "judge", "judge:DIR or judge:tiny (a local causal LM or VLM judge, or a tiny random one)"
)
def _judge(rest: str | None, options: dict[str, Any]) -> RewardNode:
    if not rest:
        raise _bad("judge:", "judge: needs a directory after the colon")
    return JudgeReward(rest, **options)


@REWARD_KINDS.register(
    "http",
    "http://HOST:PORT/PATH (a reward server: POST {prompt, response, meta} as JSON, read "
    '{"score": x})',
)
def _http(rest: str | None, options: dict[str, Any]) -> RewardNode:
    return _server("http", rest, options)


@REWARD_KINDS.register("https", "https://HOST:PORT/PATH (as http://, over TLS)")
def _https(rest: str | None, options: dict[str, Any]) -> RewardNode:
    return _server("https", rest, options)


def _server(scheme: str, rest: str | None, options: dict[str, Any]) -> RewardNode:
    if not rest or not rest.startswith("//") or not rest[2:].split("/")[0]:
        raise _bad(f"{scheme}:{rest or ''}", f"a reward server is {scheme}://HOST:PORT/PATH")
    return HttpReward(f"{scheme}:{rest}", **options)


def spellings() -> list[str]:
    """Every spelling ``--reward`` takes, one line each: a rule, then the registered kinds."""
    return [RULE, *(REWARD_KINDS.help(kind) for kind in REWARD_KINDS)]


def _bad(value: str, why: str) -> ValueError:
    listed = "\n  ".join(spellings())
    return ValueError(f"reward {value!r}: {why}. The spellings are:\n  {listed}")


BUDGETED = ("model", "judge")
"""The kinds whose node reads every response with a model: they take ``micro_batch_tokens``."""

ON_DEVICE = ("clip", "model", "judge")
"""The kinds whose node runs a model: they take the run's ``device``."""

CALLED = ("http", "https")
"""The kinds whose node calls out once per sample (as a rule does): they take ``concurrency``,
``timeout_s`` and ``retries`` (:mod:`nodes.rewards.calls`)."""


def reward_from_option(
    value: str,
    *,
    on_bad_sample: str = "raise",
    name: str = "reward",
    micro_batch_tokens: int = 0,
    device: str = "cpu",
    concurrency: int | None = None,
    timeout_s: float | None = None,
    retries: int | None = None,
) -> RewardNode:
    """The reward node that the option string ``value`` names (see the module's table).

    Args:
        value: a registered kind (:data:`REWARD_KINDS`, ``KIND`` or ``KIND:REST``) or a rule
            reference.
        on_bad_sample: ``"raise"`` or ``"skip"`` (then the node also outputs ``bad_samples``).
        name: the node's name in the graph.
        micro_batch_tokens: for the kinds in :data:`BUDGETED`, at most this many padded tokens
            a forward pass (0: rows only); the others read no model.
        device: where the kinds in :data:`ON_DEVICE` run their model (a rule runs in Python).
        concurrency, timeout_s, retries: how a rule's and the kinds in :data:`CALLED` calls
            run (:mod:`nodes.rewards.calls`); None: what the reward declares, else its default.

    Raises:
        ValueError: a spelling that is none of the above (the message lists them), or a rule
            reference that does not import.
        FileNotFoundError: ``model:DIR`` or ``judge:DIR`` where DIR is not a directory.
    """
    if not isinstance(value, str) or not value.strip():
        raise _bad(str(value), "is empty")
    value = value.strip()
    if on_bad_sample not in ("raise", "skip"):
        raise ValueError(f"on_bad_sample must be 'raise' or 'skip', got {on_bad_sample!r}")
    options: dict[str, Any] = {
        "on_bad_sample": on_bad_sample,
        "emit_bad_mask": on_bad_sample == "skip",
        "name": name,
    }
    kind, colon, rest = value.partition(":")
    if kind in BUDGETED and micro_batch_tokens:
        options["micro_batch_tokens"] = int(micro_batch_tokens)
    if kind in ON_DEVICE:
        options["device"] = device
    calls = {"concurrency": concurrency, "timeout_s": timeout_s, "retries": retries}
    calls = {key: value for key, value in calls.items() if value is not None}
    if kind in CALLED or kind not in REWARD_KINDS:
        options.update(calls)
    if kind in REWARD_KINDS:
        return REWARD_KINDS[kind](rest if colon else None, options)
    if not rest or not kind:
        raise _bad(value, "is not a known spelling")
    try:
        return RuleReward(value, **options)
    except (ImportError, ValueError, FileNotFoundError) as exc:
        raise _unimported(value, exc) from exc


def _unimported(value: str, exc: Exception) -> ValueError:
    """The error for a rule reference (``file.py:fn``, ``module:fn``) that did not give a
    function: what is wrong with it (:func:`reference_problem`), else the spellings."""
    problem = reference_problem(value)
    if problem:
        return ValueError(f"reward {value!r}: {problem}")
    return _bad(value, f"the rule reference does not import ({exc})")
