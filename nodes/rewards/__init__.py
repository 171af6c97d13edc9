"""Reward nodes: rule functions, a learned reward model, CLIP image-text score, an LLM judge.

All of them take the data conventions' reward inputs and give one score per sample::

    in:  texts list[str] (B responses), meta list[dict]?, prompts list[str]?, images list[PIL]?,
         response_mask float32[B, R]?
    out: scores float32[B]
         token_rewards float32[B, R]    only with token_level=True (then response_mask is required)
         bad_samples bool[B]            only with emit_bad_mask=True

Bad scores. A score that is NaN, inf or not a number at all is refused: ``ValueError`` naming
the node, the sample index and the value. With ``on_bad_sample="skip"`` such a sample scores 0
instead, and the node reports how many it replaced: ``node.last_bad_count`` (last call) and
``node.total_bad_count`` (since construction) in this process, a ``logging`` warning naming the
indices, and, where the count has to travel through a graph, the optional ``bad_samples`` output
(True where a score was replaced), enabled with ``emit_bad_mask=True``.

Token rewards. With ``token_level=True`` a sequence score is placed on the last real token of
``response_mask`` (:func:`place_on_last_token`); a rule may instead return its own per-token
rewards (``{"score": s, "token_rewards": [...]}``, one per real response token).

Which inputs a node reads beyond ``texts`` and ``meta`` its class attributes say:
``needs_prompts`` (RewardModel and JudgeReward, when their template has ``{prompt}``) and
``needs_images`` (ClipScoreReward; JudgeReward of a VLM directory); a graph wires ``prompts=`` /
``images=`` by them. Templates (judge, reward model, CLIP) may use ``{prompt}``, ``{response}``
and the meta keys named in ``meta_keys`` (``{answer}`` by default); any other placeholder is a
``ValueError`` when the node is declared. :func:`reward_from_option` builds a node from the
CLI's spellings (``module:function``, ``clip``, ``model:DIR``, ``judge:DIR``,
``http://HOST:PORT/PATH``).

Slow rewards. A rule may be an ``async def`` and may declare how its calls run,
``@reward(concurrency=16, timeout_s=10, retries=2)`` (:mod:`nodes.rewards.calls`): calls run
at once in threads (a ``def``) or on an event loop (an ``async def``), each try within its time
limit, and the scores keep the samples' order. A call that still raises or runs out of time
after its retries is a bad sample as above (``on_bad_sample``: raise names the sample and why;
skip scores 0 and counts it). ``http://HOST:PORT/PATH`` scores by posting each sample to a
server (:mod:`nodes.rewards.http`, which documents the JSON it sends and reads).

Nothing here downloads: models come from a local path or are built from a config in code.
"""

from nodes.rewards.base import RewardNode, place_on_last_token
from nodes.rewards.calls import CallPolicy, SampleError, reward
from nodes.rewards.clip import ClipScoreReward, clip_score
from nodes.rewards.judge import JudgeReward
from nodes.rewards.models import RewardModel
from nodes.rewards.options import reward_from_option
from nodes.rewards.remote import HttpReward
from nodes.rewards.rules import RuleReward, contains_answer, exact_match, regex_format

__all__ = [
    "CallPolicy",
    "ClipScoreReward",
    "HttpReward",
    "JudgeReward",
    "RewardModel",
    "RewardNode",
    "RuleReward",
    "SampleError",
    "clip_score",
    "contains_answer",
    "exact_match",
    "place_on_last_token",
    "regex_format",
    "reward",
    "reward_from_option",
]
