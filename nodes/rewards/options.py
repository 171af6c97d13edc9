"""The reward spellings of the CLI and the ready graphs (``--reward``), turned into nodes.

=========================================  ===========================================  ==========
spelling                                   node                                         reads
=========================================  ===========================================  ==========
``module:function``, ``path/f.py:func``    :class:`RuleReward` ``fn(text, meta)``       texts, meta
``clip``                                   :class:`ClipScoreReward`, a tiny random CLIP  texts, images
``clip:open_clip:NAME[:WEIGHTS_FILE]``     :class:`ClipScoreReward` of that model        texts, images
``model:DIR``                              :class:`RewardModel` (a sequence classifier)  texts, prompts
``judge:DIR``, ``judge:tiny``              :class:`JudgeReward` (a causal LM judge)      texts, prompts, meta
=========================================  ===========================================  ==========

The CLIP rewards score the response text itself (``texts``, e.g. a caption or an answer such as
"red") against the sample's image. ``clip`` alone is a tiny random-init tower (for demos and
tests: its scores carry no meaning); a real one is ``clip:open_clip:ViT-B-32:/path/weights.pt``
(a local weights file; without one the named architecture has random weights).

With ``on_bad_sample="skip"`` every node is built with ``emit_bad_mask=True``: it has a second
output, ``bad_samples`` bool[B], so that a graph can always unpack ``scores, skipped``.
The prefixes ``clip``, ``model:`` and ``judge:`` win over a rule reference of the same module name.
"""

from __future__ import annotations

from typing import Any

from nodes.rewards.base import RewardNode
from nodes.rewards.judge import JudgeReward
from nodes.rewards.models import ClipScoreReward, RewardModel
from nodes.rewards.rules import RuleReward

__all__ = ["SPELLINGS", "TINY_CLIP_REWARD_CFG", "reward_from_option"]

SPELLINGS = (
    "module:function or path/file.py:function (a rule fn(text, meta) -> float)",
    "clip (a tiny random CLIP score of the response against the image)",
    "clip:open_clip:NAME[:WEIGHTS_FILE] (an open_clip model; weights: a local file)",
    "model:DIR (a local sequence classifier with one logit)",
    "judge:DIR or judge:tiny (a local causal LM judge, or a tiny random one)",
)

#: open_clip overrides for ``clip``: a test-sized ViT-S-32 whose text tower keeps the built-in
#: tokenizer's vocabulary (49408), so it tokenizes offline.
TINY_CLIP_REWARD_CFG: dict[str, Any] = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


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
