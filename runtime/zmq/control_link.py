"""A controller's IO thread: the control link to the driver, heartbeats, and the watchdog.

The thread owns the control DEALER (heartbeats both ways, SHUTDOWN). It watches the node call
in progress (the engine's :class:`~runtime.engine.calls.Running`): a call past its time limit
is reported as an ERROR with the stack it is stuck in (the driver then stops the run); a call
without a limit that runs far past its usual time gets one WARN with its stack (the run goes
on). It ends the process if the driver goes silent (heartbeats: the network liveness of a
controller, which may run on another host) or, when the controller's parent watch
(:func:`runtime.children.exit_with_parent`) says so, the driver process is gone
(:meth:`ControlLink.driver_gone`); after SHUTDOWN or either loss it gives a node stuck in a
call :data:`EXIT_GRACE_S` before the process exits anyway.

What the compute thread must act on reaches it as a typed event (:class:`ShutdownRequested`,
:class:`IoFailed`) through :meth:`ControlLink.events` and a wake-up on an ``inproc://`` pair.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.utils.monitor

from runtime.engine.calls import Running
from runtime.zmq import messages as m
from runtime.zmq.transport import Drops, recv, send

__all__ = [
    "EXIT_GRACE_S",
    "ControlLink",
    "IoFailed",
    "ShutdownRequested",
    "hang_threshold",
    "thread_stacks",
    "wait_for_setup",
    "wait_for_shutdown",
]

EXIT_GRACE_S = 2.0
"""After SHUTDOWN (or a lost driver), how long a node stuck in a call may delay the exit."""


@dataclass(frozen=True)
class ShutdownRequested:
    """The driver said SHUTDOWN, or it is gone: stop."""

    reason: str
    driver_lost: bool = False


@dataclass(frozen=True)
class IoFailed:
    """The IO thread broke (nothing reaches the driver any more); its traceback."""

    traceback: str


def hang_threshold(longest_s: float | None, fixed_s: float = 0.0) -> float:
    """How long a call without a time limit may run before it is reported as possibly hung:
    ``fixed_s`` when set, else ``max(60 s, 10 x`` the node's longest earlier call), 300 s for
    a first call (which may compile or warm caches)."""
    if fixed_s > 0:
        return fixed_s
    return 300.0 if longest_s is None else max(60.0, 10.0 * longest_s)


class ControlLink:
    """The IO thread of a controller (see the module docstring).

    Args:
        ctx: the process's zmq context; driver: the control DEALER (owned by this thread once
            :meth:`start` is called).
        engine: the compute thread's :class:`~runtime.engine.engine.StepEngine` (its call in
            progress, the steps it reported, its nodes and fan-outs), read from this thread;
            compute: the compute thread's ident (for the stack a call is stuck in).
        longest: node -> its longest finished call so far, in seconds (None before the first).
        on_exit: called just before ``os._exit`` when the compute thread does not stop in time.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        driver: zmq.Socket,
        index: int,
        setup: m.Setup,
        *,
        engine: Any,
        compute: int,
        longest: Callable[[str], float | None],
        on_exit: Callable[[], None],
        drops: Drops,
    ):
        self.driver, self.index, self.setup = driver, index, setup
        self.engine, self.compute, self.longest = engine, compute, longest
        self.on_exit = on_exit
        self.drops = drops
        self.events: collections.deque[ShutdownRequested | IoFailed] = collections.deque()
        address = f"inproc://wake-{id(self)}"
        self.wake = ctx.socket(zmq.PAIR)
        self.wake.bind(address)
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(address)
        self.driver_lost = False
        self._gone: str | None = None  # set from the parent watch: why the driver is gone
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="yatt-io", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def driver_gone(self, why: str) -> None:
        """From any thread: the driver is gone (its process ended); this thread shuts the
        controller down as for a silent driver, at its next heartbeat."""
        self._gone = why

    def stop(self, timeout_s: float = 1.0) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _post(self, event: ShutdownRequested | IoFailed) -> None:
        self.events.append(event)
        with contextlib.suppress(zmq.ZMQError):  # a full pipe: it is awake already
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def _loop(self) -> None:
        try:
            self._watch()
        except Exception:
            self._post(IoFailed(traceback.format_exc()))

    def _watch(self) -> None:
        poller = zmq.Poller()
        poller.register(self.driver, zmq.POLLIN)
        config = self.setup.config
        interval, timeout = config.heartbeat_interval_s, config.heartbeat_timeout_s
        next_beat, last_driver = 0.0, time.monotonic()
        # after SHUTDOWN or a lost driver: the compute thread's deadline
        exit_by: float | None = None
        reported: set[Running] = set()  # calls already reported (timeout or warning)
        while not self._stopped.is_set():
            now = time.monotonic()
            if exit_by is not None and now > exit_by:
                self.on_exit()
                os._exit(0)  # the compute thread is stuck in a node; nobody waits for it
            call = self.engine.running
            if call is not None and call not in reported and exit_by is None:
                self._check_call(call, now, reported)
            if now >= next_beat:
                next_beat = now + interval
                if exit_by is None:
                    send(self.driver, self._heartbeat(call, now))
                    why = self._gone  # the parent watch said so on stderr
                    if now - last_driver > timeout:
                        why = f"the driver has been silent for {now - last_driver:.1f}s"
                        print(
                            f"yatt-graph controller {self.index}: {why}; exiting", file=sys.stderr
                        )
                    if why:
                        self.driver_lost = True  # nobody to say GOODBYE to: no linger
                        self._post(ShutdownRequested(why, driver_lost=True))
                        exit_by = now + EXIT_GRACE_S
            if poller.poll(max(1, min(100, int((next_beat - now) * 1000)))):
                last_driver = time.monotonic()
                if self._receive():
                    exit_by = time.monotonic() + EXIT_GRACE_S

    def _receive(self) -> bool:
        """One message on the control link (which carries no data limit); True for SHUTDOWN."""
        if (got := _next(self.driver, self.drops, wait_ms=0)) is None:
            return False
        kind, msg = got
        if kind is m.Kind.SHUTDOWN:
            self._post(ShutdownRequested(msg.reason))
            return True
        if kind is not m.Kind.HEARTBEAT:
            self.drops.drop("the driver link", f"a {kind.name} message on the control link")
        return False

    def _heartbeat(self, call: Running | None, now: float) -> m.Heartbeat:
        if call is None:
            return m.Heartbeat(self.index, self.engine.reported)
        return m.Heartbeat(
            self.index, self.engine.reported, call.node, now - call.started, call.step
        )

    def _check_call(self, call: Running, now: float, reported: set[Running]) -> None:
        """An ERROR (with the stack it is stuck in) for a call past its limit, which stops the
        run; a WARN for a call without one that runs far past its usual time."""
        seconds, limit = now - call.started, call.limit_s
        if limit > 0:
            if seconds > limit:
                reported.add(call)
                own = self.setup.config.node_timeout_s != limit
                source = "its BatchPolicy.timeout_s" if own else "the run's node_timeout_s"
                why = (
                    f", over {source} of {limit:g}s; the run was stopped. It is hung (a deadlock, "
                    "a stuck collective, an endless generate) or needs more time: raise "
                    "BatchPolicy(timeout_s=...) on the node, or --node-timeout / node_timeout_s"
                )
                message, stack = self._long_call(call, seconds, "was", why)
                error = m.Error(
                    self.index, message, call.node, call.step, stack, "timeout", seconds, limit
                )
                send(self.driver, error)
            return
        longest = self.longest(call.node)
        if seconds > hang_threshold(longest, self.setup.config.hang_warning_s):
            reported.add(call)
            usual = (
                f"its calls so far took at most {longest:.2f}s"
                if longest is not None
                else "it is its first call"
            )
            why = (
                f" ({usual}); it may be hung. The run goes on; to stop such a call instead, give "
                "the run a limit (yatt-graph run --node-timeout SECONDS, or "
                "BatchPolicy(timeout_s=...) on the node)"
            )
            message, _ = self._long_call(call, seconds, "is", why)
            send(self.driver, m.Warn(self.index, message, call.node, call.step))

    def _long_call(self, call: Running, seconds: float, verb: str, why: str) -> tuple[str, str]:
        """The message about a call that has run ``seconds`` (``why`` goes on from there), with
        the stack it ``verb`` in; and that stack."""
        name, fanouts = call.node, self.engine.fanouts
        stack = thread_stacks(self.compute, fanouts is not None and name in fanouts.split_nodes)
        what = f"node {name!r} ({type(self.engine.nodes[name]).__name__})"
        message = (
            f"{what} on controller {self.index} has run step {call.step} for {seconds:.1f}s{why}"
        )
        if stack:
            message += f"\n--- where node {name!r} {verb}, on controller {self.index} ---\n{stack}"
        return message, stack


def thread_stacks(ident: int | None, workers: bool) -> str:
    """The stack of thread ``ident`` and, with ``workers``, of the fan-out's worker threads."""
    from runtime.sched.fanout import THREAD_PREFIX

    frames = sys._current_frames()
    frame = frames.get(ident or -1)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
    if workers:
        for t in threading.enumerate():
            worker = frames.get(t.ident or -1)
            if t.name.startswith(THREAD_PREFIX) and worker is not None:
                stack += f"--- {t.name.removeprefix('yatt-')} ---\n"
                stack += "".join(traceback.format_stack(worker))
    return stack


def wait_for_setup(
    driver: zmq.Socket,
    connect: str,
    curve: bool,
    timeout_s: float,
    *,
    monitor: zmq.Socket | None,
    drops: Drops,
) -> m.Setup | None:
    """After HELLO, on the control link: the driver's SETUP, or None (refused, shut down,
    a failed CURVE handshake seen on ``monitor``, or nothing within ``timeout_s``: each said
    on stderr with what to check)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if monitor is not None and monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(monitor)
            print(
                f"yatt-graph controller: error: the CURVE handshake with the driver at "
                f"{connect} failed (zmq event {event['event']}): the driver holds other "
                "keys, or none; use the run's --keys folder on the driver and every "
                "controller (`yatt-graph keys DIR` makes one)",
                file=sys.stderr,
            )
            return None
        if (got := _next(driver, drops)) is None:
            continue
        kind, msg = got
        if kind is m.Kind.REFUSED:
            print(
                f"yatt-graph controller: the driver refused this controller: {msg.reason}",
                file=sys.stderr,
            )
            return None
        if kind is m.Kind.SETUP:
            return msg
        if kind is m.Kind.SHUTDOWN:
            return None
    hint = (
        " It uses CURVE keys: do the driver and this controller use the same --keys folder? "
        "(A driver holding other keys drops this controller's handshake and logs it.)"
        if curve
        else " If the driver was started with --keys, pass --keys DIR here too."
        if connect.startswith("tcp://")
        else ""
    )
    print(
        f"yatt-graph controller: error: no SETUP from the driver at {connect} within "
        f"{timeout_s:.0f}s (--startup-timeout); is the driver running and "
        f"listening there?{hint}",
        file=sys.stderr,
    )
    return None


def _next(driver: zmq.Socket, drops: Drops, wait_ms: int = 200) -> tuple[m.Kind, Any] | None:
    """The next message on the driver link: None when none came in ``wait_ms`` or it was
    dropped."""
    if not driver.poll(wait_ms):
        return None
    try:
        _, kind, msg, _ = recv(driver)
    except m.ProtocolError as exc:
        drops.drop("the driver link", exc)
        return None
    return kind, msg


def wait_for_shutdown(driver: zmq.Socket, drops: Drops) -> None:
    """After a failed start-up: wait (60 s at most) for the driver's SHUTDOWN (a spawned
    controller's parent watch ends the process sooner if the driver is gone)."""
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        if (got := _next(driver, drops)) is not None and got[0] is m.Kind.SHUTDOWN:
            return
