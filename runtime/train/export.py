"""Export a trained policy: from a finished run's graph, or later from a checkpoint.

``yatt-graph run --export DIR`` saves the policy of the graph's update node with
``save_pretrained``; ``yatt-graph export CHECKPOINT DIR`` rebuilds the graph recorded in the
checkpoint's ``meta.json`` (its module or file and its ``build_graph`` options), checks that
it is the graph the checkpoint was written by, and saves the policy from the checkpoint's
state (the update node's ``save_policy``: never through a model sharded across ranks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.train.checkpoint import CheckpointError, find_checkpoint, load_checkpoint
from yatt_graph import UsageError
from yatt_graph.options import (
    UnknownOptionError,
    check_options,
    did_you_mean,
    load_graph_module,
    module_options,
)
from yatt_graph.serialize import graph_identity, identity_differences

__all__ = ["export_checkpoint", "export_policy", "policy_node"]


def policy_node(graph: Any) -> str:
    """The update node whose policy ``--export`` saves (one with ``save_policy``, which builds
    nothing to say so); a UsageError when there is none."""
    for name, node in graph.nodes.items():
        if node.kind == "update" and callable(getattr(node, "save_policy", None)):
            return name
    raise UsageError(
        f"--export: graph {graph.name!r} has no update node holding a policy with "
        "save_pretrained(); run it without --export"
    )


def export_policy(graph: Any, path: Path, state: dict[str, Any]) -> str:
    """Save the trained policy of the graph's update node with ``save_pretrained``, from an
    executor's ``state_dict()`` (in-process or ZeroMQ, trained alone or as K ranks)."""
    name = policy_node(graph)
    graph.nodes[name].save_policy(path, state["nodes"][name])
    return name


def export_checkpoint(source: str | Path, path: Path) -> tuple[Path, str]:
    """Rebuild the graph a checkpoint records, load it, export its policy to ``path``;
    returns (the checkpoint used, the node exported)."""
    from yatt_graph.refs import load_graph

    checkpoint, meta = find_checkpoint(source)
    ref, options = meta.get("graph_ref"), meta.get("graph_options", {})
    if not isinstance(ref, str) or not isinstance(options, dict):
        raise CheckpointError(
            f"{checkpoint / 'meta.json'} does not record its graph (written by an older "
            "yatt-graph, or not by `yatt-graph run`); load it with the graph in Python "
            "(runtime.train.checkpoint.load_checkpoint) and call save_pretrained"
        )
    try:  # the options it records, against those the graph takes today
        check_options(options, *module_options(load_graph_module(ref)), ref)
    except UnknownOptionError as exc:
        raise CheckpointError(
            f"{checkpoint / 'meta.json'} records the option {exc.key!r}={options[exc.key]!r} for "
            f"{ref}, which takes no such option today{did_you_mean(exc.near)}; rename it in the "
            "file's graph_options if the option was renamed, or export with the version of the "
            "graph that wrote the checkpoint"
        ) from None
    except TypeError as exc:  # a value of a type the option no longer takes
        raise CheckpointError(f"{checkpoint / 'meta.json'}: {exc}") from None
    graph = load_graph(ref, **options)
    diffs = identity_differences(meta.get("graph"), graph_identity(graph))
    if diffs:
        raise CheckpointError(
            f"{checkpoint}: the graph {ref!r} builds today is not the one that wrote it: "
            + "; ".join(diffs)
        )
    _, state = load_checkpoint(checkpoint)
    return checkpoint, export_policy(graph, path, state)
