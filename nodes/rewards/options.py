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

The CLIP rewards score the response text itself (e.g. a caption, or an answer such as "red")
against the sample's image, so they are high when the response names what the image shows.

With ``on_bad_sample="skip"`` every node is built with ``emit_bad_mask=True``: it has a second
output, ``bad_samples`` bool[B], so that a graph can always unpack ``scores, skipped``.
The prefixes ``clip``, ``model:`` and ``judge:`` win over a rule reference of the same module name.
"""

from __future__ import annotations

from typing import Any

from nodes.rewards.base import RewardNode
from nodes.rewards.clip import TINY_CLIP_REWARD_CFG, ClipScoreReward
from nodes.rewards.judge import JudgeReward
from nodes.rewards.models import RewardModel
from nodes.rewards.rules import RuleReward

__all__ = ["SPELLINGS", "reward_from_option"]

SPELLINGS = (
    "module:function or path/file.py:function (a rule fn(text, meta) -> float)",
    "clip (a tiny random CLIP score of the response against the image)",
    "clip:open_clip:NAME[:WEIGHTS_FILE] (an open_clip model; weights: a local file)",
    "model:DIR (a local sequence classifier with one logit)",
    "judge:DIR or judge:tiny (a local causal LM or VLM judge, or a tiny random one)",
)


def _bad(value: str, why: str) -> ValueError:
    listed = "\n  ".join(SPELLINGS)
    return ValueError(f"reward {value!r}: {why}. The spellings are:\n  {listed}")


def reward_from_option(
    value: str, *, on_bad_sample: str = "raise", name: str = "reward"
) -> RewardNode:
    """The reward node that the option string ``value`` names (see the module's table).

    Args:
        value: one of the spellings above.
        on_bad_sample: ``"raise"`` or ``"skip"`` (then the node also outputs ``bad_samples``).
        name: the node's name in the graph.

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
    common: dict[str, Any] = {
        "on_bad_sample": on_bad_sample,
        "emit_bad_mask": on_bad_sample == "skip",
        "name": name,
    }
    kind, _, rest = value.partition(":")
    if value == "clip":
        return ClipScoreReward("ViT-S-32", model_overrides=TINY_CLIP_REWARD_CFG, **common)
    if kind == "clip":
        backend, _, model = rest.partition(":")
        arch, _, weights = model.partition(":")
        if backend != "open_clip" or not arch:
            raise _bad(value, "a CLIP reward is 'clip' or 'clip:open_clip:NAME[:WEIGHTS_FILE]'")
        return ClipScoreReward(arch, weights or None, **common)
    if kind in ("model", "judge"):
        if not rest:
            raise _bad(value, f"{kind}: needs a directory after the colon")
        if kind == "model":
            return RewardModel(rest, **common)
        return JudgeReward(rest, **common)
    if not rest or not kind:
        raise _bad(value, "is not a known spelling")
    try:
        return RuleReward(value, **common)
    except (ImportError, ValueError) as exc:
        raise _bad(value, f"the rule reference does not import ({exc})") from exc
