"""This host's share of a run that spans hosts: its controller processes, started, watched, stopped.

Every host of such a run starts its own controllers (:class:`HostShare`); they join the driver
on node 0 over tcp (with CURVE keys between hosts), as ``yatt-graph controller`` does by hand,
and listen for their peers' data on this host's address (``data_host``, else the interface
that routes to the driver). The driver waits for all of them (``ZmqExecutor(spawn=False)``),
so a controller is watched there by its heartbeats, wherever it runs.

:func:`start_host` is ``yatt-graph run``'s side: given the launch (:func:`runtime.flags.resolve_launch`), it
checks it, says it in one line, and starts this host's share.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from runtime.children import exit_text, python_env, start_python, stop
from runtime.flags import Launch, LaunchError, RunSpec, controller_shares
from runtime.zmq import STARTUP_TIMEOUT_S

__all__ = ["HostRun", "HostShare", "check_listen", "resolve_ipv4", "start_host"]


def resolve_ipv4(host: str, who: str) -> str:
    """``host`` (a name or an IPv4 address) as an IPv4 address; ValueError naming ``who``."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(
            f"{who} {host!r} does not resolve to an IPv4 address on this host ({exc.strerror}); "
            "pass an address (--master 10.0.0.1:PORT, MASTER_ADDR=10.0.0.1)"
        ) from None
    return str(infos[0][4][0])


def check_listen(ip: str, port: int, who: str) -> None:
    """That the driver can listen on ``ip:port`` here (the address is this host's and the
    port is free): ValueError saying which, before anything starts."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, port))
        except OSError as exc:
            hint = (
                "the port is taken: pick another one"
                if exc.errno == 98  # EADDRINUSE
                else "it is not an address of this host: node rank 0 runs the driver, so the "
                "master must be node 0's own address"
            )
            raise ValueError(
                f"{who}: the driver cannot listen on {ip}:{port} ({exc.strerror}); {hint}"
            ) from None


class HostShare:
    """The controllers of one host (``indices``), started at once; they join the driver at
    ``connect`` and wait for it (``startup_timeout_s``).

    Each is ``python -m runtime.zmq.controller_main`` with this process's ``sys.path``, watching
    this process (``--parent-pid``: it exits when this process does) and ignoring Ctrl-C (the
    driver stops the run; :meth:`stop` ends what is left).
    """

    def __init__(
        self,
        indices: Sequence[int],
        connect: str,
        *,
        keys_dir: str | None,
        allow_remote: bool,
        data_host: str | None = None,
        preload: Sequence[str] = (),
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        max_message_bytes: int | None = None,
        label: str = "",
        forward_sigterm: bool = False,
    ):
        self.indices, self.connect, self.label = list(indices), connect, label
        self._old_sigterm: Any = None
        self._stopping = False
        if forward_sigterm and threading.current_thread() is threading.main_thread():
            # srun and torchrun stop a job with SIGTERM: pass it on, and wait() reports them
            self._old_sigterm = signal.signal(signal.SIGTERM, lambda *_: self.terminate())
        env = python_env()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        try:
            for index in self.indices:
                if self._stopping:  # SIGTERM while starting them: start no more
                    break
                args = [
                    "--connect", connect,
                    "--index", str(index), "--parent-pid", str(os.getpid()), "--spawned",
                    "--startup-timeout", str(startup_timeout_s),
                    *(["--keys", keys_dir] if keys_dir else []),
                    *(["--allow-remote"] if allow_remote else []),
                    *(["--bind", f"tcp://{data_host}:*"] if data_host else []),
                    *(["--max-message-bytes", str(max_message_bytes)] if max_message_bytes else []),
                    *(arg for ref in preload for arg in ("--preload", ref)),
                ]  # fmt: skip
                self.procs[index] = start_python("runtime.zmq.controller_main", args, env)
        except BaseException:
            self.stop(grace_s=0)
            self._restore_sigterm()
            raise

    @property
    def pids(self) -> dict[int, int]:
        """Controller index -> process id."""
        return {i: p.pid for i, p in self.procs.items()}

    def terminate(self) -> None:
        """SIGTERM to every controller still running (and start no more)."""
        self._stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()

    def wait(self) -> int:
        """Wait until every controller here has exited; 0 if all ended cleanly, else 1 (each
        failure said on stderr, naming the controller)."""
        failed = []
        try:
            for index, proc in self.procs.items():
                code = proc.wait()
                if code != 0:
                    failed.append(
                        f"controller {index} (pid {proc.pid}{self.label}) {exit_text(code)}"
                    )
        finally:
            self.stop(grace_s=0)
            self._restore_sigterm()
        for line in failed:
            print(f"yatt-graph run: {line}", file=sys.stderr, flush=True)
        return 1 if failed else 0

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def stop(self, grace_s: float = 10.0) -> None:
        """Give the controllers ``grace_s`` to exit (after the driver's SHUTDOWN they do), then
        terminate, then kill what is left."""
        stop(self.procs.values(), grace_s)


# --- yatt-graph run -------------------------------------------------------------------------- -----------------------------------------------------------------------
@dataclass
class HostRun:
    """What ``yatt-graph run`` does on this host of a run across hosts."""

    launch: Launch
    share: HostShare
    """This host's controllers."""
    spec: RunSpec
    """The run, on node 0 with the driver listening at the master address for every
    controller."""

    @property
    def runs_driver(self) -> bool:
        return self.launch.node_rank == 0


def start_host(spec: RunSpec, launch: Launch) -> HostRun:
    """For ``yatt-graph run`` across hosts (``launch``, of two nodes or more): say it in one
    line, check it, and start this host's controllers; on node 0 the run's driver listens at
    the master address and waits for every controller (:attr:`HostRun.spec`). LaunchError for
    anything that cannot work (before a process starts); the flags that cannot go with a launch
    are refused before (:func:`runtime.flags.run_spec`)."""
    from runtime.zmq.keys import is_loopback, load_keys  # zmq: only when a launch is asked for

    given = spec.launch
    shares = controller_shares(given.controllers, launch.nnodes)
    try:
        ip = resolve_ipv4(launch.host, "the master")
        if ip.startswith("127.") and not is_loopback(f"tcp://{launch.host}:0"):
            raise ValueError(
                f"the master {launch.host!r} resolves to {ip} here, a loopback address, so the "
                "other nodes cannot reach the driver; give node 0's address on the network the "
                "nodes share"
            )
        address = f"tcp://{ip}:{launch.port}"
        data_host = resolve_ipv4(given.data_host, "--data-host") if given.data_host else None
        if data_host == "0.0.0.0":
            raise ValueError("--data-host 0.0.0.0: give the address peers reach this host at")
        remote = not is_loopback(address) or (
            data_host is not None and not data_host.startswith("127.")
        )
        if remote and not given.keys:
            raise ValueError(
                f"the driver's address {address} is not a loopback address, so the run needs CURVE "
                "keys: make them with `yatt-graph keys DIR`, give every host the folder, and pass "
                "--keys DIR on every node"
            )
        if given.keys:
            load_keys(given.keys, "controller")
            if launch.node_rank == 0:
                load_keys(given.keys, "driver")
        if launch.node_rank == 0:
            check_listen(ip, launch.port, "node 0")
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    mine = shares[launch.node_rank]
    role = (
        "the driver and controllers" if launch.node_rank == 0 else "controllers"
    ) + f" {', '.join(map(str, mine))} run here"
    if launch.node_rank > 0:
        role += "; the driver on node 0 writes the metrics and checkpoints"
    if launch.node_rank == 0:
        here = msgspec.structs.replace(
            given, listen=address, spawn=False, allow_remote=given.allow_remote or remote
        )
        spec = msgspec.structs.replace(spec, launch=here)
    share = HostShare(
        mine, address, keys_dir=given.keys, allow_remote=remote, data_host=data_host,
        preload=(spec.graph.ref,), max_message_bytes=spec.engine.max_message_bytes,
        label=f" on node {launch.node_rank}", forward_sigterm=launch.node_rank > 0,
    )  # fmt: skip
    print(f"yatt-graph run: {launch.describe()}: {role}", file=sys.stderr, flush=True)
    return HostRun(launch, share, spec)
