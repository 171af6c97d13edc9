"""The one way the runtime starts, talks to, watches, describes and stops its Python child
processes: controllers, replica processes and training ranks.

Each is ``python -m MODULE ...``, a plain subprocess (never a fork of a process that has torch
loaded), which imports what its parent imports (:func:`python_env`: the parent's ``sys.path``
and the folders of graph files loaded by path) and reads no stdin.

**One liveness rule.** On the child's side, every entry point calls :func:`exit_with_parent`
with the pid it was given: a daemon thread checks every :data:`WATCH_S` that this pid is
still its parent, and once it is not (the parent ended, however, even by SIGKILL: the child
is then re-parented), the child says so on stderr and exits with :data:`PARENT_GONE_EXIT`,
unless an orderly close of its own ends it first (a controller tells its compute thread to
shut down, which ends its own children in turn). A thread that polls ``os.getppid()`` is
chosen over Linux's ``prctl(PR_SET_PDEATHSIG)``: the death signal fires when the *thread*
that started the child ends (a runtime thread that spawned a replica, say), not the process,
so it could kill a child whose parent lives; it works on Linux only; and a signal would skip
the controller's orderly close. On the parent's side a child is a :class:`Child`: its
``Popen``, its label and its log; :meth:`Child.dead` says whether it ended and how
(:func:`exit_text`), :meth:`Child.log_tail` what it said last, in the same words for every
kind. What watches it differs only in *when* it looks: the driver polls its controllers'
children between messages (and heartbeats tell it of a controller on another host, or one
hung outside Python: network liveness, not process death), a replica is looked at while a
reply is awaited, a rank group's supervisor thread looks every 0.1 s. Every child is stopped
the same way (:func:`stop`).

**One style of message.** What the runtime says to a child it talks to directly (a replica
process, a training rank) and back is a :class:`ChildMessage`: a small msgspec Struct per
kind, tagged, in msgpack, decoded by the :class:`Messages` of the receiving end, which refuses
any other kind with a :class:`~runtime.errors.ProtocolError` (the controllers' protocol,
:mod:`runtime.zmq.messages`, is Structs too, with a kind byte in front for routing).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Union

import msgspec

from runtime.errors import ProtocolError

__all__ = [
    "PARENT_GONE_EXIT",
    "WATCH_S",
    "Child",
    "ChildMessage",
    "Messages",
    "exit_text",
    "exit_with_parent",
    "log_tail",
    "python_env",
    "start_child",
    "start_python",
    "stop",
]

WATCH_S = 0.2
"""How often a child checks that its parent is still there."""

PARENT_GONE_EXIT = 3
"""The exit code of a child that left because its parent was gone."""


def python_env(threads: int = 0) -> dict[str, str]:
    """This process's environment with ``PYTHONPATH`` set so that a child imports what this
    process imports, and ``OMP_NUM_THREADS`` when ``threads`` > 0."""
    from yatt_graph.refs import import_roots

    paths = [p or os.getcwd() for p in sys.path] + import_roots()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def start_python(
    module: str, args: Sequence[str], env: Mapping[str, str], log_path: str = ""
) -> subprocess.Popen[bytes]:
    """``python -m module args`` in this folder; its output to ``log_path`` when given (else
    this process's)."""
    log: Any = open(log_path, "wb") if log_path else None  # noqa: SIM115 - the child holds it
    try:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT if log else None, env=dict(env), cwd=os.getcwd(),
        )  # fmt: skip
    finally:
        if log is not None:
            log.close()


class Child:
    """A child process as its parent sees it: the ``Popen``, ``label`` (what it is to the user:
    ``controller 1``, ``replica 0 of node 'rollout'``, ``rank 1``) and ``log_path`` (where its
    output goes; '' when it shares the parent's)."""

    def __init__(self, popen: subprocess.Popen[bytes], label: str, log_path: str = "") -> None:
        self.popen, self.label, self.log_path = popen, label, log_path
        self.pid = popen.pid

    @property
    def returncode(self) -> int | None:
        """Its exit code (negative: the signal that ended it), None while it runs."""
        return self.popen.poll()

    def dead(self) -> str:
        """'' while it runs, else how it ended, naming it: ``rank 1 (pid 123) was killed by
        SIGKILL (9)``."""
        code = self.popen.poll()
        return "" if code is None else f"{self.label} (pid {self.pid}) {exit_text(code)}"

    def log_tail(self, chars: int = 3000) -> str:
        """The end of its log (:func:`log_tail`), '' when it has none."""
        return log_tail(self.log_path, f"{self.label} (pid {self.pid})", chars)


def start_child(
    module: str, args: Sequence[str], env: Mapping[str, str], label: str, log_path: str = ""
) -> Child:
    """:func:`start_python`, as a :class:`Child` called ``label``."""
    return Child(start_python(module, args, env, log_path), label, log_path)


def exit_with_parent(
    parent_pid: int, who: str, on_gone: Callable[[], None] | None = None
) -> threading.Thread:
    """The child's side of the one liveness rule (see the module doc): from now on this
    process exits (:data:`PARENT_GONE_EXIT`) within :data:`WATCH_S` of ``parent_pid`` no
    longer being its parent. ``on_gone``, when given, runs first, in the watching thread, and
    may take its time: it starts an orderly exit and returns when that had its chance."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCH_S)
        with contextlib.suppress(Exception):  # stderr may be a pipe the parent held: broken
            print(f"{who}: the parent process (pid {parent_pid}) is gone; exiting", file=sys.stderr)
            sys.stderr.flush()
        if on_gone is not None:
            with contextlib.suppress(Exception):
                on_gone()
        os._exit(PARENT_GONE_EXIT)

    thread = threading.Thread(target=watch, daemon=True, name="parent-watch")
    thread.start()
    return thread


def exit_text(code: int | None) -> str:
    """How a child ended, from its return code: ``exited with code 1``, ``was killed by
    SIGKILL (9)``; ``is running`` for None."""
    if code is None:
        return "is running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name} ({-code})"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def log_tail(path: str, who: str, chars: int = 3000) -> str:
    """The last ``chars`` of a child's log, headed with ``who``; '' when there is none."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            text = f.read().decode(errors="replace").strip()
    except OSError:
        return ""
    return f"\n--- last lines of {who}'s output ---\n{text}" if text else ""


def stop(procs: Iterable[Child | subprocess.Popen[bytes]], grace_s: float = 0.0) -> None:
    """Give the children ``grace_s`` to exit by themselves, then SIGTERM, then SIGKILL what is
    left 2 s later."""
    procs = [p.popen if isinstance(p, Child) else p for p in procs]
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5.0)


# --- messages -------------------------------------------------------------------------------------


class ChildMessage(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A message between the runtime and a child it talks to directly (a replica process over
    its PAIR socket, a training rank through rank 0's store). Each kind is a small subclass
    with a short ``tag``, the first element of its msgpack array; a link's :class:`Messages`
    decodes the kinds it may receive and refuses any other."""


_encoder = msgspec.msgpack.Encoder()


class Messages:
    """The kinds of :class:`ChildMessage` that one end of a link receives (``to``: who that
    end is, for errors), and the one codec of such messages."""

    def __init__(self, to: str, *kinds: type[ChildMessage]) -> None:
        self.to = to
        self.tags = [str(k.__struct_config__.tag) for k in kinds]
        self._decoder = msgspec.msgpack.Decoder(Union[kinds])  # noqa: UP007 - a runtime tuple

    @staticmethod
    def encode(message: ChildMessage) -> bytes:
        return _encoder.encode(message)

    def decode(self, frame: Any) -> Any:
        """The message in ``frame``; :class:`~runtime.errors.ProtocolError` if it is not one of
        this end's kinds."""
        try:
            return self._decoder.decode(frame)
        except msgspec.DecodeError as exc:
            raise ProtocolError(
                f"a message to {self.to} that is none of {', '.join(self.tags)} ({exc}); "
                "both ends must run the same yatt-graph"
            ) from None
