"""Replica processes: copies of a node that run pieces of its calls for a
node's :class:`~runtime.sched.fanout.Fanout`.

:func:`spawn_replica` starts ``python -m runtime.zmq.replica_main`` (a plain subprocess: no
fork of a process that has torch loaded) on its own core (``os.sched_setaffinity``) with one
torch thread, or on its own GPU (``CUDA_VISIBLE_DEVICES``) when the node runs on CUDA. It
rebuilds the node from its :class:`~yatt_graph.serialize.NodeSpec` (the same seeded build as
every other copy) and serves pieces over a zmq PAIR socket on ``ipc://``: a typed header
(:data:`runtime.zmq.messages.TO_REPLICA`, :data:`~runtime.zmq.messages.FROM_REPLICA`) plus
the value codec's frames (:mod:`runtime.codec`), nothing pickled. A weight update
(a shared :class:`~yatt_graph.WeightUpdate` input) reaches each process once per version.

A replica process that exits is an error naming the node, the replica, its pid and exit code,
with the tail of its log (:class:`runtime.children.Child`), raised from the call that was
waiting on it; so a run with ``--restart on-failure`` restarts from the last checkpoint. A
replica exits by itself when its parent does (:func:`runtime.children.exit_with_parent`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import zmq

from runtime.children import python_env, start_child, stop
from runtime.codec import decode_value, encode_value
from runtime.errors import ProcessFault
from runtime.sched.devices import passive_env
from runtime.zmq import messages as m
from yatt_graph import WeightUpdate
from yatt_graph.serialize import node_spec

__all__ = ["ReplicaDied", "ReplicaProcess", "spawn_replica"]

_POLL_MS = 200
_START_TIMEOUT_S = 300.0
"""How long a replica may take to start and build its node (a model load)."""


class ReplicaDied(ProcessFault):
    """A replica process exited, gave no answer in time or could not start: a process fault,
    like a dead controller, so ``--restart on-failure`` restarts the run from its last
    checkpoint."""


class ReplicaProcess:
    """Replica ``index`` of ``node`` in a process of its own, with one torch thread, on
    ``cores`` or GPU ``gpu`` (see the module doc)."""

    def __init__(
        self, node: Any, index: int, cores: Sequence[int] | None = None, gpu: str | None = None
    ):
        self.name, self.index = node.name, index
        try:
            spec = msgspec.json.encode(node_spec(node))
        except Exception as exc:
            raise ValueError(
                f"node {node.name!r} cannot have replica processes: its configuration does not "
                f"travel ({exc}); give it JSON-able arguments (a policy spec, not a live model)"
            ) from None
        self.dir = tempfile.mkdtemp(prefix="yatt-replica-")
        self.log_path = os.path.join(self.dir, "replica.log")
        address = f"ipc://{self.dir}/pair"
        self.sock = zmq.Context.instance().socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        env = passive_env(python_env(1))  # it computes while the node's own copy does
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        args = [
            "--connect", address, "--parent-pid", str(os.getpid()), "--threads", "1",
            *(["--cores", ",".join(map(str, cores))] if cores else []),
        ]  # fmt: skip
        who = f"replica {index} of node {node.name!r}"
        self.child = start_child("runtime.zmq.replica_main", args, env, who, self.log_path)
        self.pid = self.child.pid
        self.label = f"process {index} (pid {self.pid})"
        self._sent: Any = {}  # shared port -> the last value sent (a weight update is sent once)
        try:
            self.sock.send(m.TO_REPLICA.encode(m.ReplicaBuild(spec)))
            header, _ = self._reply(_START_TIMEOUT_S, "starting")
            if not isinstance(header, m.ReplicaReady):
                raise ReplicaDied(self._why("did not start", getattr(header, "message", "")))
        except BaseException:
            self.close()
            raise

    # --- calls -------------------------------------------------------------------------------
    def call(
        self, node: Any, inputs: dict[str, Any], context: Mapping[str, int] | None, rows: list[int]
    ) -> dict[str, Any]:
        """Run a piece on this process's copy of ``node``."""
        inputs = self._once_per_version(inputs)
        frames = encode_value(inputs, where=f"node {self.name!r} replica {self.index} inputs")
        header = m.TO_REPLICA.encode(
            m.ReplicaCall(None if context is None else dict(context), rows)
        )
        self.sock.send_multipart([header, *frames], copy=False)
        reply, frames = self._reply(None, "running a piece")
        if isinstance(reply, m.ReplicaFailed):
            raise RuntimeError(
                f"node {self.name!r} replica {self.index} (pid {self.pid}): {reply.message}"
            )
        if not isinstance(reply, m.ReplicaDone):
            raise ReplicaDied(self._why(f"answered a piece with {type(reply).__name__}"))
        return decode_value(frames, where=f"node {self.name!r} replica {self.index} outputs")

    def _once_per_version(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """A shared :class:`~yatt_graph.WeightUpdate` input that this process already has is
        sent as None (the node keeps what it loaded)."""
        out = dict(inputs)
        for port, value in inputs.items():
            if not isinstance(value, WeightUpdate):
                continue
            last = self._sent.get(port)
            if last is value or (
                value.version and last is not None and last.version == value.version
            ):
                out[port] = None
            else:
                self._sent[port] = value
        return out

    def _reply(self, timeout_s: float | None, doing: str) -> tuple[Any, list[Any]]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.sock.poll(_POLL_MS):
            if dead := self.child.dead():
                raise ReplicaDied(f"{dead} while {doing}" + self.child.log_tail())
            if deadline is not None and time.monotonic() > deadline:
                raise ReplicaDied(self._why(f"gave no answer in {timeout_s:.0f} s while {doing}"))
        frames = self.sock.recv_multipart(copy=False)
        try:
            return m.FROM_REPLICA.decode(frames[0].buffer), list(frames[1:])
        except m.ProtocolError as exc:
            raise ReplicaDied(
                self._why(f"sent what is not an answer while {doing}: {exc}")
            ) from None

    def _why(self, what: str, message: str = "") -> str:
        who = f"{self.child.label} (pid {self.pid})"
        return f"{who} {what}" + (f": {message}" if message else "") + self.child.log_tail()

    def close(self) -> None:
        child = getattr(self, "child", None)  # None: the process did not start
        if child is not None and not child.dead():
            with contextlib.suppress(zmq.ZMQError):
                self.sock.send(m.TO_REPLICA.encode(m.ReplicaStop()), zmq.NOBLOCK)
            stop([child], grace_s=10)
        self.sock.close(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)


def spawn_replica(node: Any, index: int, count: int) -> ReplicaProcess:
    """Replica ``index`` of ``count``: on GPU ``index`` when the node runs on CUDA and that
    many GPUs are visible, else on core ``index`` of this process's cores (one torch thread)."""
    device = str(getattr(node, "device", "cpu"))
    if device.startswith("cuda"):
        import torch

        n = torch.cuda.device_count()
        if n < count:
            raise ValueError(
                f"node {node.name!r}: {count} replicas on CUDA need {count} GPUs, {n} visible"
            )
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(n)]
        return ReplicaProcess(node, index, gpu=gpus[index])
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    core = [cores[index % len(cores)]] if cores else None
    return ReplicaProcess(node, index, cores=core)
