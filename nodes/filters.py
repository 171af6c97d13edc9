"""Dynamic sampling (DAPO): the groups a step can learn from, the others dropped.

A group whose samples all scored the same has zero advantage under every group estimator: it
adds no policy gradient, only tokens to the loss's mean, KL and entropy terms. DAPO draws more
prompts than a step trains on and keeps groups with differing scores until the batch is full.
Here the draw is made up front (the data node draws ``batch_size * (1 + dynamic_sampling)``
prompts, the refill cap) and :class:`KeepGroups` keeps the first ``keep`` informative groups
in order, so the step's work is bounded and known before it starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from yatt_graph import ANY, BatchPolicy, Node, Port, Tensor

__all__ = ["KeepGroups", "ROW_PORTS", "PROMPT_PORTS", "informative_groups"]

ROW_PORTS: dict[str, tuple[str, ...] | None] = {
    "prompt_ids": ("int64", "P"),
    "prompt_mask": ("int64", "P"),
    "response_ids": ("int64", "R"),
    "response_mask": ("float32", "R"),
    "logprobs": ("float32", "R"),
    "rollout_logprobs": ("float32", "R"),
    "response_lengths": ("int64",),
    "truncated": ("float32",),
    "texts": None,
}
"""The per-response ports :class:`KeepGroups` can carry: dtype and the dimensions after the
row (None: any value, one item a row)."""
PROMPT_PORTS: dict[str, tuple[str, ...] | None] = {"image_embeds": ("float32", "D"), "images": None}
"""The per-prompt ports it can carry (one row per group)."""


def informative_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> list[bool]:
    """For each group, in order of first appearance: whether its scores differ."""
    order = list(dict.fromkeys(group_ids.tolist()))
    return [bool((scores[group_ids == g] != scores[group_ids == g][0]).any()) for g in order]


class KeepGroups(Node):
    """The rows of the groups a step can learn from (see the module docstring).

    Inputs: ``scores`` float32[B] and ``group_ids`` int64[B] (a group's rows contiguous, as
    the rollout makes them), plus the ports named in ``rows`` (one row per response) and
    ``prompts`` (one row per group). Outputs: the same ports, with the kept groups' rows, and
    ``stats``: ``drawn_groups``, ``informative_groups`` and ``kept_groups``.
    """

    kind = "filter"
    batch_policy = BatchPolicy(splittable=False)  # a group must stay whole
    inputs = {"scores": Tensor("float32", "B"), "group_ids": Tensor("int64", "B")}  # noqa: RUF012
    outputs = {"scores": Tensor("float32", "K"), "group_ids": Tensor("int64", "K")}  # noqa: RUF012

    def __init__(
        self,
        keep: int,
        rows: Sequence[str] = (),
        prompts: Sequence[str] = (),
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        where = f"node {self.name!r}"
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"{where}: keep={keep!r}; it must be an int >= 1 (groups a step)")
        unknown = sorted({*rows} - set(ROW_PORTS)) + sorted({*prompts} - set(PROMPT_PORTS))
        if unknown:
            raise ValueError(
                f"{where}: it carries no port {unknown}; rows: {sorted(ROW_PORTS)}, prompts: "
                f"{sorted(PROMPT_PORTS)}"
            )
        self.keep, self.rows, self.prompts = keep, list(rows), list(prompts)
        # B rows (N prompts) come in, K rows (M prompts) go out
        for port in self.rows:
            self.inputs[port], self.outputs[port] = _port(ROW_PORTS[port], "B"), _port(ROW_PORTS[port], "K")  # fmt: skip
        for port in self.prompts:
            self.inputs[port], self.outputs[port] = _port(PROMPT_PORTS[port], "N"), _port(PROMPT_PORTS[port], "M")  # fmt: skip
        self.outputs["stats"] = Port(ANY, doc="dict[str, float]")

    def forward(self, scores, group_ids, **carried: Any) -> dict[str, Any]:
        B = len(group_ids)
        order = list(dict.fromkeys(group_ids.tolist()))
        if B % max(len(order), 1):
            raise ValueError(
                f"node {self.name!r}: {B} rows in {len(order)} groups; every group must hold "
                "the same number of rows (the rollout's n)"
            )
        n = B // max(len(order), 1)
        differ = informative_groups(scores, group_ids)
        useful = [i for i, d in enumerate(differ) if d]
        # none differs: the step runs on the first groups and learns nothing (stats say so)
        chosen = useful[: self.keep] if useful else list(range(min(self.keep, len(order))))
        rows = torch.tensor([g * n + j for g in chosen for j in range(n)], dtype=torch.long)
        out: dict[str, Any] = {"scores": scores[rows], "group_ids": group_ids[rows]}
        for port in self.rows:
            out[port] = _take(carried[port], rows)
        for port in self.prompts:
            out[port] = _take(carried[port], torch.tensor(chosen, dtype=torch.long))
        out["stats"] = {
            "drawn_groups": float(len(order)),
            "informative_groups": float(len(useful)),
            "kept_groups": float(len(chosen)),
        }
        return out


def _port(spec: tuple[str, ...] | None, rows: str) -> Port:
    if spec is None:
        return Port(ANY)
    dtype, *dims = spec
    return Port(Tensor(dtype, rows, *dims))


def _take(value: Any, rows: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        return value[rows.to(value.device)]
    return [value[i] for i in rows.tolist()]
