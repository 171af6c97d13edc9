"""The teacher of on-policy distillation: a frozen model's logprobs of the student's own
sampled responses (:class:`TeacherLogprobs`), and the check that it reads the student's token
ids as the student does (:func:`tokenizer_problem`).

The update turns them into the per-token reverse KL ``log pi_student(t) - log pi_teacher(t)``
(:mod:`nodes.update`): a loss term, or a dense term of the advantages.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nodes.reference import ReferenceLogprobs
from yatt_graph import Tensor as TensorPort

__all__ = ["TeacherLogprobs", "spec_tokenizer", "tokenizer_problem"]


class TeacherLogprobs(ReferenceLogprobs):
    """``teacher_logprobs: float32[B, R]``: a frozen teacher model's logprobs of the rollout's
    responses (0 at padding), teacher-forced as the reference scores them.

    It is the reference's scorer on another model: the same inputs, token budget
    (``micro_batch_tokens``), precision, memory plan, offload and replicas (its kind is the
    reference's, so placement moves it as it moves the reference). It never shares the
    policy's module: a teacher is a model of its own.

    Args:
        teacher: a :func:`nodes.models.policy.build_policy` spec (a local model folder); its
            tokenizer must be the policy's (:func:`tokenizer_problem`).
        temperature: the temperature the rollout sampled at (logprobs of ``logits / T``).
        options: ``device``, ``micro_batch_tokens``, ``precision``, ``name``, ... as the
            reference takes them, except ``share``.
    """

    outputs = {"teacher_logprobs": TensorPort("float32", "B", "R")}  # noqa: RUF012

    def __init__(
        self, teacher: str | Mapping[str, Any], temperature: float = 1.0, **options: Any
    ) -> None:
        if options.get("share") is not None:
            raise ValueError(
                f"TeacherLogprobs: share={options['share']!r}; a teacher holds its own model "
                "(leave share out)"
            )
        if "model" in options:
            raise ValueError("TeacherLogprobs: takes a model spec (teacher=), not a live model")
        super().__init__(teacher, temperature, **options)


def spec_tokenizer(spec: str | Mapping[str, Any]) -> Any:
    """The tokenizer a :func:`~nodes.models.policy.build_policy` spec's policy holds: read from
    a model folder's files (no weights load), or, for a model built in code (tiny), its own."""
    from nodes.models.families import model_family
    from nodes.models.files import _load_tokenizer
    from nodes.models.policy import _spec_dict, build_policy

    kwargs = _spec_dict(spec)
    if "path" not in kwargs:
        return build_policy(spec).tokenizer
    path = Path(kwargs["path"])
    return _load_tokenizer(path / "lm" if model_family(path) == "prefix-vlm" else path)


def tokenizer_problem(student: Any, teacher: Any) -> str | None:
    """Why ``teacher`` cannot score ``student``'s token ids as the same tokens (a differing
    vocabulary, token id or end token), or None when it can."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: (kv[1], kv[0]))
        token = differ[0][0]
        return (
            f"the policy's vocabulary has {len(mine)} tokens and the teacher's {len(theirs)}; "
            f"token {token!r} is id {mine.get(token)} to the policy and "
            f"{theirs.get(token)} to the teacher"
        )
    if student.eos_token_id != teacher.eos_token_id:
        return (
            f"the policy's end token is id {student.eos_token_id} and the teacher's "
            f"{teacher.eos_token_id}"
        )
    return None
