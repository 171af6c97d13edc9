"""Who may talk to a run: loopback by default, CURVE between hosts, no pickle on the wire.

The CURVE test runs on 127.0.0.1 only. ~8 s (one executor start).
"""

from __future__ import annotations

import ast
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
from zmq_graphs import assert_gone

from runtime.cli import main
from runtime.codec import DecodeError, UnsupportedValueError, decode_value, encode_value
from runtime.engine.engine import LocalExecutor
from runtime.errors import HandshakeError
from runtime.zmq import messages as m
from runtime.zmq.controller import Controller
from runtime.zmq.driver import ZmqExecutor
from runtime.zmq.keys import KeysError, generate_keys, is_loopback, load_keys
from yatt_graph.refs import load_graph

ROOT = Path(__file__).resolve().parents[2]


# --- addresses ----------------------------------------------------------------------------
def test_loopback_addresses():
    for address in (
        "tcp://127.0.0.1:5555",
        "tcp://127.3.2.1:1",
        "tcp://[::1]:5555",
        "tcp://localhost:9",
    ):
        assert is_loopback(address), address
    for address in (
        "tcp://0.0.0.0:5555",
        "tcp://*:5555",
        "tcp://10.0.0.7:1",
        "tcp://eth0:5555",
        "tcp://[::]:1",
    ):
        assert not is_loopback(address), address  # fmt: skip


def test_binding_a_non_loopback_address_needs_allow_remote(capsys):
    plan = load_graph("graphs.toy").plan(2)
    for address in ("tcp://0.0.0.0:5999", "tcp://*:5999", "tcp://192.168.7.7:5999"):
        with pytest.raises(ValueError, match="not a loopback address.*allow_remote=True"):
            ZmqExecutor(plan, address=address, allow_tcp=True)
    with pytest.raises(ValueError, match="allow_tcp"):  # tcp at all is an opt-in
        ZmqExecutor(plan, address="tcp://127.0.0.1:5999")
    code = main(["run", "graphs.toy", "--controllers", "2", "--listen", "tcp://0.0.0.0:5999", "--quiet"])  # fmt: skip
    assert code == 2 and "--allow-remote" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--allow-remote"):  # a controller joining another host
        Controller("tcp://10.255.255.1:5999", 0)


# --- keys -----------------------------------------------------------------------------------
def test_keys_command_writes_private_secret_files_and_refuses_to_overwrite(tmp_path, capsys):
    keys = tmp_path / "keys"
    assert main(["keys", str(keys)]) == 0
    assert "driver.key_secret" in capsys.readouterr().out
    for name in ("driver.key_secret", "controller.key_secret"):
        assert stat.S_IMODE((keys / name).stat().st_mode) == 0o600
    assert (keys / "authorized" / "controller.key").is_file()
    driver, controller = load_keys(keys, "driver"), load_keys(keys, "controller")
    assert driver.driver_public == controller.driver_public == driver.public
    assert controller.controller_public == controller.public != driver.public
    assert main(["keys", str(keys)]) == 2
    assert "already holds keys" in capsys.readouterr().err
    (keys / "controller.key_secret").unlink()
    with pytest.raises(KeysError, match="controller.key_secret is missing; create keys"):
        load_keys(keys, "controller")


def _client(ctx, address, server_key, keypair=None):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        public, secret = keypair or zmq.curve_keypair()
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = (
            public,
            secret,
            server_key,
        )
    sock.connect(address)
    sock.send_multipart(m.encode_header(m.Hello(m.PROTOCOL_VERSION, -1, 1, "x", "ipc://x")))
    return sock


@pytest.mark.timeout(60)
def test_with_curve_only_peers_holding_the_keys_get_in(tmp_path, caplog):
    keys = generate_keys(tmp_path / "keys")
    reference = LocalExecutor(load_graph("graphs.toy", seed=1).plan(1)).run(4)
    ex = ZmqExecutor(
        load_graph("graphs.toy", seed=1).plan(2),
        address="tcp://127.0.0.1:*",
        allow_tcp=True,
        keys=keys,
    )
    ctx = zmq.Context()
    try:
        assert ex.address.startswith("tcp://127.0.0.1:") and not ex.address.endswith("*")
        results = ex.run(2)  # the spawned controllers hold the controller keys: they got in
        server = ex.keys.driver_public
        with caplog.at_level(logging.WARNING, logger="yatt_graph.runtime"):
            plain = _client(ctx, ex.address, None)  # no CURVE at all
            stranger = _client(ctx, ex.address, server)  # CURVE, a key of its own
            trusted = load_keys(keys, "controller")
            member = _client(ctx, ex.address, server, (trusted.public, trusted.secret))
            results += ex.run(2)
            assert member.poll(5000), "a peer with the controller key reaches the driver"
            [head] = member.recv_multipart()
            reply = m.decode_header(head)
            assert reply[0] is m.Kind.REFUSED and "the run has started" in reply[1].reason
            assert not plain.poll(300) and not stranger.poll(300)  # never heard, never answered
        assert ex.group.res.auth.denied >= 1
        assert "refused a CURVE client" in caplog.text
    finally:
        ex.close()
        ctx.destroy(linger=0)
    for ref, got in zip(reference, results, strict=True):
        assert torch.equal(ref.outputs["scores"], got.outputs["scores"])
    assert_gone(ex.pids, ex.run_dir)


# --- no pickle ------------------------------------------------------------------------------
class Opaque:
    def __reduce__(self):  # what pickle would call to rebuild it elsewhere
        return (os.system, ("echo pwned",))


def test_the_codec_refuses_arbitrary_objects_and_never_unpickles(monkeypatch):
    for value in (Opaque(), {"x": [Opaque()]}, {1, 2}, print):
        with pytest.raises(UnsupportedValueError, match="pickle is off|cannot be sent"):
            encode_value(value, where="node 'n' output 'o'")
    import pickle

    def no_pickle(*args, **kwargs):
        raise AssertionError("the decoder must never unpickle")

    monkeypatch.setattr(pickle, "loads", no_pickle)
    monkeypatch.setattr(pickle, "Unpickler", no_pickle)
    payload = pickle.dumps(Opaque.__reduce__(Opaque()))
    for code in range(0, 10):
        frames = [msgspec.msgpack.encode(msgspec.msgpack.Ext(code, payload))]
        with pytest.raises(DecodeError):
            decode_value(frames)
    # A Struct named by the sender is looked up among modules already imported, never imported.
    sneaky = [msgspec.msgpack.encode(msgspec.msgpack.Ext(3, msgspec.msgpack.encode(["antigravity:X", {}])))]  # fmt: skip
    with pytest.raises(DecodeError, match="neither registered nor imported"):
        decode_value(sneaky)
    assert "antigravity" not in sys.modules


def test_no_wire_module_imports_pickle_or_loads_torch_files():
    banned = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
    wire = sorted(p for d in ("zmq", "codec", "ranks") for p in (ROOT / "runtime" / d).glob("*.py"))
    assert {p.stem for p in wire} >= {"encode", "decode", "messages", "transport", "group"}
    for path in wire:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = {a.name.split(".")[0] for a in node.names} & banned
            elif isinstance(node, ast.ImportFrom):
                found = {(node.module or "").split(".")[0]} & banned
            elif isinstance(node, ast.Attribute) and node.attr == "load":
                found = {"torch.load"} if getattr(node.value, "id", "") == "torch" else set()
            else:
                continue
            assert not found, f"{path.relative_to(ROOT)} uses {found} (line {node.lineno})"


@pytest.mark.timeout(60)
def test_a_controller_with_other_curve_keys_is_reported_on_both_sides(tmp_path, capsys, caplog):
    ours, theirs = generate_keys(tmp_path / "ours"), generate_keys(tmp_path / "theirs")
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    failure: list[BaseException] = []

    def drive() -> None:
        try:
            ZmqExecutor(load_graph("graphs.toy").plan(1), spawn=False, address=address,
                        allow_tcp=True, keys=ours, startup_timeout_s=8)  # fmt: skip
        except BaseException as exc:
            failure.append(exc)

    with caplog.at_level(logging.WARNING, logger="yatt_graph.runtime"):
        driver = threading.Thread(target=drive)
        driver.start()
        # zmq retries the connection until the driver listens; the handshake then fails
        code = Controller(address, 0, keys=str(theirs), startup_timeout_s=20).serve()
        driver.join(timeout=30)
    assert code == 3 and "the CURVE handshake with the driver" in capsys.readouterr().err
    [exc] = failure
    assert isinstance(exc, HandshakeError) and "failed the CURVE handshake" in str(exc)
    assert "a peer whose handshake failed" in caplog.text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_a_controller_with_no_driver_says_whom_it_waits_for_and_gives_up_clearly(capsys):
    address = f"tcp://127.0.0.1:{_free_port()}"  # nobody listens there
    assert Controller(address, 0, startup_timeout_s=1.0).serve() == 3
    err = capsys.readouterr().err
    assert f"waiting for the driver at {address} (up to 1s" in err  # said at once
    assert f"error: no SETUP from the driver at {address} within 1s (--startup-timeout)" in err


@pytest.mark.timeout(60)
def test_the_controller_command_takes_the_startup_timeout_it_documents():
    address = f"tcp://127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "runtime.cli", "controller", "--connect", address,
           "--index", "0", "--startup-timeout", "1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=50)
    assert done.returncode == 3, done.stderr
    assert "within 1s (--startup-timeout)" in done.stderr


@pytest.mark.timeout(60)
def test_a_no_spawn_driver_says_whom_it_waits_for_at_once():
    address = f"tcp://127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "runtime.cli", "run", "graphs.toy", "--controllers", "2",
           "--no-spawn", "--listen", address, "--steps", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stderr.readline() for _ in range(2)]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    expected = f"waiting up to 120 s for 2 controllers at {address}; start each (I = 0..1) with"
    assert expected in lines[1], lines
    assert f"`yatt-graph controller --connect {address} --index I`" in lines[1]


@pytest.mark.timeout(120)
def test_the_default_address_is_ipc_in_a_folder_only_this_user_can_open():
    with ZmqExecutor(load_graph("graphs.toy").plan(2)) as ex:
        assert ex.address.startswith("ipc://")
        assert ex.address.removeprefix("ipc://").startswith(str(ex.run_dir))
        assert stat.S_IMODE(os.stat(ex.run_dir).st_mode) == 0o700
        ex.run(1)
    assert_gone(ex.pids, ex.run_dir)
