"""A model node's side of its rank group (``node.rank_group``, started by ``runtime.ranks``).

* :func:`join_group`: the device of this rank (one GPU per rank of a host, on CUDA).
* :func:`score_over_ranks`: a forward without gradients over a batch, each rank scoring a
  share of it through a model sharded over the group (a reference beside its update): every
  rank gets the whole batch, takes its share of the units by token cost
  (:func:`yatt_graph.partition.lpt`, a pure function, so every rank cuts alike), scores it in
  parts within the node's token budget, runs *filler* forwards until it has run as many as
  the rank with the most (each forward of an FSDP2 model all-gathers its weights, a
  collective every rank must join), and the scores are summed over the ranks: each row is
  written by one rank and is 0 on the others, so the sum is that rank's score exactly.

This module starts no process and imports no torch.distributed: the group does both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from nodes.batches import View, token_budget_parts
from yatt_graph.partition import lpt

__all__ = ["join_group", "score_over_ranks"]


def join_group(where: str, group: Any, ranks: int, device: torch.device) -> torch.device:
    """This process's side of the group the executor started (``rank_group``) set to compute
    on this rank's device, which is returned: on CUDA, one GPU per rank of a host from
    ``device`` on."""
    if group is None:
        raise ValueError(
            f"{where}: ranks={ranks} runs as a group of processes, which an executor starts "
            "(runtime.ranks.start_groups, before setup()): run the node in LocalExecutor, "
            "ZmqExecutor or yatt-graph run"
        )
    if device.type == "cuda":
        index = (device.index or 0) + group.local_rank  # one GPU per rank of this host
        if torch.cuda.device_count() <= index:
            raise ValueError(
                f"{where}: rank {group.rank} of ranks={ranks} on {device} needs GPU {index} "
                f"(one per rank of a host, from {device} on); torch sees "
                f"{torch.cuda.device_count()}"
            )
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    group.set_device(device)
    return device


Score = Callable[..., Tensor]
"""``fn(prompt_ids, prompt_mask, response_ids, response_mask, image_embeds, images)`` ->
float[b, R'] for the b rows given."""


def score_over_ranks(
    fn: Score, group: Any, budget: int, view: View, rows: int, width: int
) -> Tensor:
    """``fn`` over the ``rows`` x ``width`` batch ``view`` (its ``real`` the tokens a forward
    reads), this rank scoring its share (see the module doc): float32[rows, width] on the
    group's device, the same on every rank."""
    g = view.group
    costs = view.real.reshape(rows // g, -1).sum(1).tolist() if rows else []  # per unit
    shares = lpt(costs, group.world) if costs else [[] for _ in range(group.world)]
    cuts = [_parts(view, share, budget) for share in shares]
    out = torch.zeros(rows, width, dtype=torch.float32, device=group.device)  # (B, R)
    for units in cuts[group.rank]:
        got = _score(fn, view.take(units).trimmed())  # (b, R')
        index = torch.tensor([u * g + j for u in units for j in range(g)], device=out.device)
        out[index, : got.shape[1]] = got.float().to(out.device)
    for _ in range(max(map(len, cuts)) - len(cuts[group.rank])):
        _score(fn, view.take([0]).trimmed())  # a filler: its weights' all-gathers, no rows
    return group.sum_into(out)


def _parts(view: View, share: Sequence[int], budget: int) -> list[list[int]]:
    """The units of ``share`` (units of ``view``) in the parts one forward each takes."""
    if not share:
        return []
    if not budget:
        return [list(share)]
    return [[share[i] for i in part] for part in token_budget_parts(view.take(share), budget)]


def _score(fn: Score, part: View) -> Tensor:
    t = part.t
    return fn(t["prompt_ids"], t["prompt_mask"], t["response_ids"], t["response_mask"],
              part.image_embeds, part.images)  # fmt: skip
