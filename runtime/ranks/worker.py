"""A rank of a node's group: ``python -m runtime.ranks.worker`` (started for rank 0).

It connects to rank 0's store, rebuilds the group's nodes from the specs rank 0 left there
(one node, or several that share the group: a reference sharded beside its update), gives
each its side of the group (``node.rank_group``), builds them in that order (the first joins
the group there), and then runs each operation rank 0 runs
(:func:`runtime.ranks.group.serve`) until rank 0 says close or is gone (:func:`runtime.children.exit_with_parent`). If its build or the group
fails, it leaves the error in the store for rank 0 to name, and exits with code 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.ranks.worker", description=__doc__)
    p.add_argument("--store", required=True, help="HOST:PORT of the group's TCPStore")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--local-rank", type=int, default=0, help="its index on this host (its GPU)")
    p.add_argument("--hosts", default="", help="every rank's host, comma-separated (hsdp's mesh)")
    p.add_argument("--parent-pid", type=int, required=True, help="exit when this process is gone")
    p.add_argument("--timeout", type=float, required=True, help="store and collective timeout, s")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which closes us
    from runtime.children import exit_with_parent

    exit_with_parent(args.parent_pid, f"yatt-graph rank {args.rank} (pid {os.getpid()})")
    import msgspec
    import torch

    from runtime.ranks.group import RankLink, leave_group, serve
    from yatt_graph.serialize import NodeSpec, build_node

    torch.set_num_threads(max(1, args.threads))
    hosts = [h for h in args.hosts.split(",") if h]
    link = RankLink(args.store, args.rank, args.world, args.timeout, args.local_rank, hosts)
    code = 0
    try:
        specs = msgspec.json.decode(link.node_specs(), type=list[NodeSpec])
        nodes = [build_node(spec) for spec in specs]
        link.members = {node.name: node for node in nodes}
        for node in nodes:
            node.rank_group = link
            node.setup()
        serve(link)
    except Exception as exc:
        link.report(f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        code = 1
    finally:
        leave_group(clean=code == 0)  # a failed rank aborts: its peers may be gone
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: torch's can take most of a second


if __name__ == "__main__":
    sys.exit(main())
