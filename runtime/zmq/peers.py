"""A controller's data plane: values in from its peers, and out to them.

:class:`Peers` owns the PULL that peers push DATA into and one PUSH per peer. It is the step
engine's outbox (:class:`~runtime.engine.engine.Outbox`): an output that another controller
reads goes to it once, as DATA, through shared memory when large and on one host
(:class:`~runtime.zmq.transport.ShmPool`); a CUDA tensor goes by CUDA IPC when SETUP says every
destination is on this host and sees its GPU (:mod:`runtime.codec.cuda_ipc`), else through host
memory. What arrives is decoded (zero-copy) and handed to
the engine; a message that does not decode, is over ``max_message_bytes``, names an edge no
node here reads or a step outside those being run is dropped and logged. Each restore starts
a new ``epoch``: data sent before it is dropped, not mixed in.
"""

from __future__ import annotations

import os
from typing import Any

import zmq

from runtime.codec import DecodeError, UnsupportedValueError, decode_value, encode_value
from runtime.codec.cuda_ipc import Collector, IpcReceive, IpcSend, ipc_devices
from runtime.codec.decode import release_ipc
from runtime.errors import SendError
from runtime.zmq import messages as m
from runtime.zmq.transport import Drops, ShmPool, ShmReader, largest_frame, make_socket, recv, send
from yatt_graph.stream import Piece

__all__ = ["Peers"]


class Peers:
    """The data sockets of one controller (see the module docstring).

    The inbox binds at once (its address goes in HELLO): to ``bind`` (``tcp://HOST:*``: a free
    port there), to a free port on ``host`` (tcp), or next to the driver's ipc socket.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        connect: str,
        *,
        bind: str | None,
        host: str,
        keys: Any,
        max_message_bytes: int,
        drops: Drops,
    ):
        self.ctx, self.keys, self.drops = ctx, keys, drops
        self.max_message_bytes = max_message_bytes
        self.inbox = make_socket(ctx, zmq.PULL, max_message_bytes=max_message_bytes, curve=keys)
        if bind:
            self.inbox.bind(bind)
            self.address = bind
            if bind.startswith("tcp://") and bind.endswith((":*", ":0")):  # the port it got
                self.address = self.inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        elif host:
            port = self.inbox.bind_to_random_port(f"tcp://{host}")
            self.address = f"tcp://{host}:{port}"
        else:
            path = os.path.join(
                os.path.dirname(connect.removeprefix("ipc://")), f"data-{os.getpid()}"
            )
            self.address = f"ipc://{path}"
            self.inbox.bind(self.address)
        self.index = -1
        self.epoch = 0
        self.out: dict[int, zmq.Socket] = {}
        self.pool: ShmPool | None = None
        self.reader: ShmReader | None = None
        self._releases: list[tuple[int, str]] = []
        self.ipc_gpus: list[list[int]] = []
        self._ipc_send: dict[tuple[int, ...], IpcSend | None] = {}
        self.ipc_receive: IpcReceive | None = None
        self._ipc_collect = Collector()
        self._where = "this controller's data socket"

    def connect(self, setup: m.Setup) -> None:
        """After SETUP: this controller's index, the run's limit, shared memory, a PUSH per peer."""
        self.index = setup.controller
        self._where = f"controller {self.index}'s data socket"
        if setup.config.max_message_bytes:  # before the peers connect
            self.max_message_bytes = setup.config.max_message_bytes
            self.inbox.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        if setup.config.shm_threshold > 0 and setup.run_id and os.path.isdir("/dev/shm"):
            self.pool = ShmPool(setup.run_id, self.index, setup.config.shm_threshold)
            self.reader = ShmReader(setup.run_id, self._queue_release)
        self.ipc_gpus = [list(g) for g in setup.cuda_ipc_gpus]
        if 0 <= self.index < len(self.ipc_gpus) and self.ipc_gpus[self.index]:
            self.ipc_receive = IpcReceive(self.index, self.ipc_gpus[self.index])
        peer_key = self.keys.controller_public if self.keys is not None else None
        self.out = {
            c: make_socket(
                self.ctx,
                zmq.PUSH,
                address,
                linger_ms=2000,
                curve=self.keys,
                curve_server_key=peer_key,
            )  # fmt: skip
            for c, address in enumerate(setup.peers)
            if c != self.index
        }

    # --- out: the engine's outbox -----------------------------------------------------------
    def piece(
        self, step: int, src: str, port: str, index: int, piece: Piece, dests: list[int]
    ) -> None:
        self.value(step, src, port, piece.outputs[port], dests, index, piece.rows, piece.size)

    def end(self, step: int, src: str, port: str, count: int, dests: list[int]) -> None:
        header = m.Data(step, src, port, self.index, self.epoch, count, end=True)
        for c in dests:
            send(self.out[c], header)

    def value(
        self, step: int, src: str, port: str, value: Any, dests: list[int], piece: int = -1,
        rows: list[int] | None = None, size: int | None = None,
    ) -> None:  # fmt: skip
        """Send a value (or piece ``piece`` of a stream, with its ``rows`` and batch ``size``)."""

        def where() -> str:  # only for errors: hot path
            many = "s" if len(dests) > 1 else ""
            return f"node {src!r} output {port!r} (to controller{many} {dests})"

        if self.pool is not None:
            self.pool.refs = len(dests)
        try:
            frames = encode_value(value, where="", shm=self.pool, cuda_ipc=self._ipc(dests))
        except UnsupportedValueError as exc:
            raise SendError(src, step, f"{where()}{exc}") from None
        self.check_size(frames, where, src, step)
        header = m.Data(
            step, src, port, self.index, self.epoch, piece, rows or [],
            size=-1 if size is None else size,
        )  # fmt: skip
        for c in dests:
            send(self.out[c], header, frames)

    def _ipc(self, dests: list[int]) -> IpcSend | None:
        """How CUDA tensors to ``dests`` may go by IPC (None: all by host copy); one per set."""
        if not self.ipc_gpus:
            return None
        key = tuple(dests)
        if key not in self._ipc_send:
            devices = ipc_devices(self.ipc_gpus, self.index, dests)
            self._ipc_send[key] = IpcSend(devices, key) if devices else None
        return self._ipc_send[key]

    def check_size(self, frames: list[Any], where: Any, node: str, step: int) -> None:
        """A SendError (naming what ``where()`` says) if a frame is over the run's limit."""
        limit = self.max_message_bytes
        if limit and (size := largest_frame(frames)) > limit:
            raise SendError(
                node,
                step,
                f"{where()}: a frame of {size} bytes is over max_message_bytes={limit}, so the "
                "receiver would drop it; raise the limit (ZmqExecutor(max_message_bytes=...), "
                "yatt-graph run --max-message-mb) or send less",
            )

    # --- in ---------------------------------------------------------------------------------
    def receive(self, engine: Any) -> m.Error | None:
        """One message from a peer, handed to ``engine``; an ERROR for the driver when a value
        does not decode (the run cannot go on without it)."""
        where = self._where
        try:
            _, kind, msg, value = recv(self.inbox, limit=self.max_message_bytes)
        except m.ProtocolError as exc:
            self.drops.drop(where, exc)
            return None
        if kind is m.Kind.RELEASE:
            if self.pool is not None:
                self.pool.release(msg.segment)
            return None
        if kind is not m.Kind.DATA:
            self.drops.drop(where, f"a {kind.name} message, which peers do not send")
            return None
        if not engine.reads(msg.src, msg.port):
            self.drops.drop(where, f"data for {msg.src}.{msg.port}, which no node here reads")
            self._release_ipc(msg, value)
            return None
        if msg.epoch != self.epoch:
            if msg.epoch > self.epoch:
                self.drops.drop(
                    where, f"data of epoch {msg.epoch}; this controller is at {self.epoch}"
                )
            self._release_ipc(msg, value)
            return None  # sent before the last restore: stale by design, dropped quietly
        if msg.end:
            dropped = engine.end_stream(msg.step, msg.src, msg.port, msg.piece)
        else:
            try:
                decoded = decode_value(value, where="", shm=self.reader, cuda_ipc=self.ipc_receive)
            except DecodeError as exc:
                what = f"data {msg.src}.{msg.port} of step {msg.step} from controller {msg.sender}"
                return m.Error(self.index, f"{what}{exc}", msg.src, msg.step, during="io")
            if msg.piece >= 0:
                piece = Piece(msg.rows, {msg.port: decoded}, None if msg.size < 0 else msg.size)
                dropped = engine.deliver_piece(msg.step, msg.src, msg.port, msg.piece, piece)
            else:
                dropped = engine.deliver(msg.step, msg.src, msg.port, decoded)
        for why in dropped:
            self.drops.drop(where, why)
        return None

    def _release_ipc(self, msg: m.Data, value: Any) -> None:
        """A DATA message dropped undecoded: let its sender free the CUDA IPC tensors in it."""
        if self.ipc_receive is not None and not msg.end and value:
            release_ipc(value, self.ipc_receive)

    def _queue_release(self, owner: int, name: str) -> None:
        self._releases.append((owner, name))

    def send_releases(self) -> None:
        """Tell owners that the shared-memory slots of values freed here are free again (and,
        once this controller has sent CUDA IPC tensors, let torch free those that every
        receiver has released: ``torch.cuda.ipc_collect``, about once a second)."""
        if self._ipc_send:
            self._ipc_collect.maybe(sum(s.sent for s in self._ipc_send.values() if s))
        while self._releases:
            owner, name = self._releases.pop()
            if owner == self.index and self.pool is not None:
                self.pool.release(name)
            elif owner in self.out:
                send(self.out[owner], m.Release(name))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.reader is not None:
            self.reader.close()
