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

In a run whose controllers span hosts the replicas spread over the hosts
(:func:`runtime.ranks.placement.place_replicas`, :func:`replica_rendezvous`). The node's
controller starts the replicas of its own host as above; for each one elsewhere it binds a
``tcp://`` PAIR socket on its host's address (a CURVE server with the run's ``--keys``) and
writes that address to the node's store, which the driver hosts. The other host's first
controller starts the replica (:class:`RemoteReplicas`), which reads the address there and
connects (a CURVE client with the controller keys), then watches it: a replica that exits is
written to the store, where the node's controller reads it while it waits on that replica.

A replica that exits or gives no answer (:class:`ReplicaDied`), on this host or another, is
named, with the tail of its log, and leaves its node's crew: the pieces it held go to the
node's other copies (:class:`runtime.sched.fanout.Crew`), and the run goes on, its results
what they would have been (a piece's samples do not depend on the worker). A replica exits by
itself when its parent does (:func:`runtime.children.exit_with_parent`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import zmq

from runtime.children import Child, python_env, start_child, stop
from runtime.codec import decode_value, encode_value
from runtime.errors import ProcessFault
from runtime.ranks.placement import HostPlacement, place_replicas
from runtime.sched.devices import passive_env
from runtime.zmq import messages as m
from runtime.zmq.transport import make_socket
from yatt_graph import WeightUpdate
from yatt_graph.serialize import node_spec

__all__ = [
    "LocalStart",
    "RemoteEnd",
    "RemoteReplicas",
    "ReplicaDied",
    "ReplicaProcess",
    "replica_rendezvous",
    "replica_spawner",
    "spawn_replica",
    "start_remote_replicas",
]

_POLL_MS = 200
_START_TIMEOUT_S = 300.0
"""How long a replica may take to start and build its node (a model load)."""
_ADDRESS, _DEAD = "address", "dead"
"""A remote replica's keys in its node's store, under ``yatt/replica/<index>/``."""


def _key(index: int, what: str) -> str:
    return f"yatt/replica/{index}/{what}"


class ReplicaDied(ProcessFault):
    """A replica process exited, gave no answer in time or could not start: a process fault,
    like a dead controller, so ``--restart on-failure`` restarts the run from its last
    checkpoint."""


class LocalStart(msgspec.Struct, frozen=True):
    """A replica process on this host: on ``cores``, or on GPU ``gpu`` (None: as this
    process)."""

    cores: list[int] | None = None
    gpu: str | None = None

    def open(self, folder: str, who: str, index: int) -> tuple[zmq.Socket, Child]:
        """A PAIR socket on ``ipc://`` in ``folder``, and the process started to connect to it."""
        address = f"ipc://{folder}/pair"
        sock = zmq.Context.instance().socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        env = passive_env(python_env(1))  # it computes while the node's own copy does
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        args = [
            "--connect", address, "--parent-pid", str(os.getpid()), "--threads", "1",
            *(["--cores", ",".join(map(str, self.cores))] if self.cores else []),
        ]  # fmt: skip
        log = os.path.join(folder, "replica.log")
        return sock, start_child("runtime.zmq.replica_main", args, env, who, log)


class ReplicaProcess:
    """Replica ``index`` of ``node`` in a process of its own, with one torch thread, started
    by ``start``: on this host (:class:`LocalStart`: its cores or GPU), or on another host
    (:class:`RemoteEnd`: started there by :class:`RemoteReplicas`; see the module doc)."""

    def __init__(self, node: Any, index: int, start: LocalStart | RemoteEnd | None = None):
        self.name, self.index = node.name, index
        try:
            spec = msgspec.json.encode(node_spec(node))
        except Exception as exc:
            raise ValueError(
                f"node {node.name!r} cannot have replica processes: its configuration does not "
                f"travel ({exc}); give it JSON-able arguments (a policy spec, not a live model)"
            ) from None
        self.dir = tempfile.mkdtemp(prefix="yatt-replica-")
        who = f"replica {index} of node {node.name!r}"
        self.sock, self.child = (start or LocalStart()).open(self.dir, who, index)
        self.pid = self.child.pid
        self.label = f"process {index} (pid {self.pid})"
        self._sent: Any = {}  # shared port -> the last value sent (a weight update is sent once)
        try:
            self._send([m.TO_REPLICA.encode(m.ReplicaBuild(spec))], _START_TIMEOUT_S, "starting")
            header, _ = self._reply(_START_TIMEOUT_S, "starting")
            if not isinstance(header, m.ReplicaReady):
                raise ReplicaDied(self._why("did not start", getattr(header, "message", "")))
            if header.host:  # on another host: its pid there
                self.pid = self.child.pid = header.pid
                self.label = f"process {index} (pid {self.pid} on host {header.host})"
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
        self._send([header, *frames], None, "taking a piece")
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

    def _send(self, frames: list[Any], timeout_s: float | None, doing: str) -> None:
        """Send a message once the socket takes it: a PAIR socket takes none while its peer is
        not connected (not yet, or no longer: a replica that died)."""
        while True:
            self._wait(zmq.POLLOUT, timeout_s, doing)
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:  # (its peer left between the poll and the send)
                continue

    def _wait(self, event: int, timeout_s: float | None, doing: str) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.sock.poll(_POLL_MS, event):
            if dead := self.child.dead():
                raise ReplicaDied(f"{dead} while {doing}" + self.child.log_tail())
            if deadline is not None and time.monotonic() > deadline:
                raise ReplicaDied(self._why(f"gave no answer in {timeout_s:.0f} s while {doing}"))

    def _reply(self, timeout_s: float | None, doing: str) -> tuple[Any, list[Any]]:
        self._wait(zmq.POLLIN, timeout_s, doing)
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
            if isinstance(child, Child):  # (one on another host: its controller stops it)
                stop([child], grace_s=10)
        if hasattr(self, "sock"):
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
        return ReplicaProcess(node, index, LocalStart(gpu=gpus[index]))
    core = _core(index)
    return ReplicaProcess(node, index, LocalStart(cores=None if core is None else [core]))


def _core(index: int) -> int | None:
    """The core of replica ``index`` of a host: its index among this process's cores
    (wrapping), None where the cores are unknown."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return cores[index % len(cores)] if cores else None


class RemoteEnd(msgspec.Struct, frozen=True):
    """What the node's controller needs to meet replica copies on other hosts: the node's
    placement, its zmq context (with the CURVE authenticator, when the run has keys) and
    the controller keys."""

    placement: HostPlacement
    ctx: Any
    keys: Any = None

    def open(self, folder: str, who: str, index: int) -> tuple[zmq.Socket, _RemoteCopy]:
        """A PAIR socket on this host's address, on a free port (a CURVE server with keys),
        whose address replica ``index`` finds in the node's store."""
        sock = make_socket(self.ctx or zmq.Context.instance(), zmq.PAIR, curve=self.keys)
        host = self.placement.hosts[0]
        base = f"tcp://[{host}]" if ":" in host else f"tcp://{host}"
        address = f"{base}:{sock.bind_to_random_port(base)}"
        return sock, _RemoteCopy(self, index, who, address)

    def store(self) -> Any:
        from runtime.ranks.group import store_client

        timeout = datetime.timedelta(seconds=self.placement.timeout_s)
        return store_client(self.placement.store, self.placement.world, timeout)


class _RemoteCopy:
    """A replica on another host, as its node's controller sees it: its address written to
    the node's store for it to connect to, and its death read from there (its own host's
    controller writes it: :class:`RemoteReplicas`)."""

    def __init__(self, end: RemoteEnd, index: int, label: str, address: str) -> None:
        self.store, self.index, self.label, self.pid = end.store(), index, label, 0
        self.store.set(_key(index, _ADDRESS), address.encode())
        self._dead = ""

    def dead(self) -> str:
        if not self._dead and self.store.check([_key(self.index, _DEAD)]):
            self._dead = self.store.get(_key(self.index, _DEAD)).decode()
        return self._dead

    def log_tail(self) -> str:
        return ""  # (what its host's controller wrote holds it)


def replica_spawner(
    placements: Mapping[str, HostPlacement], ctx: Any = None, keys: Any = None
) -> Callable[[Any, int, int], ReplicaProcess]:
    """The ``spawn`` of a controller's fan-outs (:func:`runtime.sched.fanout.start_fanouts`):
    :func:`spawn_replica` for a replica on this host, a :class:`ReplicaProcess` that another
    host's controller starts for one placed there (``placements``: the nodes whose replicas
    span hosts; ``ctx``, ``keys``: this controller's zmq context and CURVE keys)."""

    def spawn(node: Any, index: int, count: int) -> ReplicaProcess:
        placement = placements.get(node.name)
        if placement is None:
            return spawn_replica(node, index, count)
        if placement.hosts[index] == placement.hosts[0]:
            here = placement.hosts.count(placement.hosts[0])
            return spawn_replica(node, placement.local[index], here)
        return ReplicaProcess(node, index, RemoteEnd(placement, ctx, keys))

    return spawn


class RemoteReplicas:
    """The replicas a controller starts for a node of another host's controller: each reads
    its node's address from the node's store and connects there. It watches them and writes
    a death to the store, where the node's controller reads it; :meth:`close` ends what is
    left (they also end when this process does)."""

    def __init__(
        self, name: str, placement: HostPlacement, here: int, keys_dir: str | None, cuda: bool
    ) -> None:
        from runtime.ranks.group import report_deaths, store_client

        self.host, self.closed = placement.hosts[placement.ranks_of(here)[0]], False
        timeout = datetime.timedelta(seconds=placement.timeout_s)
        self.store = store_client(placement.store, placement.world, timeout)
        self.dir = tempfile.mkdtemp(prefix="yatt-replica-")
        self.procs: dict[int, Child] = {}
        env = passive_env(python_env(1))
        try:
            for index in placement.ranks_of(here):
                local = placement.local[index]
                if cuda:
                    env = {**env, "CUDA_VISIBLE_DEVICES": str(local)}
                args = [
                    "--store", placement.store, "--key", _key(index, _ADDRESS),
                    "--host", self.host, "--timeout", str(placement.timeout_s),
                    "--parent-pid", str(os.getpid()), "--threads", "1",
                    *(["--keys", keys_dir] if keys_dir else []),
                    *(["--cores", str(core)] if (core := _core(local)) is not None and not cuda else []),
                ]  # fmt: skip
                log = os.path.join(self.dir, f"replica{index}.log")
                who = f"replica {index} of node {name!r}"
                self.procs[index] = start_child("runtime.zmq.replica_main", args, env, who, log)
        except BaseException:
            self.close()
            raise
        print(f"yatt-graph controller {here}: {placement.describe(name, here, 'replicas')}",
              file=sys.stderr, flush=True)  # fmt: skip
        watched = {_key(index, _DEAD): proc for index, proc in self.procs.items()}
        report_deaths(watched, self.store, self.host, lambda: self.closed)

    def close(self) -> None:
        self.closed = True
        stop(list(self.procs.values()), grace_s=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def start_remote_replicas(
    nodes: Mapping[str, Any],
    placements: Mapping[str, HostPlacement],
    here: int,
    keys_dir: str | None,
    devices: Mapping[str, str],
) -> list[RemoteReplicas]:
    """On controller ``here``: the replicas it holds of nodes that run elsewhere
    (``placements``: the nodes whose replicas span hosts; ``devices``: each node's device)."""
    started: list[RemoteReplicas] = []
    try:
        for name, placement in placements.items():
            if name not in nodes and placement.ranks_of(here):
                cuda = str(devices.get(name, "cpu")).startswith("cuda")
                started.append(RemoteReplicas(name, placement, here, keys_dir, cuda))
    except BaseException:
        for r in started:
            r.close()
        raise
    return started


def replica_rendezvous(
    counts: Mapping[str, int],
    per_host: int,
    assignment: Mapping[str, int],
    hosts: Sequence[str],
    driver_host: str,
) -> tuple[dict[str, HostPlacement], list[Any]]:
    """The driver's side of replicas across hosts: for each node of ``counts`` (its
    copies, :func:`runtime.sched.fanout.replica_counts`) with more than ``per_host``, where
    each copy runs (:func:`runtime.ranks.placement.place_replicas`; ``hosts``: each
    controller's host, by index) and a store hosted here, at ``driver_host``. Returns the
    placements and the stores, which the caller keeps as long as the run."""
    from runtime.ranks.group import host_store

    placements: dict[str, HostPlacement] = {}
    stores: list[Any] = []

    for name, count in counts.items():
        if count <= per_host:
            continue  # (all on the node's host)
        controllers, where, local = place_replicas(name, count, per_host, assignment[name], hosts)
        store, address = host_store(driver_host, count, _START_TIMEOUT_S)
        stores.append(store)
        placements[name] = HostPlacement(address, controllers, where, local, _START_TIMEOUT_S)
    return placements, stores
