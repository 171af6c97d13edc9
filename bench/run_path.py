"""The project files a ``yatt-graph run`` calls into before its first node call.

    python -m bench.run_path [--files] -- run mm_ppo --steps 1 --quiet

Traces the command in this process (``sys.setprofile``) and lists, for ``runtime/``,
``graphs/`` and ``yatt_graph/``, every file one of whose functions ran before the first
``Node.run`` or ``Node.run_stream`` an executor makes, leaving out calls made while a module is imported. Also
prints the number of hops (calls from one project file into another) on that path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("runtime", "graphs", "yatt_graph")


class _FirstNodeCall(BaseException):
    """Raised from the profiler at the first node call, to end the traced command there."""


def trace(argv: list[str]) -> tuple[list[str], int]:
    """The project files called before the first node call of ``yatt-graph ARGV``, in order of
    first call, and the number of calls that crossed from one of them into another."""
    from runtime.cli import main
    from yatt_graph.node import Node

    stops = {Node.run.__code__, Node.run_stream.__code__}
    files: dict[str, None] = {}
    hops = 0

    known: dict[str, str | None] = {}  # a file name -> its layer file, resolved once

    def layer_file(code) -> str | None:
        name = code.co_filename
        if name not in known:
            try:
                rel = Path(name).resolve().relative_to(ROOT)
            except ValueError:
                known[name] = None
            else:
                known[name] = str(rel) if rel.parts[0] in LAYERS else None
        return known[name]

    def importing(frame) -> bool:
        while frame is not None and frame.f_code is not trace.__code__:
            if frame.f_code.co_name == "<module>":
                return True
            frame = frame.f_back
        return False

    def stepping(frame) -> bool:
        """Whether a node call is the training's (made by the executor), not a check's."""
        while frame is not None:
            if Path(frame.f_code.co_filename).parent.name in ("engine", "sched"):
                return True
            frame = frame.f_back
        return False

    def profile(frame, event, arg):  # noqa: ARG001
        nonlocal hops
        if event != "call":
            return
        if frame.f_code in stops and stepping(frame):
            raise _FirstNodeCall
        here = layer_file(frame.f_code)
        if here is None or importing(frame):
            return
        files.setdefault(here)
        caller = frame.f_back
        while caller is not None and layer_file(caller.f_code) is None:
            caller = caller.f_back
        if caller is not None and layer_file(caller.f_code) != here:
            hops += 1

    sys.setprofile(profile)
    try:
        main(argv)
    except _FirstNodeCall:
        pass
    finally:
        sys.setprofile(None)
    return list(files), hops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", action="store_true", help="list the files too")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    argv = [w for w in args.command if w != "--"] or ["run", "mm_ppo", "--steps", "1", "--quiet"]
    files, hops = trace(argv)
    if args.files:
        print("\n".join(files))
    print(
        f"{len(files)} files, {hops} hops before the first node call of yatt-graph {' '.join(argv)}"
    )


if __name__ == "__main__":
    main()
