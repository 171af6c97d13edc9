"""The controllers of one ZeroMQ run as the driver holds them: started, joined, watched, stopped.

:class:`Controllers` starts the controller processes (or waits for ones started by hand),
admits their HELLOs, sends SETUP and waits for READY; then it is how the executor talks to
them (:meth:`~Controllers.next_event`, :attr:`~Controllers.link`) and how it learns
that one died or went silent (a local controller that exits is noticed within 50 ms, a
silent one within ``heartbeat_timeout_s``). :meth:`~Controllers.shutdown` stops them
all and removes the run's files, whatever happened before.
"""

from __future__ import annotations

import os
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from runtime.errors import ControllerError, HandshakeError, NodeTimeoutError
from runtime.interrupts import interrupts_held
from runtime.sched.devices import Resources
from runtime.zmq import STARTUP_TIMEOUT_S
from runtime.zmq import messages as m
from runtime.zmq.driver_link import DriverLink, HelloRefused, Received
from runtime.zmq.keys import start_authenticator
from runtime.zmq.processes import (
    ControllerProc,
    RunCleanup,
    remove_stale_runs,
    spawn_controllers,
)
from runtime.zmq.transport import DEFAULT_MAX_MESSAGE_BYTES
from yatt_graph import NodeBuildError, NodeExecutionError, NodeUsageError

__all__ = ["Controllers", "error_from"]


class Controllers:
    """``count`` controllers and the driver's socket; started at once, so that they import
    torch (and ``preload``: the graph's module) while the driver still builds the graph.

    :meth:`attach` then gives them their nodes (``owned[c]``: controller c's), ``when()``
    (where the run is, for error messages) and ``running()`` (whether steps have been
    allowed: a controller lost before is a :class:`HandshakeError`).
    """

    def __init__(
        self,
        count: int,
        *,
        address: str | None = None,
        keys: Any = None,
        keys_dir: str | None = None,
        spawn: bool = True,
        controller_output: str = "capture",
        num_threads: int = 0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        heartbeat_interval_s: float = 0.5,
        heartbeat_timeout_s: float = 5.0,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        shutdown_grace_s: float = 5.0,
        preload: tuple[str, ...] = (),
        resources: Sequence[Resources] | None = None,
    ):
        """The options are :class:`~runtime.zmq.driver.ZmqExecutor`'s, with its defaults.
        ``resources`` (one per controller; :func:`runtime.zmq.options.plan_resources`) set each
        spawned controller's GPUs and thread count in its environment; SETUP applies them
        (and, for a group started without them, the executor's) in any case."""
        self.controllers = [ControllerProc(c, []) for c in range(count)]
        self.heartbeat_timeout_s, self.startup_timeout_s = heartbeat_timeout_s, startup_timeout_s
        self.shutdown_grace_s = shutdown_grace_s
        self.when: Callable[[], str] = lambda: "during start-up"
        self.running: Callable[[], bool] = lambda: False
        self.attached = False
        self.closed = False
        self._last_check = 0.0
        remove_stale_runs()
        self.run_dir = tempfile.mkdtemp(prefix="yatt-")
        self.res = RunCleanup(self.run_dir, os.path.basename(self.run_dir) if spawn else "")
        self._finalizer = weakref.finalize(self, self.res.cleanup)
        try:
            ctx = self.res.ctx = zmq.Context()
            if keys is not None:
                self.res.auth = start_authenticator(ctx, keys)
            self.link = DriverLink(
                ctx, address or f"ipc://{self.run_dir}/driver", self.controllers,
                keys=keys, max_message_bytes=max_message_bytes,
                heartbeat_interval_s=heartbeat_interval_s, stop=self.res.io_stop,
                reporting=not spawn,
            )  # fmt: skip
            self.res.io_thread = self.link.thread
            self.address = self.link.address
            if spawn:
                spawn_controllers(
                    self.controllers, self.res, address=self.address, run_dir=self.run_dir,
                    output=controller_output, num_threads=num_threads,
                    startup_timeout_s=startup_timeout_s, max_message_bytes=max_message_bytes,
                    keys_dir=keys_dir, preload=preload, resources=list(resources or ()),
                )  # fmt: skip
        except BaseException:
            self.shutdown("start-up failed")
            raise

    def attach(
        self, owned: list[list[str]], when: Callable[[], str], running: Callable[[], bool]
    ) -> None:
        """The run these controllers serve: each one's nodes, and the run's progress."""
        if self.attached or len(owned) != len(self.controllers):
            raise ValueError(
                f"ZmqExecutor: a group of {len(self.controllers)} controllers "
                f"{'already serves a run' if self.attached else f'cannot run a plan for {len(owned)}'}"
            )
        for c, nodes in zip(self.controllers, owned, strict=True):
            c.nodes = list(nodes)
        self.when, self.running, self.attached = when, running, True

    def start(self, setup: Callable[[ControllerProc], m.Setup]) -> None:
        """Admit every controller, send each its SETUP, wait until all are READY."""
        deadline = time.monotonic() + self.startup_timeout_s
        while any(c.state is m.State.STARTING for c in self.controllers):
            event = self.next_event(deadline, "to connect")
            if event is None:
                continue
            if event.kind is m.Kind.HELLO:
                self._admit(event.identity, event.msg)
            elif event.kind is m.Kind.ERROR:
                raise error_from(event.msg, self.controllers)
        for c in self.controllers:
            self.link.send_control(c, setup(c))
        while any(c.state is not m.State.READY for c in self.controllers):
            event = self.next_event(deadline, "to build their nodes")
            if event is None:
                continue
            if event.kind is m.Kind.READY:
                c = self.link.by_identity[event.identity]
                c.state, c.resources = m.State.READY, event.msg.resources
            elif event.kind is m.Kind.ERROR:
                raise error_from(event.msg, self.controllers)
        self.link.started = True

    def _admit(self, identity: bytes, hello: m.Hello) -> None:
        free = [c for c in self.controllers if c.state is m.State.STARTING]
        if hello.controller >= 0:
            match = [c for c in free if c.index == hello.controller]
            reason = f"controller index {hello.controller} is taken or not in 0..{len(self.controllers) - 1}"
        else:
            match, reason = free[:1], f"all {len(self.controllers)} controllers have joined"
        if not match:
            self.link.send_to(identity, m.Refused(reason))
            return
        c = match[0]
        if c.child is not None and hello.pid != c.child.pid:
            self.link.send_to(
                identity, m.Refused(f"controller {c.index} was started as pid {c.child.pid}")
            )
            return
        if not hello.work_identity or hello.work_identity in self.link.by_identity:
            self.link.send_to(identity, m.Refused("the HELLO has no usable work_identity"))
            return
        self.link.join(c, identity, hello)

    # --- waiting, liveness ------------------------------------------------------------------
    def next_event(
        self, deadline: float | None, waiting_for: str, spin_s: float = 0.0
    ) -> Received | None:
        """The next message from a controller, or None; raises if a controller is lost (or,
        past ``deadline``, if some did not manage ``waiting_for``)."""
        event = self.link.next_event(spin_s)
        if isinstance(event, HelloRefused):
            raise HandshakeError(
                f"a controller could not join the driver at {self.address}: {event.reason}"
            )
        if event is None:  # what a controller sent before it died is read first
            self.check_alive()
        if deadline is not None and time.monotonic() > deadline and event is None:
            late = [c for c in self.controllers if c.state is not m.State.READY]
            failed = self.link.handshake_failures
            keys = (
                f"; {failed} peer(s) failed the CURVE handshake: controllers started with "
                "another --keys folder, or none?"
                if failed
                else ""
            )
            raise HandshakeError(
                f"controllers {[c.index for c in late]} did not manage {waiting_for} within "
                f"{self.startup_timeout_s:.0f}s (startup_timeout_s){keys}"
                + "".join(c.log_tail() for c in late),
                late[0].index,
                late[0].nodes,
            )
        return event

    def check_alive(self) -> None:
        now = time.monotonic()
        if now - self._last_check < 0.05:  # waitpid per controller: not on every message
            return
        self._last_check = now
        for c in self.controllers:
            dead = c.child.dead() if c.child is not None else ""
            if dead and c.state is not m.State.STOPPED:
                c.state = m.State.FAILED
                cls = ControllerError if self.running() else HandshakeError
                raise cls(
                    f"{dead} {self.when()}; it owned nodes {c.nodes}{c.doing()}" + c.log_tail(),
                    c.index,
                    c.nodes,
                )
            seen = self.link.last_seen.get(c.identity or b"")
            if (
                c.state is m.State.READY
                and seen is not None
                and now - seen > self.heartbeat_timeout_s
            ):
                c.state = m.State.FAILED
                raise ControllerError(
                    f"controller {c.index} (pid {c.pid}) has sent nothing for {now - seen:.1f}s "
                    f"(heartbeat_timeout_s={self.heartbeat_timeout_s}) {self.when()}; it owned nodes "
                    f"{c.nodes}{c.doing()}; it is dead, hung outside Python, or its host is "
                    "unreachable",
                    c.index,
                    c.nodes,
                )

    # --- the end ----------------------------------------------------------------------------
    def shutdown(self, reason: str) -> None:
        """SHUTDOWN to every controller, then terminate/kill after the grace period; remove
        the run's folder and shared memory. Idempotent."""
        if self.closed:
            return
        self.closed = True
        with interrupts_held():
            try:
                link = getattr(self, "link", None)
                for c in self.controllers if link is not None else ():
                    if c.identity is not None and c.state is not m.State.STOPPED:
                        link.send_control(c, m.Shutdown(reason))
                        c.state = m.State.STOPPING
                if link is not None and not self.res.procs:
                    time.sleep(0.2)  # remote controllers: let the IO thread deliver SHUTDOWN
            finally:
                self.res.cleanup(grace_s=self.shutdown_grace_s)
                self._finalizer.detach()


def error_from(err: m.Error, controllers: list[ControllerProc]) -> Exception:
    """The exception a controller's ERROR stands for: a node's failure or timeout names the
    node, anything else the controller and its nodes."""
    if err.during == "timeout":
        return NodeTimeoutError(
            err.node, err.message, err.traceback, step=err.step, controller=err.controller,
            during="timeout", seconds=err.seconds, limit_s=err.limit_s,
        )  # fmt: skip
    if err.during == "build":
        return NodeBuildError(err.node, err.message, err.traceback, controller=err.controller)
    if err.during == "data":
        return NodeUsageError(
            err.node, err.message, err.traceback, step=err.step, controller=err.controller,
            during="data",
        )  # fmt: skip
    if err.node and err.during in ("step", "setup", "send", "state"):
        message = err.message
        if err.during in ("setup", "state") and err.traceback:  # a send error says it all
            message += f"\n--- traceback on controller {err.controller} ---\n{err.traceback}"
        return NodeExecutionError(
            err.node, message, err.traceback, step=err.step, controller=err.controller,
            during=err.during,
        )  # fmt: skip
    nodes = controllers[err.controller].nodes if 0 <= err.controller < len(controllers) else []
    return ControllerError(
        f"controller {err.controller} failed ({err.during}): {err.message}\n{err.traceback}",
        err.controller,
        nodes,
    )
