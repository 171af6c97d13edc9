"""A replica process's entry point: ``python -m runtime.zmq.replica_main`` (started by
:class:`runtime.zmq.replicas.ReplicaProcess`, never by hand).

It pins itself to its cores, sets its torch threads, rebuilds the node from the NodeSpec it
is sent first, and answers each piece with the node's outputs (or the error, as text), until
it is told to stop or its parent is gone.
"""

from __future__ import annotations

import argparse
import os
import signal
import traceback
from collections.abc import Sequence

import msgspec
import zmq

__all__ = ["FAULT_ENV", "main"]

FAULT_ENV = "YATT_REPLICA_EXIT"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.zmq.replica_main")
    p.add_argument("--connect", required=True)
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
    return msgspec.json.encode({"op": "error", "message": text})


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


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    _pin(args.cores, args.threads)
    from runtime.codec import decode_value, encode_value
    from runtime.sched.fanout import run_with_context
    from yatt_graph.serialize import NodeSpec, build_node

    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.connect)
    try:
        node = build_node(msgspec.json.decode(sock.recv(), type=NodeSpec))
        node.setup()
    except BaseException as exc:
        sock.send(_error(exc))
        return 1
    sock.send(msgspec.json.encode({"op": "ready"}))
    calls = 0
    while True:
        if not sock.poll(1000):
            if os.getppid() != args.parent_pid:
                return 0  # the parent is gone
            continue
        frames = sock.recv_multipart(copy=False)
        header = msgspec.json.decode(frames[0].bytes)
        if header.get("op") == "stop":
            return 0
        calls += 1
        _fault(calls)
        try:
            inputs = decode_value(list(frames[1:]), where="piece inputs")
            out = run_with_context(node, inputs, header.get("context"), header.get("rows"))
            reply = encode_value(out, where=f"node {node.name!r} outputs")
        except BaseException as exc:
            sock.send(_error(exc))
            continue
        sock.send_multipart([msgspec.json.encode({"op": "ok"}), *reply], copy=False)


if __name__ == "__main__":
    raise SystemExit(main())
