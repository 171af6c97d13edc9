"""A replica process's entry point: ``python -m runtime.zmq.replica_main`` (started by
:class:`runtime.zmq.replicas.ReplicaProcess`, never by hand).

It pins itself to its cores, sets its torch threads, connects to its node (at ``--connect``,
or, on another host than its node's, at the address it reads from the node's store:
``--store``, ``--key``, with the run's CURVE keys), rebuilds the node from the NodeSpec it
is sent first, and answers each piece with the node's outputs (or the error, as text), until
it is told to stop or its parent is gone (:func:`runtime.children.exit_with_parent`).
"""

from __future__ import annotations

import argparse
import os
import signal
import traceback
from collections.abc import Sequence

import msgspec
import zmq

from runtime.children import exit_with_parent
from runtime.zmq import messages as m

__all__ = ["FAULT_ENV", "main"]

FAULT_ENV = "YATT_REPLICA_EXIT"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.zmq.replica_main")
    p.add_argument("--connect", default="", help="the node's socket (on this host)")
    p.add_argument("--store", default="", help="HOST:PORT of the node's store (another host)")
    p.add_argument("--key", default="", help="where the store holds the node's address")
    p.add_argument("--host", default="", help="this host's address, when it is another host")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the address")
    p.add_argument("--keys", default="", help="the run's CURVE keys folder")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cores", default="", help="comma-separated CPU ids (default: all)")
    return p


def _pin(cores: str, threads: int) -> None:
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})  # before torch starts threads
    import torch

    torch.set_num_threads(max(1, threads))


def _error(exc: BaseException) -> bytes:
    text = f"{type(exc).__name__}: {exc}\n--- original traceback ---\n{traceback.format_exc()}"
    return m.FROM_REPLICA.encode(m.ReplicaFailed(text))


def _fault(calls: int) -> None:
    """Fault injection for the tests: ``$YATT_REPLICA_EXIT=FILE:K`` exits at call K, once
    (the first process to get there creates FILE; later ones go on)."""
    spec = os.environ.get(FAULT_ENV)
    if spec:
        path, _, k = spec.rpartition(":")
        if calls == int(k):
            try:
                open(path, "x").close()
            except FileExistsError:
                return
            os._exit(17)


def _connect(args: argparse.Namespace) -> zmq.Socket:
    """The PAIR socket to the node: at ``--connect``, or at the address the node's store
    holds (a CURVE client of the node's controller with ``--keys``)."""
    from runtime.zmq.transport import make_socket

    address, keys = args.connect, None
    if args.store:
        import datetime

        from runtime.ranks.group import store_client

        timeout = datetime.timedelta(seconds=args.timeout)
        address = store_client(args.store, 1, timeout).get(args.key).decode()
    if args.keys:
        from runtime.zmq.keys import load_keys

        keys = load_keys(args.keys, "controller")
    server = keys.controller_public if keys is not None else None
    return make_socket(
        zmq.Context.instance(), zmq.PAIR, address, curve=keys, curve_server_key=server
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if bool(args.connect) == bool(args.store):
        parser.error("give the node's socket (--connect) or its store (--store and --key)")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    exit_with_parent(args.parent_pid, f"yatt-graph replica (pid {os.getpid()})")
    _pin(args.cores, args.threads)
    from runtime.codec import decode_value, encode_value
    from runtime.sched.fanout import run_with_context
    from yatt_graph.serialize import NodeSpec, build_node

    sock = _connect(args)
    try:
        build = m.TO_REPLICA.decode(sock.recv())
        if not isinstance(build, m.ReplicaBuild):
            raise m.ProtocolError(f"the first message was {type(build).__name__}, not ReplicaBuild")
        node = build_node(msgspec.json.decode(build.spec, type=NodeSpec))
        node.setup()
    except BaseException as exc:
        sock.send(_error(exc))
        return 1
    sock.send(m.FROM_REPLICA.encode(m.ReplicaReady(os.getpid(), args.host)))
    done = m.FROM_REPLICA.encode(m.ReplicaDone())
    calls = 0
    while True:
        frames = sock.recv_multipart(copy=False)
        try:
            header = m.TO_REPLICA.decode(frames[0].buffer)
            if isinstance(header, m.ReplicaStop):
                return 0
            if not isinstance(header, m.ReplicaCall):
                raise m.ProtocolError(f"a {type(header).__name__} after the node was built")
            calls += 1
            _fault(calls)
            inputs = decode_value(list(frames[1:]), where="piece inputs")
            out = run_with_context(node, inputs, header.context, header.rows)
            reply = encode_value(out, where=f"node {node.name!r} outputs")
        except BaseException as exc:
            sock.send(_error(exc))
            continue
        sock.send_multipart([done, *reply], copy=False)


if __name__ == "__main__":
    raise SystemExit(main())
