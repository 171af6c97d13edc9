"""The front half every ready graph declares: data, (vision), rollout, reward, reference and
validation (:func:`sample_and_score`), and how its results reach the update and the samples
file (:func:`update_inputs`, :func:`sample_columns`, :func:`connect_weights`). How each
option becomes a node or a spec is :mod:`graphs.common`'s."""

from __future__ import annotations

from typing import Any, NamedTuple

from graphs.common import (
    data_keys,
    data_source,
    is_prefix_policy,
    policy_spec,
    resolve_device,
    rollout_options,
    sampling_options,
    teacher_spec,
    vision_kwargs,
)
from graphs.config import RLConfig
from nodes.reference import ReferenceLogprobs
from nodes.rewards import RewardNode, reward_from_option
from nodes.rollout import Rollout
from nodes.teacher import TeacherLogprobs, spec_tokenizer, tokenizer_problem
from nodes.vision import VisionEncoder
from yatt_graph import Graph, Handle, Node

__all__ = [
    "TOKENS",
    "Sampled",
    "connect_weights",
    "sample_and_score",
    "sample_columns",
    "teacher_logprobs",
    "update_inputs",
]


TOKENS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
"""The rollout's token outputs that the model nodes after it read (``Sampled.tensors``)."""


def _check_meta(source: Node, reward: RewardNode) -> None:
    """The user's data holds the columns the reward reads (the answer, a template's keys)."""
    from nodes.datasets import DatasetSource

    if not isinstance(source, DatasetSource):  # the shapes task has every key
        return
    columns = source.columns
    have = {c for c in columns if c not in (source.prompt_key, source.image_key)}
    have |= {"answer"} if source.answer_key in columns else set()
    missing = sorted(reward.reads_meta - have)
    if missing:
        hint = " pass --set answer_key=<column>, or" if "answer" in missing else ""
        raise ValueError(
            f"{source.file_label}: the reward {type(reward).__name__} reads {missing} of each "
            f"row, and the data has no such column (its columns: {list(columns)});{hint} use a "
            "reward that does not need it"
        )


class Sampled(NamedTuple):
    """The front half every ready graph shares: data, rollout, reward and reference."""

    spec: dict[str, Any]
    """The policy spec, for every node that holds a copy of the policy."""
    device: str
    """Where the model nodes run (``config.device`` resolved)."""
    rollout: Node
    sample: Any
    """The rollout's outputs (``sample.texts``, ``sample.logprobs``, ...)."""
    scores: Handle
    tensors: dict[str, Handle]
    """The rollout's :data:`TOKENS`: what model nodes read."""
    image_port: dict[str, Handle]
    """``image_embeds`` (prefix-VLM), ``images`` (HF VLM) or nothing (text only)."""
    ref_logprobs: Handle | None
    """The reference's logprobs; None when the graph asked for no reference."""
    validation: Node | None
    """The greedy validation node (``config.val_data``), which loads the rollout's weights."""
    drawn_scores: Handle
    """Every sampled response's score (``scores`` holds the kept groups' with dynamic
    sampling): what the run reports as its reward."""
    drawn_group_ids: Handle | None = None
    """Every sampled response's group label where dynamic sampling drops groups (``sample``
    then holds the kept rows); None where ``sample`` holds every sampled response."""
    teacher_logprobs: Handle | None = None
    """The teacher's logprobs of the trained responses; None without ``config.teacher``."""


def sample_and_score(
    g: Graph, config: RLConfig, *, vision: str | None = None, n: int = 1, reference: bool = True
) -> Sampled:
    """Declare data -> (vision) -> rollout -> reward, and the reference logprobs, in ``g``.

    ``vision``: the vision tower (``config.vision`` of a graph with images), or None for a
    text-only graph; ``n``: samples per prompt.
    ``config.stream``: the rollout hands out responses as they end (``Rollout(stream=True)``);
    with one sample per prompt the reward, the reference and the critic then take them piece by
    piece (runtime/engine/streams.py), which overlaps generation when they run on another
    controller (``--placement partial``).
    Weight updates reach the rollout (and the validation) through :func:`connect_weights`.
    """
    text_only = vision is None
    device = resolve_device(config.device)
    source = data_source(config, text_only=text_only)
    data = source()
    if config.data is not None:
        g.output("data", data.stats)
    g.output("data_rows", data.rows)  # each prompt's file and row, for the samples file
    tower: dict[str, Any] = {}
    image_dim = None
    if text_only:
        g.discard(data.images)
        spec, image_port = policy_spec(config, None), {}
    else:
        tower = vision_kwargs(vision, config.seed)
        encoder = VisionEncoder(**tower, device=device, name="vision")
        image_dim = encoder.embed_dim
        spec = policy_spec(config, image_dim)
        prefix = is_prefix_policy(spec)
        image_port = {"image_embeds": encoder(data.images)} if prefix else {"images": data.images}
        g.output("images", data.images)  # thumbnails in the samples file
    rollout = Rollout(policy=spec, n=n, device=device, name="rollout", **rollout_options(config))
    sample = rollout(prompts=data.prompts, **image_port)
    g.output("weight_sync", sample.weight_sync)  # seconds and bytes of the weights it loaded
    if not config.recompute_logprobs:
        g.discard(sample.rollout_logprobs)  # the sampler's logprobs are the ones the update takes
    reward = reward_from_option(
        config.reward, on_bad_sample=config.on_bad_sample, name="reward",
        micro_batch_tokens=config.micro_batch_tokens, device=device,
    )  # fmt: skip
    _check_meta(source, reward)
    extra: dict[str, Handle] = {}
    if getattr(reward, "needs_prompts", False):
        extra["prompts"] = data.prompts
    if getattr(reward, "needs_images", False):
        if text_only:
            raise ValueError(f"reward {config.reward!r} reads images; this graph has none")
        extra["images"] = data.images
    scores = reward(texts=sample.texts, meta=data.meta, **extra)
    if config.on_bad_sample == "skip":  # the reward has a second output: which samples it skipped
        scores, skipped = scores
        g.output("bad_samples", skipped)
    drawn_scores = scores
    g.output("texts", sample.texts)  # with prompts and scores: what a run shows at a glance
    g.output("prompts", data.prompts)
    # per sampled response, as texts: the samples file's length and stop reason
    g.output("response_lengths", sample.response_lengths)
    g.output("truncated", sample.truncated)
    drawn_group_ids = None
    if config.prompts_drawn > config.batch_size:  # dynamic sampling: the informative groups
        drawn_group_ids = sample.group_ids
        sample, scores, image_port = _keep_groups(g, config, sample, scores, image_port)
    tensors = {name: getattr(sample, name) for name in TOKENS}
    ref = None  # no reference where nothing reads it (GRPO without its KL term)
    if reference:
        node = ReferenceLogprobs(
            policy=spec, temperature=config.temperature, device=device, name="reference",
            micro_batch_tokens=config.micro_batch_tokens, precision=config.mixed_precision,
        )  # fmt: skip
        ref = node(**tensors, **image_port)
    teacher = None
    if config.teacher is not None:
        teacher = teacher_logprobs(config, spec, image_dim, device, {**tensors, **image_port})
    validation = None
    if config.val_data is not None:
        validation = _validation(g, config, spec, device, text_only, image_port, tower)
    return Sampled(
        spec, device, rollout, sample, scores, tensors, image_port, ref, validation, drawn_scores,
        drawn_group_ids, teacher,
    )  # fmt: skip


def teacher_logprobs(
    config: RLConfig,
    spec: dict[str, Any],
    image_dim: int | None,
    device: str,
    inputs: dict[str, Handle],
) -> Handle:
    """The teacher's logprobs (:class:`nodes.teacher.TeacherLogprobs` of ``config.teacher``)
    of the responses in ``inputs`` (the rollout's tokens and image input), for the policy of
    ``spec``; a teacher whose tokenizer is not the policy's is refused here, before any step."""
    teacher = teacher_spec(config, image_dim)
    problem = tokenizer_problem(spec_tokenizer(spec), spec_tokenizer(teacher))
    if problem is not None:
        raise ValueError(
            f"option teacher={config.teacher!r}: its tokenizer is not the policy's ({problem}); "
            "the teacher scores the policy's token ids, so give a teacher with the policy's "
            "tokenizer"
        )
    node = TeacherLogprobs(
        teacher, temperature=config.temperature, device=device, name="teacher",
        micro_batch_tokens=config.micro_batch_tokens, precision=config.mixed_precision,
    )  # fmt: skip
    return node(**inputs)


def update_inputs(
    config: RLConfig, s: Sampled, advantages: Handle, **more: Handle | None
) -> dict[str, Handle | None]:
    """What an update reads of the front half: the tensors, the sampled logprobs (and the
    sampler's, where the rollout recomputes them; the teacher's, with a teacher),
    ``advantages``, ``more`` and the images."""
    optional = {"rollout_logprobs": s.sample.rollout_logprobs} if config.recompute_logprobs else {}
    if s.teacher_logprobs is not None:
        optional["teacher_logprobs"] = s.teacher_logprobs
    return {
        **s.tensors, "logprobs": s.sample.logprobs, "truncated": s.sample.truncated, **optional,
        "advantages": advantages, **more, **s.image_port,
    }  # fmt: skip


def sample_columns(g: Graph, config: RLConfig, s: Sampled, advantages: Handle) -> None:
    """The graph output ``sample_stats``: per trained response its advantage, reference KL
    and rollout/trainer logprob gap, and which sampled response it is
    (:class:`nodes.sample_stats.SampleStats`), for the samples file."""
    from nodes.sample_stats import SampleStats

    optional: dict[str, Handle] = {}
    if s.ref_logprobs is not None:
        optional["ref_logprobs"] = s.ref_logprobs
    if config.recompute_logprobs:
        optional["rollout_logprobs"] = s.sample.rollout_logprobs
    if s.drawn_group_ids is not None:
        optional["sampled_group_ids"] = s.drawn_group_ids
    stats = SampleStats(name="sample_stats")(
        response_mask=s.sample.response_mask,
        group_ids=s.sample.group_ids,
        advantages=advantages,
        logprobs=s.sample.logprobs,
        **optional,
    )
    g.output("sample_stats", stats)


def _keep_groups(
    g: Graph, config: RLConfig, sample: Any, scores: Handle, image_port: dict[str, Handle]
) -> tuple[Any, Handle, dict[str, Handle]]:
    """The rollout's rows of the first ``batch_size`` groups whose scores differ
    (:class:`nodes.filters.KeepGroups`), in place of the rollout's outputs."""
    from types import SimpleNamespace

    from nodes.filters import KeepGroups

    rows = [*TOKENS, "logprobs", "truncated"]
    if config.recompute_logprobs:
        rows.append("rollout_logprobs")
    node = KeepGroups(config.batch_size, rows=rows, prompts=list(image_port), name="keep_groups")
    kept = node(scores=scores, group_ids=sample.group_ids, **{r: getattr(sample, r) for r in rows},
                **image_port)  # fmt: skip
    g.output("dynamic_sampling", kept.stats)
    carried = {r: getattr(kept, r) for r in rows} | {"group_ids": kept.group_ids}
    return SimpleNamespace(**carried), kept.scores, {p: getattr(kept, p) for p in image_port}


def _validation(
    g: Graph,
    config: RLConfig,
    spec: dict[str, Any],
    device: str,
    text_only: bool,
    image_port: dict[str, Handle],
    tower: dict[str, Any],
) -> Node:
    from nodes.validation import GreedyValidation

    image_input = "none" if text_only else next(iter(image_port))
    node = GreedyValidation(
        spec,
        config.val_data,
        config.reward,
        batch_size=config.batch_size,
        micro_batch_tokens=config.micro_batch_tokens,
        image_input=image_input,
        vision=tower if image_input == "image_embeds" else None,
        keys=data_keys(config),
        on_bad_sample=config.on_bad_sample,
        device=device,
        name="validation",
        **sampling_options(config, validation=True),
    )
    g.output("val", node())
    return node


def connect_weights(g: Graph, s: Sampled, weights: Handle) -> None:
    """The update's ``weights`` (its versioned snapshot, or, sharing, the live tensors) into
    the rollout (and the validation), one step later."""
    g.connect(weights, s.rollout, "weights", delay=1)
    if s.validation is not None:
        g.connect(weights, s.validation, "weights", delay=1)
