"""Who may talk to a run: the address rules and ZeroMQ CURVE keys.

Addresses. A run listens on ``ipc://`` in a fresh ``0700`` temporary folder by default, so
only this user's processes can connect. ``tcp://`` needs an explicit opt-in
(``allow_tcp``); a tcp address that is not loopback (``127.x.x.x``, ``::1``,
``localhost``) needs a second one (``allow_remote``, ``yatt-graph run --allow-remote``),
because then other hosts can reach the sockets. :func:`check_address` applies both.

Keys. ``yatt-graph keys DIR`` (:func:`generate_keys`) writes two CURVE key pairs made with
``zmq.curve_keypair`` in ZeroMQ's certificate format (``zmq.auth``)::

    DIR/driver.key              the driver's public key         every host
    DIR/driver.key_secret       the driver's key pair           the driver's host only
    DIR/controller.key          the controllers' public key     every host
    DIR/controller.key_secret   the controllers' key pair       every controller host
    DIR/authorized/             public keys allowed to connect (controller.key)

With ``keys=DIR`` every runtime socket uses CURVE (encrypted, authenticated): the driver's
ROUTER and each controller's data socket are CURVE servers, and a ZAP authenticator
(``zmq.auth.thread.ThreadAuthenticator``) in each process admits only clients whose public
key is in ``DIR/authorized``. A peer without the keys never completes the handshake: its
messages never reach the runtime. Secret files are written ``0600``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.utils.z85

from yatt_graph import UsageError

__all__ = [
    "CurveKeys",
    "KeysError",
    "check_address",
    "generate_keys",
    "is_loopback",
    "load_keys",
    "start_authenticator",
]


class KeysError(UsageError):
    """Keys that are missing, unreadable or of the wrong kind; says which file and what to do."""


class CurveKeys(msgspec.Struct, frozen=True):
    """The CURVE material one process needs."""

    role: str
    """``"driver"`` or ``"controller"``."""
    public: bytes
    """This process's public key (Z85)."""
    secret: bytes
    """This process's secret key (Z85)."""
    driver_public: bytes
    """The server key of the driver's socket."""
    controller_public: bytes
    """The server key of every controller's data socket."""
    authorized: str
    """Folder of public keys whose holders may connect."""


def is_loopback(address: str) -> bool:
    """Whether a ``tcp://HOST:PORT`` address binds only this host's loopback interface."""
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name, a host name: reachable from elsewhere


def check_address(address: str, *, allow_tcp: bool, allow_remote: bool, who: str) -> None:
    """Refuse an address the caller did not opt in to; ValueError says which flag opts in."""
    if address.startswith(("ipc://", "inproc://")):
        return
    if not address.startswith("tcp://"):
        raise ValueError(f"{who}: {address!r} is not an ipc:// or tcp:// address")
    port = address.rsplit(":", 1)[-1] if address.count(":") >= 2 else ""
    if port != "*" and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(
            f"{who}: {address} needs a port from 1 to 65535 (or * for a free one): tcp://HOST:PORT"
        )
    if not allow_tcp:
        raise ValueError(
            f"{who}: {address} is a tcp address; pass allow_tcp=True to accept controllers over "
            "the network (with keys=DIR for CURVE authentication between hosts)"
        )
    if not is_loopback(address) and not allow_remote:
        raise ValueError(
            f"{who}: {address} is not a loopback address, so other hosts could connect; pass "
            "allow_remote=True (yatt-graph: --allow-remote) to bind it, and use CURVE keys "
            "(yatt-graph keys DIR; --keys DIR) so that only holders of the keys get in; "
            "tcp://127.0.0.1:PORT stays on this host"
        )


def generate_keys(directory: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Write a driver and a controller key pair (and ``authorized/``) into ``directory``."""
    from zmq.auth import create_certificates

    root = Path(directory)
    existing = [p.name for p in root.glob("*.key*")] if root.is_dir() else []
    if existing and not force:
        raise FileExistsError(
            f"{root} already holds keys ({', '.join(sorted(existing))}); pick an empty folder "
            "or pass --force to replace them (running controllers would then be refused)"
        )
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    authorized = root / "authorized"
    shutil.rmtree(authorized, ignore_errors=True)
    authorized.mkdir(mode=0o700)
    for name in ("driver", "controller"):
        for path in (root / f"{name}.key", root / f"{name}.key_secret"):
            path.unlink(missing_ok=True)
        public, secret = create_certificates(str(root), name)  # zmq.curve_keypair inside
        os.chmod(secret, 0o600)
        os.chmod(public, 0o644)
    shutil.copy(root / "controller.key", authorized / "controller.key")
    return root


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    from zmq.auth import load_certificate

    if not path.is_file():
        what = "key pair" if secret else "public key"
        raise KeysError(
            f"CURVE {what} {path} is missing; create keys with `yatt-graph keys {path.parent}` "
            "and copy the folder to every host (driver.key_secret stays on the driver's host)"
        )
    try:
        public, sec = load_certificate(str(path))
    except Exception as exc:
        raise KeysError(f"cannot read CURVE key {path}: {exc}") from exc
    if secret and not sec:
        raise KeysError(f"{path} holds no secret key; pass the folder `yatt-graph keys` wrote")
    return public, sec


def load_keys(directory: str | os.PathLike[str], role: str) -> CurveKeys:
    """The keys of ``role`` (``"driver"`` or ``"controller"``) from a ``yatt-graph keys`` folder."""
    if not zmq.has("curve"):
        raise KeysError("this libzmq was built without CURVE support; keys cannot be used")
    if role not in ("driver", "controller"):
        raise ValueError(f"role must be 'driver' or 'controller', got {role!r}")
    root = Path(directory)
    if not root.is_dir():
        raise KeysError(
            f"keys folder {root} does not exist; create it with `yatt-graph keys {root}`"
        )
    public, secret = _load(root / f"{role}.key_secret", secret=True)
    driver_public = public if role == "driver" else _load(root / "driver.key", False)[0]
    controller_public = public if role == "controller" else _load(root / "controller.key", False)[0]
    authorized = root / "authorized"
    if not authorized.is_dir() or not any(authorized.glob("*.key")):
        raise KeysError(f"{authorized} holds no public keys; run `yatt-graph keys {root}` again")
    assert secret is not None
    return CurveKeys(role, public, secret, driver_public, controller_public, str(authorized))


def start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> Any:
    """A ZAP handler for ``ctx`` admitting CURVE clients whose key is in ``keys.authorized``.

    Start it before any server socket binds; stop it (``.stop()``) before destroying ``ctx``.
    A refused client is logged (a warning naming its key) and counted in ``.denied``.
    """
    from zmq.auth.thread import ThreadAuthenticator

    class _Authenticator(ThreadAuthenticator):
        denied = 0

        async def _authenticate_curve(self, domain: str, client_key: bytes) -> Any:
            allowed, reason = await super()._authenticate_curve(domain, client_key)
            if not allowed:
                self.denied += 1
                log.warning(
                    "%s refused a CURVE client whose key %s is not in %s (%s)",
                    keys.role,
                    zmq.utils.z85.encode(client_key).decode(),
                    keys.authorized,
                    reason.decode(errors="replace"),
                )
            return allowed, reason

    auth = _Authenticator(ctx, log=_zap_log)
    auth.start()
    auth.configure_curve(domain="*", location=keys.authorized)
    return auth


log = logging.getLogger("yatt_graph.runtime")
_zap_log = logging.getLogger("yatt_graph.runtime.zap")
