"""The controller process's entry point: ``python -m runtime.zmq.controller_main``.

python -m runtime.zmq.controller_main --connect ipc:///tmp/yatt-x/driver   # started by the driver
yatt-graph controller --connect tcp://HOST:PORT                        # joining from another host
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence

from runtime.flags import add_controller_arguments
from runtime.sched.devices import openmp_env

__all__ = ["main", "serve"]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="yatt-graph controller", description="run one controller of a ZeroMQ run"
    )
    add_controller_arguments(p)
    return serve(p.parse_args(argv))


def serve(args: argparse.Namespace) -> int:
    """Run one controller from its parsed flags; exits the process when it is done."""
    # Before torch (and its OpenMP) loads: the wait policy the driver chose for the run
    # (runtime.sched.devices); a controller started by hand without one sleeps.
    os.environ.update(openmp_env(os.environ, spin=None))
    if args.spawned:
        # Ctrl-C in a terminal reaches the whole process group; the driver shuts us down.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.WARNING, format=f"yatt-graph controller (pid {os.getpid()}): %(message)s"
    )
    from runtime.zmq.controller import Controller

    try:
        controller = Controller(
            args.connect,
            args.index,
            args.bind,
            args.parent_pid,
            args.startup_timeout,
            keys=args.keys,
            allow_remote=args.allow_remote,
            max_message_bytes=args.max_message_bytes,
            preload=tuple(args.preload),
        )
    except ValueError as exc:  # refused address or keys: say why, no traceback
        print(f"yatt-graph controller: error: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)
    try:
        code = controller.serve()
    except KeyboardInterrupt:
        code = 130
    # Everything is closed; skip interpreter teardown (torch's can take most of a second).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
