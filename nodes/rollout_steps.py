"""A rollout's calls in order: the seed each samples with, the group labels it gives, the
device its outputs are on, and the pieces of a step that replicas sample
(:mod:`runtime.sched.fanout`).

A call draws from one random stream seeded by the node's ``seed`` and its call count
(``step``), and labels its prompts' groups from ``next_group`` on. A replica's piece of a step
is seeded from the step and its first row instead, so that it samples the same tokens on
whichever replica runs it, and its groups keep the step's labels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from nodes.models.sampling import NotFiniteError
from nodes.seeding import seeded, step_seed
from yatt_graph import UsageError

if TYPE_CHECKING:
    from nodes.rollout import _Call

__all__: list[str] = []  # private helpers of the Rollout (nodes.rollout)


class _Steps:
    """The counters of a rollout's calls and the piece interface of a node (``yatt_graph``'s
    ``piece_context``, ``begin_piece``, ``end_piece``, ``end_pieces``); the Rollout's
    constructor starts the counters."""

    name: str
    seed: int
    n: int
    device: torch.device
    weights_version: int
    step: int
    """Calls so far (the pieces of a step count once): the next call's seed."""
    next_group: int
    """The group label of the next call's first prompt."""
    _piece: tuple[dict[str, int], list[int]] | None
    """While a replica samples a piece: the step's context and the piece's prompt rows."""

    def _call_seed(self, prompts: int) -> int:
        """The seed of this call of ``prompts`` prompts: the step's, or its piece's."""
        if self._piece is None:
            return step_seed(self.seed, self.step)
        ctx, rows = self._piece  # a replica's piece: its own seed, from its first row
        if len(rows) != prompts:
            raise ValueError(
                f"node {self.name!r}: begin_piece was given {len(rows)} rows for {prompts} prompts"
            )
        return step_seed(step_seed(self.seed, ctx["step"]), 1 + rows[0])

    @contextlib.contextmanager
    def _seeded(self, seed: int) -> Iterator[None]:
        """Draw from the global generator seeded with ``seed``; its state is restored after.
        A sampler that meets non-finite probabilities says whose weights are to blame."""
        try:
            with seeded(seed, self.device):
                yield
        except NotFiniteError as exc:
            cause = (
                f"its weights (version {self.weights_version}, the newest the update sent) have "
                "diverged: lower the learning rate or set max_grad_norm, and resume from a "
                "checkpoint written before that version"
                if self.weights_version
                else "its weights as built are not finite: check the model folder"
            )
            raise UsageError(
                f"node {self.name!r}: the policy's next-token probabilities are not finite, so "
                f"it cannot sample; {cause}"
            ) from exc

    def _group_ids(self, rows: Tensor) -> Tensor:
        prompt = rows // self.n  # the prompt of each response row, in this call
        if self._piece is None:
            return self.next_group + prompt
        ctx, piece_rows = self._piece  # prompt i of the piece is prompt piece_rows[i] of the step
        return ctx["next_group"] + torch.tensor(piece_rows, dtype=torch.int64)[prompt]

    def _on_device(self, outputs: dict[str, Any]) -> dict[str, Any]:
        """A call's ``outputs`` with their tensors on the node's device (its readers off that
        device get host copies: ``runtime/engine/tensor_moves.py``)."""
        return {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in outputs.items()}

    def _done(self, call: _Call) -> None:
        if self._piece is None:  # a piece leaves the counters to end_pieces
            self.step += 1
            self.next_group += call.N

    # --- replicas (runtime.sched.fanout) ---------------------------------------------------
    def piece_context(self) -> dict[str, int]:
        """What every replica needs to sample its piece of this step as the step's own: the
        call count (for the seed) and the first group label."""
        return {"step": self.step, "next_group": self.next_group}

    def begin_piece(self, context: Mapping[str, int], rows: Sequence[int]) -> None:
        """The next call is the piece of a step holding prompts ``rows`` (their positions in
        the step's batch): it is seeded from ``context["step"]`` and ``rows[0]``, so a piece
        samples the same tokens on whichever replica runs it, and its ``group_ids`` are the
        step's. :meth:`end_piece` ends the piece."""
        self._piece = ({k: int(v) for k, v in context.items()}, [int(r) for r in rows])

    def end_piece(self) -> None:
        self._piece = None

    def end_pieces(self, context: Mapping[str, int], prompts: int) -> None:
        """All pieces of the step that ``context`` began are in: count it as one call."""
        self.step = int(context["step"]) + 1
        self.next_group = int(context["next_group"]) + int(prompts)
