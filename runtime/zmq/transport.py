"""Sockets and shared memory for the ZeroMQ runtime.

* :func:`make_socket` is the one place sockets are made (linger, high-water marks, the
  message size limit, CURVE keys, bind or connect), :func:`send` / :func:`recv` put messages
  of :mod:`runtime.zmq.messages` on them; :class:`Drops` counts and logs what a receiver drops.
* :class:`ShmPool` (sender side) and :class:`ShmReader` (receiver side) move large tensors
  between controllers on one host through reusable shared-memory segments in ``/dev/shm``:
  the sender copies the tensor into a free segment it owns (mapped once with
  ``MAP_POPULATE``, so reuse pays no page faults) and sends a small handle over zmq; the
  receiver maps the segment once and hands the node a tensor that *is* a view of it (no
  copy, no page faults), and sends RELEASE back when that tensor is freed, so the segment
  is reused. One copy at memcpy speed, instead of the socket path (two kernel copies into
  fresh pages; docs/PERFORMANCE.md). Segment names start with the run id, so the driver
  can remove every leftover of a run, even after a crash. While a receiver holds on to
  such a tensor its segment stays out of the pool, and the sender makes new ones.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import mmap
import os
import socket
import threading
import weakref
from typing import Any

import zmq

from runtime.engine.config import DEFAULT_MAX_MESSAGE_BYTES
from runtime.zmq.messages import Kind, ProtocolError, decode_header, encode_header

__all__ = [
    "HANDSHAKE_FAILED",
    "HANDSHAKE_FAILURES",
    "advertised_host",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "Drops",
    "ShmPool",
    "ShmReader",
    "largest_frame",
    "make_socket",
    "recv",
    "recv_frames",
    "remove_run_segments",
    "send",
    "split",
]

SHM_DIR = "/dev/shm"


log = logging.getLogger("yatt_graph.runtime")
_MORE = zmq.SNDMORE


HANDSHAKE_FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "its CURVE keys were refused",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the CURVE handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed",
}
"""Socket-monitor events of a failed handshake (the peer holds other CURVE keys, or none)."""
HANDSHAKE_FAILED = sum(HANDSHAKE_FAILURES)
"""Those events as one monitor mask."""


def advertised_host(connect: str) -> str:
    """This host's address as seen from a peer at ``connect`` (the interface that routes to it)."""
    host = connect.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def make_socket(
    ctx: zmq.Context,
    kind: int,
    address: str | None = None,
    *,
    bind: bool = False,
    identity: bytes | None = None,
    linger_ms: int = 0,
    max_message_bytes: int = 0,
    curve: Any = None,
    curve_server_key: bytes | None = None,
) -> zmq.Socket:
    """A socket with this runtime's options; bound or connected to ``address`` when given.

    Linger is 0 by default: at shutdown undelivered messages are dropped rather than
    keeping the process alive. High-water marks are unlimited, because the driver bounds
    how many steps are in flight (a full PUSH would otherwise block the sender silently).
    ``max_message_bytes`` > 0 sets ZMQ_MAXMSGSIZE: libzmq disconnects a peer that announces a
    larger frame, before any of it is buffered. ``curve`` (:class:`runtime.zmq.keys.CurveKeys`) turns on
    CURVE: a server socket when ``curve_server_key`` is None, else a client of that server.
    """
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if max_message_bytes > 0:
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if curve is not None:
        sock.curve_secretkey, sock.curve_publickey = curve.secret, curve.public
        if curve_server_key is None:
            sock.curve_server = True
        else:
            sock.curve_serverkey = curve_server_key
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer raises instead of vanishing
    if address is not None:
        if bind:
            sock.bind(address)
        else:
            sock.connect(address)
    return sock


def send(
    sock: zmq.Socket, msg: Any, value: list[Any] | None = None, *, prefix: list[Any] | None = None
) -> None:
    """Send ``[*prefix, head, *value]``; buffers go zero-copy (pyzmq copies small ones).

    One ``send`` per frame rather than ``send_multipart``: its per-message checks cost more
    than the message on the dispatch path (docs/PERFORMANCE.md).
    """
    frames = [*(prefix or ()), *encode_header(msg), *(value or ())]
    last = frames.pop()
    for frame in frames:
        sock.send(frame, _MORE, copy=False)
    sock.send(last, 0, copy=False)


def largest_frame(frames: list[Any]) -> int:
    """Size of the largest of a message's frames (zmq Frames or buffers)."""
    size = 0
    for f in frames:
        n = f.nbytes if type(f) is memoryview else len(f)
        if n > size:
            size = n
    return size


def recv(
    sock: zmq.Socket, *, prefix: int = 0, limit: int = 0, flags: int = 0
) -> tuple[list[Any], Kind, Any, list[Any]]:
    """``(prefix frames, kind, message, value frames)`` of the next message on ``sock``.

    ProtocolError (the message is consumed) when it is too short, has a frame over ``limit``
    bytes (0: no limit), or its kind/header do not decode.
    """
    return split(recv_frames(sock, flags), prefix=prefix, limit=limit)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """All frames of the next message (zero-copy Frames), like ``recv_multipart(copy=False)``.

    Reads ``Frame.more`` instead of a ``getsockopt(RCVMORE)`` per frame, which costs more
    than receiving a small frame.
    """
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(copy=False)
        frames.append(frame)
    return frames


def split(
    frames: list[Any], *, prefix: int = 0, limit: int = 0
) -> tuple[list[Any], Kind, Any, list[Any]]:
    """:func:`recv` on frames already received."""
    if len(frames) < prefix + 1:
        raise ProtocolError(f"a message of {len(frames)} frames; expected at least {prefix + 1}")
    if limit > 0 and (size := largest_frame(frames)) > limit:
        raise ProtocolError(
            f"a frame of {size} bytes is over the limit of {limit} (max_message_bytes)"
        )
    kind, msg = decode_header(frames[prefix])
    return frames[:prefix], kind, msg, frames[prefix + 1 :]


class Drops:
    """Counts messages a receiver drops and logs them: the first 10, then one in a hundred.

    A stranger flooding a socket cannot flood the log, and nothing it sends stops the run.
    """

    def __init__(self, owner: str):
        self.owner, self.count = owner, 0
        self.last = ""
        self._lock = threading.Lock()

    def drop(self, where: Any, why: Any) -> None:
        with self._lock:
            self.count += 1
            count = self.count
            self.last = f"{where}: {why}"
        if count <= 10 or count % 100 == 0:
            log.warning(
                "%s dropped a message on %s: %s (%d dropped so far)", self.owner, where, why, count
            )


# --- shared memory ----------------------------------------------------------------------------
class _Segment:
    def __init__(self, name: str, size: int, create: bool):
        import torch

        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            populate = getattr(mmap, "MAP_POPULATE", 0)
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
        finally:
            os.close(fd)
        self.name, self.size, self.path = name, size, path
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)  # (size,) a view of the mapping
        self.refs = 0

    def close(self) -> None:
        self.tensor = None
        with contextlib.suppress(BufferError):  # a view is still alive; the OS unmaps at exit
            self.map.close()


class ShmPool:
    """Segments a controller owns for sending large tensors; thread-safe (put vs release)."""

    def __init__(self, run_id: str, owner: int, threshold: int = 1 << 20):
        self.prefix = f"{run_id}-c{owner}-"
        self.owner, self.threshold = owner, threshold
        self._free: list[_Segment] = []
        self._busy: dict[str, _Segment] = {}
        self._count = 0
        self._lock = threading.Lock()
        self.refs = 1
        """How many receivers the next ``put`` is for (each releases once)."""

    def put(self, flat: Any) -> list[Any]:
        """Copy a uint8 tensor into a free segment; the handle ``[name, owner, nbytes]``."""
        nbytes = flat.numel()
        with self._lock:
            fits = [s for s in self._free if s.size >= nbytes]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                self._free.remove(seg)
            else:
                mib = 1 << 20
                size = max(1, -(-nbytes // mib)) * mib  # whole MiB (rounded up), 1 at least
                seg = _Segment(f"{self.prefix}{self._count}", size, create=True)
                self._count += 1
            seg.refs = self.refs
            self._busy[seg.name] = seg
        seg.tensor[:nbytes].copy_(flat)  # (nbytes,) the one copy on the sending side
        return [seg.name, self.owner, nbytes]

    def release(self, name: str) -> None:
        with self._lock:
            seg = self._busy.get(name)
            if seg is None:
                return
            seg.refs -= 1
            if seg.refs <= 0:
                del self._busy[name]
                self._free.append(seg)

    @property
    def segments(self) -> int:
        with self._lock:
            return len(self._free) + len(self._busy)

    def close(self) -> None:
        with self._lock:
            for seg in [*self._free, *self._busy.values()]:
                seg.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(seg.path)
            self._free, self._busy = [], {}


class ShmReader:
    """Receiver side: maps peers' segments once, copies tensors out, reports releases."""

    def __init__(self, run_id: str, on_release: Any):
        self.run_id, self.on_release = run_id, on_release
        self._maps: dict[str, _Segment] = {}

    def read_tensor(self, handle: list[Any], nbytes: int) -> Any:
        import numpy as np
        import torch

        from runtime.codec import DecodeError

        if not (
            isinstance(handle, list)
            and len(handle) == 3
            and isinstance(handle[0], str)
            and handle[0].startswith(self.run_id + "-")
            and "/" not in handle[0]
            and type(handle[1]) is int
            and handle[2] == nbytes
        ):
            raise DecodeError(f"bad shared-memory handle {handle!r:.100}")
        name, owner, _ = handle
        seg = self._maps.get(name)
        if seg is None:
            seg = self._maps[name] = _Segment(name, 0, create=False)
        if seg.size < nbytes:
            raise DecodeError(
                f"shared-memory segment {name} holds {seg.size} bytes, {nbytes} announced"
            )
        # No copy: the tensor is a view of the segment, and the segment goes back to its owner
        # (RELEASE) when the last tensor viewing it is freed. The owner never writes a segment
        # before that, so the view stays valid for as long as anyone holds it.
        view = np.frombuffer(seg.map, dtype=np.uint8, count=nbytes)
        weakref.finalize(view, self.on_release, owner, name)
        return torch.from_numpy(view)  # (nbytes,)

    def read(self, handle: list[Any], nbytes: int) -> Any:
        return memoryview(self.read_tensor(handle, nbytes).numpy())  # keeps the view alive

    def close(self) -> None:
        for seg in self._maps.values():
            seg.close()
        self._maps = {}


def remove_run_segments(run_id: str) -> int:
    """Unlink every shared-memory segment of a run (after a crash); returns how many."""
    count = 0
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(run_id) + "-*")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            count += 1
    return count
