"""The driver's socket: one ROUTER that every controller's two links connect to.

:class:`DriverLink` owns it. The calling thread of the executor receives on it directly while
it waits for results (no hop through another thread: dispatch latency); a heartbeat thread
shares it under a lock, so controllers notice a dead driver even while the caller is idle.
What arrives becomes a typed event (:class:`Received`, :class:`HelloRefused`) in
:attr:`DriverLink.events`; heartbeats only refresh a controller's last-seen time. Nothing a
stranger sends can stop the run: only controllers that joined are heard after start-up, and
anything that does not decode, is over ``max_message_bytes`` or fails the CURVE handshake is
dropped and logged.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.utils.monitor

from runtime.zmq import messages as m
from runtime.zmq.processes import ControllerProc
from runtime.zmq.transport import (
    HANDSHAKE_FAILURES,
    Drops,
    largest_frame,
    log,
    make_socket,
    recv_frames,
    send,
)

__all__ = ["DriverLink", "HelloRefused", "Received"]

_FROM_CONTROLLERS = frozenset(
    {
        m.Kind.READY,
        m.Kind.STEP_DONE,
        m.Kind.ERROR,
        m.Kind.GOODBYE,
        m.Kind.STATE_REPLY,
        m.Kind.STATE_LOADED,
    }
)


@dataclass(frozen=True)
class Received:
    """A message from a controller (or, during start-up, a HELLO from a peer)."""

    identity: bytes
    kind: m.Kind
    msg: Any
    value: list[Any]
    """The value frames that follow the header (STEP_DONE's outputs, STATE_REPLY's state)."""


@dataclass(frozen=True)
class HelloRefused:
    """A peer started by hand could not join (protocol mismatch): the user's to fix."""

    identity: bytes
    reason: str


class _Who:
    """Where a dropped message came from, formatted only when it is logged (hot path)."""

    def __init__(self, c: ControllerProc | None):
        self.c = c

    def __str__(self) -> str:
        c = self.c
        return f"the driver socket (from controller {c.index})" if c else "the driver socket"


class DriverLink:
    """The driver's ROUTER, its heartbeat thread and the events received on it.

    Args:
        ctx: the run's zmq context; address: where to bind (``tcp://...:*`` picks a port:
            read :attr:`address` afterwards); controllers: the driver's records, by index.
        reporting: whether a HELLO that cannot join is the user's to fix (controllers started
            by hand: :class:`HelloRefused`) rather than a stranger's (dropped, logged).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        controllers: list[ControllerProc],
        *,
        keys: Any,
        max_message_bytes: int,
        heartbeat_interval_s: float,
        stop: threading.Event,
        reporting: bool,
    ):
        # Controllers check their data, outputs and state against the run's limit before they
        # send (an error naming the flag); the socket's own limit is never below a header's
        # size, so a tiny data limit cannot drop HELLO or READY and stall the start-up.
        limit = max(max_message_bytes, m.MAX_HEADER_BYTES) if max_message_bytes else 0
        self.controllers, self.max_message_bytes = controllers, limit
        self.router = make_socket(
            ctx, zmq.ROUTER, address, bind=True, max_message_bytes=limit, curve=keys
        )
        self.address = address
        if address.endswith((":*", ":0")):
            self.address = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.monitor = self.router.get_monitor_socket() if keys is not None else None
        self.poller = zmq.Poller()  # one, not one per wait (Socket.poll makes a new one)
        self.poller.register(self.router, zmq.POLLIN)
        self.lock = threading.Lock()
        self.events: collections.deque[Received | HelloRefused] = collections.deque()
        self.by_identity: dict[bytes, ControllerProc] = {}
        self.last_seen: dict[bytes, float] = {}
        self.drops = Drops("driver")
        self.started = False
        self.handshake_failures = 0
        """Peers whose CURVE handshake failed (logged; named in a start-up timeout)."""
        self.reporting = reporting
        self._stop = stop
        self.thread = threading.Thread(
            target=self._heartbeats,
            args=(heartbeat_interval_s,),
            name="yatt-heartbeat",
            daemon=True,
        )
        self.thread.start()

    # --- sending ----------------------------------------------------------------------------
    def send_to(self, identity: bytes, msg: Any, value: list[Any] | None = None) -> None:
        with self.lock:
            try:
                send(self.router, msg, value, prefix=[identity])
            except zmq.ZMQError:  # a gone peer: the liveness check reports it
                return  # (try/except: contextlib.suppress costs more on the dispatch path)

    def send_control(self, c: ControllerProc, msg: Any, value: list[Any] | None = None) -> None:
        """To the controller's control link (its IO thread): SETUP, SHUTDOWN."""
        if c.identity is not None:
            self.send_to(c.identity, msg, value)

    def send_work(self, c: ControllerProc, msg: Any, value: list[Any] | None = None) -> None:
        """To the controller's work link (its compute thread): RUN and STATE_*."""
        if c.work is not None:
            self.send_to(c.work, msg, value)

    def join(self, c: ControllerProc, identity: bytes, hello: m.Hello) -> None:
        """Admit a HELLO: the controller's two links are heard from now on."""
        c.identity, c.pid, c.state = identity, hello.pid, m.State.CONNECTED
        c.data_address, c.work = hello.data_address, hello.work_identity
        self.by_identity[identity] = self.by_identity[c.work] = c
        self.last_seen[identity] = time.monotonic()

    # --- receiving --------------------------------------------------------------------------
    def next_event(self, spin_s: float = 0.0) -> Received | HelloRefused | None:
        """The next event: spinning up to ``spin_s`` (no sleep), then waiting up to 20 ms."""
        events = self.events
        if not events and spin_s > 0:
            until = time.perf_counter() + spin_s
            while not events and time.perf_counter() < until:
                with self.lock:
                    self._pump(0, drain=False)
        if not events:
            with self.lock:
                self._pump(20, drain=False)
        return events.popleft() if events else None

    def _heartbeats(self, interval: float) -> None:
        beat = m.encode_header(m.Heartbeat())
        while not self._stop.wait(interval):
            with self.lock:
                if self._stop.is_set():
                    return
                for c in self.controllers:
                    if c.identity is not None:
                        with contextlib.suppress(zmq.ZMQError):  # gone: the liveness check says
                            self.router.send_multipart([c.identity, *beat])
                self._pump(0)  # keep last-seen times fresh while the caller is away
                self._watch_handshakes()

    def _watch_handshakes(self) -> None:
        """Log peers whose CURVE handshake failed (keys of another run, or none)."""
        if self.monitor is None:
            return
        while self.monitor.poll(0):
            try:
                event = zmq.utils.monitor.recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            why = HANDSHAKE_FAILURES.get(event["event"])
            if why:
                self.handshake_failures += 1
                self.drops.drop(
                    "the driver socket",
                    f"a peer whose handshake failed: {why} (a controller started with another "
                    "--keys folder, or none?)",
                )

    def _pump(self, timeout_ms: int, drain: bool = True) -> None:
        """Receive what is waiting (the caller holds the lock) into the event deque: every
        message, or with ``drain=False`` the first one (the caller comes back for more;
        one poll(0) fewer on the dispatch path)."""
        poll = self.poller.poll
        while poll(timeout_ms):
            frames = recv_frames(self.router, zmq.NOBLOCK)
            self._dispatch(frames[0].bytes, frames[1:])
            if not drain:
                return
            timeout_ms = 0

    def _dispatch(self, identity: bytes, frames: list[Any]) -> None:
        """Route one message (the caller holds the lock); drop and log what is not for us."""
        c = self.by_identity.get(identity)
        who = _Who(c)
        if not frames:
            self.drops.drop(who, f"a message of {len(frames)} frames")
            return
        if self.max_message_bytes and (size := largest_frame(frames)) > self.max_message_bytes:
            self.drops.drop(
                who, f"a frame of {size} bytes, over max_message_bytes={self.max_message_bytes}"
            )
            return
        if c is None:
            head = frames[0].bytes[:1]
            if head == m.Kind.HELLO.frame and len(frames[0]) == 1 and len(frames) == 2:
                self._hello(identity, frames[1], legacy=True)  # protocol 2: kind, header
            elif head == m.Kind.HELLO.frame:
                self._hello(identity, frames[0].bytes[1:])
            else:
                self.drops.drop(who, "a message from a peer that has not joined the run")
            return
        try:
            kind, msg = m.decode_header(frames[0])
        except m.ProtocolError as exc:
            self.drops.drop(who, exc)
            return
        self.last_seen[c.identity or identity] = time.monotonic()
        if kind is m.Kind.HEARTBEAT:
            c.last_beat = msg
        elif kind is m.Kind.WARN:
            log.warning("%s", msg.message)
        elif kind in _FROM_CONTROLLERS:
            self.events.append(Received(identity, kind, msg, frames[1:]))
        else:
            self.drops.drop(who, f"a {kind.name} message, which controllers do not send")

    def _hello(self, identity: bytes, header: Any, legacy: bool = False) -> None:
        """A HELLO from a new peer: queued during start-up, refused (and logged) otherwise.

        ``header`` is the HELLO without its kind byte; ``legacy``: it came as protocol 2 sent
        it (kind and header in two frames), and the refusal goes back in that form.
        """
        try:
            version = m.hello_protocol(header)
            reason = (
                f"this controller speaks protocol {version}, the driver speaks {m.PROTOCOL_VERSION}; "
                "run the same yatt-graph version on the driver and every controller"
            )
            hello = (
                m.decode_header(m.Kind.HELLO.frame + bytes(header))[1]
                if version == m.PROTOCOL_VERSION and not legacy
                else None
            )
        except m.ProtocolError as exc:
            self.drops.drop("the driver socket", exc)
            return
        if hello is not None and not self.started:
            self.events.append(Received(identity, m.Kind.HELLO, hello, []))
            return
        if hello is not None:
            reason = f"the run has started; all {len(self.controllers)} controllers have joined"
        refused = m.encode_header(m.Refused(reason))
        if legacy:
            refused = [refused[0][:1], refused[0][1:]]
        with contextlib.suppress(zmq.ZMQError):
            self.router.send_multipart([identity, *refused])
        if not self.started and self.reporting:
            self.events.append(HelloRefused(identity, reason))
        else:
            self.drops.drop("the driver socket", f"refused a HELLO: {reason}")

    def close(self) -> None:
        """Stop the heartbeat thread (the context, destroyed by the run's clean-up, closes the socket)."""
        self._stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=2.0)
        if self.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.router.disable_monitor()
