"""The base of the reward nodes: input checks, the bad-score policy and token rewards
(:mod:`nodes.rewards` describes them)."""

from __future__ import annotations

import logging
import math
import numbers
import string
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nodes.rewards.calls import CallFailure
from yatt_graph import ANY, BatchPolicy, Node, Port, Tensor, UsageError

__all__ = ["RewardNode", "fill_template", "place_on_last_token", "template_fields"]

log = logging.getLogger(__name__)

_BAD_POLICIES = ("raise", "skip")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token rewards that are 0 everywhere but ``scores[i]`` on the last real token of row i.

    Args:
        scores: (B,) one score per sample.
        response_mask: (B, R); nonzero on real response tokens.

    Returns:
        (B, R) float32.
    """
    if scores.dim() != 1 or response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"place_on_last_token: scores {tuple(scores.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must be (B,) and (B, R)"
        )
    real = response_mask != 0  # (B, R)
    empty = (~real.any(dim=1)).nonzero().reshape(-1)  # (K,)
    if empty.numel():
        raise ValueError(
            f"place_on_last_token: response_mask row {int(empty[0])} has no real token "
            f"({empty.numel()} empty rows); every response needs at least one (its EOS)"
        )
    positions = torch.arange(real.shape[1], device=real.device)  # (R,)
    last = (positions * real).argmax(dim=1)  # (B,) index of the last real token
    out = torch.zeros(real.shape, dtype=torch.float32, device=scores.device)  # (B, R)
    out[torch.arange(real.shape[0]), last] = scores.to(torch.float32)
    return out


def _as_number(value: Any) -> float | None:
    """A float from a Python/numpy number, a bool or a 1-element tensor; None if not a number."""
    if isinstance(value, torch.Tensor):
        return float(value.reshape(-1)[0]) if value.numel() == 1 else None
    if isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
        return float(value)
    return None


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _fits(number: float) -> bool:
    """Finite, and within float32's range (the scores' dtype: 1e39 would overflow)."""
    return math.isfinite(number) and abs(number) <= _FLOAT32_MAX


def _check_list(node: str, port: str, values: Any, n: int | None) -> list[Any]:
    if isinstance(values, tuple):
        values = list(values)
    if not isinstance(values, list):
        raise ValueError(
            f"node {node!r}: input {port!r} must be a list, got {type(values).__name__}"
        )
    if n is not None and len(values) != n:
        # One item per prompt (N) for B = N * n samples: repeat, as the rollout groups rows.
        if values and n % len(values) == 0:
            return [v for v in values for _ in range(n // len(values))]
        raise ValueError(
            f"node {node!r}: input {port!r} has {len(values)} items but 'texts' has {n}; "
            "give one item per sample, or one per prompt when each prompt has the same number "
            "of samples"
        )
    return values


def template_fields(
    node: str, template: str, meta_keys: Sequence[str], *, one_of: Sequence[str] = ("response",)
) -> frozenset[str]:
    """The placeholders of a reward's text template, checked when the node is declared.

    A template may use ``{prompt}``, ``{response}`` and the meta keys in ``meta_keys`` (the
    data row's columns, e.g. ``{answer}``); it must use at least one of ``one_of``. Literal
    braces are written ``{{`` and ``}}``. Anything else is a ValueError naming the placeholder.
    """
    if not isinstance(template, str):
        raise ValueError(f"node {node!r}: template must be a str, got {type(template).__name__}")
    allowed = ("prompt", "response", *meta_keys)
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(
            f"node {node!r}: template {template!r} is malformed ({exc}); write literal braces "
            "as {{ and }}"
        ) from exc
    fields = {field for _, field, _, _ in parsed if field is not None}
    for field in sorted(fields):
        if not field.isidentifier():
            raise ValueError(
                f"node {node!r}: template {template!r}: placeholder {{{field}}} is not a name; "
                f"use {{prompt}}, {{response}} or a meta key in {list(meta_keys)}"
            )
        if field not in allowed:
            raise ValueError(
                f"node {node!r}: template {template!r} has an unknown placeholder {{{field}}}; "
                f"it may use {{prompt}}, {{response}} and the meta keys {list(meta_keys)} "
                "(add a data column's name to meta_keys= to use it)"
            )
    if not fields & set(one_of):
        wanted = " or ".join(f"{{{f}}}" for f in one_of)
        raise ValueError(f"node {node!r}: template {template!r} must contain {wanted}")
    return frozenset(fields)


def fill_template(
    node: str,
    template: str,
    fields: frozenset[str],
    texts: Sequence[str],
    meta: Sequence[Any],
    prompts: Sequence[str] | None,
) -> list[str]:
    """``template`` filled per sample with its prompt, response and meta values.

    Raises a ValueError naming the sample when the template reads ``{prompt}`` and no prompts
    were given, or a meta key the sample's row does not have.
    """
    if "prompt" in fields and prompts is None:
        raise ValueError(
            f"node {node!r}: template {template!r} reads {{prompt}} but no prompts were given; "
            "wire prompts= (the data's prompts) into this node"
        )
    keys = sorted(fields - {"prompt", "response"})
    out = []
    for i, text in enumerate(texts):
        row = meta[i] if meta[i] is not None else {}
        values: dict[str, Any] = {"response": text, "prompt": prompts[i] if prompts else ""}
        for key in keys:
            if not isinstance(row, Mapping) or key not in row:
                found = sorted(row) if isinstance(row, Mapping) else type(row).__name__
                raise ValueError(
                    f"node {node!r}: sample {i}: meta has no {key!r} (it has {found}); the "
                    f"template reads {{{key}}}"
                )
            values[key] = row[key]
        out.append(template.format(**values))
    return out


# ---------------------------------------------------------------------------------------------
# the shared base
# ---------------------------------------------------------------------------------------------


class RewardNode(Node):
    """Base of the reward nodes: input checks, bad-score policy and token rewards.

    A subclass implements :meth:`score_samples`, returning B raw scores (a list of numbers or
    dicts, or a tensor); this class turns them into ``scores`` float32[B].
    """

    kind = "reward"
    batch_policy = BatchPolicy(max_batch_size=256)
    """Scores are per sample: a call may take any part of a batch (split, or fed per piece of a
    streaming rollout)."""
    inputs = {
        "texts": Port(ANY, doc="list[str]: the B decoded responses"),
        "meta": Port(ANY, required=False, doc="list[dict]: per-sample metadata (e.g. answer)"),
        "prompts": Port(ANY, required=False, doc="list[str]: the B prompts"),
        "images": Port(ANY, required=False, doc="list[PIL.Image.Image]: the B images"),
        "response_mask": Port(Tensor("float32", "B", "R"), required=False),
    }
    outputs = {"scores": Tensor("float32", "B")}
    needs_prompts: bool = False
    """Whether the node reads ``prompts`` (a graph wires ``prompts=`` only when True)."""
    needs_images: bool = False
    """Whether the node reads ``images`` (a graph wires ``images=`` only when True)."""
    reads_meta: frozenset[str] = frozenset()
    """The data row's keys the node reads from ``meta`` (a template's ``{answer}``, a rule's
    declared keys), so that a graph can check the data has them before a step."""

    def __init__(
        self,
        *,
        token_level: bool = False,
        on_bad_sample: str = "raise",
        emit_bad_mask: bool = False,
        name: str | None = None,
        device: str = "cpu",
    ) -> None:
        if on_bad_sample not in _BAD_POLICIES:
            raise ValueError(f"on_bad_sample must be one of {_BAD_POLICIES}, got {on_bad_sample!r}")
        super().__init__(name=name)
        self.token_level = token_level
        self.on_bad_sample = on_bad_sample
        self.emit_bad_mask = emit_bad_mask
        self.device = torch.device(device)
        self.last_bad_count = 0
        self.total_bad_count = 0
        if token_level:
            self.inputs["response_mask"] = Port(Tensor("float32", "B", "R"), required=True)
            self.outputs["token_rewards"] = Port(Tensor("float32", "B", "R"))
        if emit_bad_mask:
            self.outputs["bad_samples"] = Port(Tensor("bool", "B"))

    def _set_template(self, template: str, meta_keys: Sequence[str], **one_of: Any) -> None:
        """Keep ``template``, checked by :func:`template_fields`, its placeholders (``fields``),
        the meta keys it reads and whether it reads ``{prompt}``."""
        self.template = template
        self.fields = template_fields(self.name, template, tuple(meta_keys), **one_of)
        self.reads_meta = self.fields - {"prompt", "response"}
        self.needs_prompts = "prompt" in self.fields

    def _fill(self, texts: Sequence[str], meta: Sequence[Any], prompts: Any) -> list[str]:
        """:func:`fill_template` of the node's template for each sample."""
        return fill_template(self.name, self.template, self.fields, texts, meta, prompts)

    def score_samples(
        self,
        texts: list[str],
        meta: list[dict[str, Any]],
        prompts: list[str] | None,
        images: list[Any] | None,
    ) -> Sequence[Any] | torch.Tensor:
        """B raw scores: numbers, dicts ``{"score": x, ...}``, or a (B,) tensor."""
        raise NotImplementedError

    def forward(self, texts, meta=None, prompts=None, images=None, response_mask=None):
        texts = _check_list(self.name, "texts", texts, None)
        n = len(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise ValueError(
                    f"node {self.name!r}: texts[{i}] is a {type(t).__name__}; texts must be strings"
                )
        meta = [{} for _ in range(n)] if meta is None else _check_list(self.name, "meta", meta, n)
        prompts = None if prompts is None else _check_list(self.name, "prompts", prompts, n)
        images = None if images is None else _check_list(self.name, "images", images, n)
        if response_mask is not None and response_mask.shape[0] != n:
            raise ValueError(
                f"node {self.name!r}: response_mask has {response_mask.shape[0]} rows but texts "
                f"has {n} samples"
            )
        raw = self.score_samples(texts, meta, prompts, images)
        return self._finish(raw, n, response_mask)

    # --- raw scores -> outputs ----------------------------------------------------------------
    def scorer(self) -> str:
        """What made the scores, for messages about a bad one: ``" from reward function
        m:f"`` for a user's function; empty for a model the node runs itself."""
        return ""

    def _bad(self, i: int, what: str, value: Any) -> None:
        if self.on_bad_sample == "raise":
            shown = repr(value)
            shown = shown if len(shown) <= 80 else shown[:76] + " ..."
            raise UsageError(
                f"node {self.name!r}: sample {i} got {what} {shown}{self.scorer()}; a reward "
                "must be a finite number (or a dict {'score': x, ...}). Fix the reward, or pass "
                "on_bad_sample='skip' to score such samples 0 and count them"
            )

    def _failed(self, i: int, failure: CallFailure) -> None:
        """A call that gave no score (it raised, or ran out of time, after its retries): a
        bad sample; under ``raise`` an error naming the sample and why."""
        if self.on_bad_sample == "raise":
            message = (
                f"node {self.name!r}: sample {i} got no score{self.scorer()}: {failure.reason}. "
                "Fix the reward, or pass on_bad_sample='skip' to score such samples 0 and count "
                "them"
            )
            if failure.user_error:
                raise UsageError(message)
            raise ValueError(message) from failure.error

    def _finish(self, raw: Any, n: int, response_mask: torch.Tensor | None) -> dict[str, Any]:
        if isinstance(raw, torch.Tensor):
            values: list[Any] = raw.detach().float().cpu().reshape(-1).tolist()
        else:
            values = list(raw)
        if len(values) != n:
            raise ValueError(f"node {self.name!r}: produced {len(values)} scores for {n} samples")
        scores = torch.zeros(n, dtype=torch.float32)  # (B,)
        bad = torch.zeros(n, dtype=torch.bool)  # (B,)
        token_rows: dict[int, list[float]] = {}
        for i, value in enumerate(values):
            per_token = None
            if isinstance(value, CallFailure):
                self._failed(i, value)
                bad[i] = True
                continue
            if isinstance(value, Mapping):
                if "score" not in value:
                    self._bad(i, f"a dict without 'score' (keys {sorted(map(str, value))})", value)
                    bad[i] = True
                    continue
                per_token = value.get("token_rewards")
                value = value["score"]
            number = _as_number(value)
            if number is None:
                self._bad(i, f"a non-numeric score ({type(value).__name__})", value)
                bad[i] = True
                continue
            if not _fits(number):
                what = (
                    "a non-finite score" if not math.isfinite(number) else "a score beyond float32"
                )
                self._bad(i, what, number)
                bad[i] = True
                continue
            if per_token is not None and self.token_level:
                row = [_as_number(v) for v in per_token]
                broken = [v for v in row if v is None or not _fits(v)]
                if broken:
                    self._bad(i, "a non-finite or non-numeric token reward", broken[0])
                    bad[i] = True
                    continue
                token_rows[i] = row
            scores[i] = number
        self._count(bad)
        out: dict[str, Any] = {"scores": scores}
        if self.token_level:
            out["token_rewards"] = self._token_rewards(scores, response_mask, token_rows)
        if self.emit_bad_mask:
            out["bad_samples"] = bad
        return out

    def _count(self, bad: torch.Tensor) -> None:
        self.last_bad_count = int(bad.sum())
        self.total_bad_count += self.last_bad_count
        if self.last_bad_count:
            where = bad.nonzero().reshape(-1).tolist()
            log.warning(
                "node %r: %d sample(s) had no usable reward (NaN/inf/non-numeric, or the call "
                "failed) and were scored 0: %s",
                self.name,
                self.last_bad_count,
                where[:20],
            )

    def _token_rewards(
        self, scores: torch.Tensor, mask: torch.Tensor, rows: dict[int, list[float]]
    ) -> torch.Tensor:
        try:
            out = place_on_last_token(scores, mask.cpu())  # (B, R)
        except ValueError as exc:
            raise ValueError(f"node {self.name!r}: {exc}") from exc
        for i, row in rows.items():
            real = (mask[i] != 0).nonzero().reshape(-1).cpu()  # (L,) positions of real tokens
            if len(row) != len(real):
                raise ValueError(
                    f"node {self.name!r}: sample {i} returned {len(row)} token rewards but its "
                    f"response_mask has {len(real)} real tokens; give one per real token"
                )
            out[i].zero_()
            out[i, real] = torch.tensor(row, dtype=torch.float32)
        return out
