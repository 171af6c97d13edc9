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

from runtime.sched.threads import openmp_env
from runtime.zmq import STARTUP_TIMEOUT_S
from runtime.zmq.transport import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["add_arguments", "main", "serve"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The controller's flags, for ``python -m runtime.zmq.controller_main`` and
    ``yatt-graph controller`` alike (the ones a driver passes to its own are hidden)."""
    p.add_argument(
        "--connect", required=True, help="the driver's address, ipc://PATH or tcp://HOST:PORT"
    )
    p.add_argument(
        "--index", type=int, default=-1, help="controller index (default: the driver assigns one)"
    )
    p.add_argument("--bind", default=None, help="address of this controller's data socket")
    p.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help=argparse.SUPPRESS,  # exit when this process is no longer the parent
    )
    p.add_argument(
        "--spawned",
        action="store_true",
        help=argparse.SUPPRESS,  # started by a local driver: ignore Ctrl-C (it stops us)
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=STARTUP_TIMEOUT_S,
        help=f"seconds to wait for the driver's SETUP (default {STARTUP_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--keys", default=None, metavar="DIR", help="CURVE keys from `yatt-graph keys DIR`"
    )
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="let the data socket listen on a non-loopback interface (a driver on another host)",
    )
    p.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help=argparse.SUPPRESS,  # import this module or file while waiting for the driver
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help=argparse.SUPPRESS,  # largest data frame from peers until the driver's limit is known
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="yatt-graph controller", description="run one controller of a ZeroMQ run"
    )
    add_arguments(p)
    return serve(p.parse_args(argv))


def serve(args: argparse.Namespace) -> int:
    """Run one controller from its parsed flags; exits the process when it is done."""
    # Before torch (and its OpenMP) loads: the wait policy the driver chose for the run
    # (runtime.sched.threads); a controller started by hand without one sleeps.
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
