"""One node's ``yatt-graph run`` under a Ray actor (:mod:`runtime.ray_launch`).

``python -m runtime.ray_node ACTOR_PID run GRAPH ... --nnodes N --node-rank R --master
HOST:PORT`` is the command line the user typed, but for ``--ray``, plus the node's place; it
runs as :func:`runtime.cli.main` does, and exits with its actor (the one liveness rule of
:mod:`runtime.children`): Ray ends an actor with SIGKILL, which its child would outlive.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from runtime.children import exit_with_parent

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    exit_with_parent(int(words[0]), "yatt-graph run (a node of a Ray launch)")
    from runtime.cli import main as run_cli

    return run_cli(words[1:])


if __name__ == "__main__":
    sys.exit(main())
