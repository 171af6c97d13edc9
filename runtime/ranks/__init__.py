"""A node as an SPMD group of K ranks: how the runtime runs a node whose ``ranks`` is above 1.

:mod:`runtime.ranks.group` starts and supervises the ranks and carries a call's values to
them (in the frames of :mod:`runtime.codec`), :mod:`runtime.ranks.worker` is a rank's process
and :mod:`runtime.ranks.sharding` shards the node's models (FSDP2 or DDP).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["start_groups"]


def start_groups(nodes: Mapping[str, Any]) -> list[Any]:
    """Start the group of each node whose ``ranks`` is above 1 and that has none yet, and set
    its ``rank_group``; call it before the nodes' ``setup()``, where each joins its group.
    Returns the groups started, for the caller to ``close()`` when it is done."""
    grouped = [n for n in nodes.values() if n.ranks > 1 and n.rank_group is None]
    if not grouped:
        return []
    from runtime.ranks.group import RankGroup

    for node in grouped:
        node.rank_group = RankGroup.start(node)
    return [node.rank_group for node in grouped]
