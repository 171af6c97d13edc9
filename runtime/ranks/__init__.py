"""A node as an SPMD group of K ranks: how the runtime runs a node whose ``ranks`` is above 1.

:mod:`runtime.ranks.group` starts and supervises the ranks and carries a call's values to
them (in the frames of :mod:`runtime.codec`), :mod:`runtime.ranks.worker` is a rank's process
and :mod:`runtime.ranks.sharding` shards the node's models (FSDP2 or DDP).
"""
