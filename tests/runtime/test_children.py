"""The runtime's child processes (runtime/children.py): the one fault class of a process that
died (``ProcessFault``), the one style of message to and from a child (tagged Structs), and
the one liveness rule (a child exits when its parent is gone; a dead child is told the same
way whatever its kind)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest
import torch
from sample_nodes import Sum

from runtime.children import (
    PARENT_GONE_EXIT,
    ChildMessage,
    Messages,
    python_env,
    start_child,
    stop,
)
from runtime.engine.engine import LocalExecutor
from runtime.errors import ControllerError, HandshakeError, ProcessFault, ProtocolError
from runtime.ranks.group import TO_RANK, RankCall, RankClose, RankError
from runtime.train.loop import train_with_restarts
from runtime.zmq import messages as m
from runtime.zmq.replicas import ReplicaDied, ReplicaProcess
from yatt_graph import NodeExecutionError
from yatt_graph.refs import load_graph

# --- one restartable fault ------------------------------------------------------------------------


def test_every_process_fault_is_one_class():
    for cls in (ControllerError, HandshakeError, ReplicaDied, RankError):
        assert issubclass(cls, ProcessFault)
    fault = RankError("node 'update': rank 1 (pid 7) was killed by SIGKILL (9)")
    assert fault.controller == -1 and fault.nodes == []
    assert not hasattr(fault, "process_fault")  # told by its class, not an attribute


class DiesOnce(LocalExecutor):
    """The toy graph in process, whose node call fails once, at step ``fail_at``, with
    ``cause`` as a replica or rank it ran on would make it fail."""

    def __init__(self, fail_at, cause, failed):
        super().__init__(load_graph("graphs.toy", seed=2))
        self.fail_at, self.cause, self.failed = fail_at, cause, failed

    def step(self):
        if self.next_step == self.fail_at and not self.failed:
            self.failed.append(True)
            raise NodeExecutionError("update", "the call failed") from self.cause
        return super().step()


@pytest.mark.parametrize(
    "cause",
    [
        RankError("node 'update': rank 1 (pid 7) was killed by SIGKILL (9)"),
        ReplicaDied("replica 1 of node 'rollout' (pid 8) exited with code 17"),
    ],
)
def test_a_node_call_ended_by_a_process_fault_restarts_the_run(tmp_path, cause, capsys):
    failed: list[bool] = []

    def make():
        return DiesOnce(4, cause, failed)

    rows, restarts = train_with_restarts(
        make, 6, tmp_path / "run", checkpoint_every=3, restart="on-failure", progress=False
    )
    assert restarts == 1 and failed == [True]
    assert [r["step"] for r in rows] == list(range(6))
    assert "restarting the run (1 of at most" in capsys.readouterr().err


def test_a_node_call_ended_by_its_own_error_is_not_restarted(tmp_path):
    def make():
        return DiesOnce(1, ValueError("bug"), [])

    with pytest.raises(NodeExecutionError, match="the call failed"):
        train_with_restarts(make, 3, tmp_path / "run", restart="on-failure", progress=False)


# --- one style of message -------------------------------------------------------------------------


def test_child_messages_round_trip_with_their_tag_first():
    call = m.ReplicaCall({"step": 3}, [4, 5])
    wire = m.TO_REPLICA.encode(call)
    assert msgspec.msgpack.decode(wire)[0] == "call"
    assert m.TO_REPLICA.decode(wire) == call
    command = RankCall("run", 2, b"head", [8, 0])
    assert TO_RANK.decode(TO_RANK.encode(command)) == command
    assert isinstance(TO_RANK.decode(TO_RANK.encode(RankClose())), RankClose)


@pytest.mark.parametrize(
    ("messages", "wire", "said"),
    [
        (m.TO_REPLICA, m.FROM_REPLICA.encode(m.ReplicaDone()), "Invalid value 'done'"),
        (m.FROM_REPLICA, m.TO_REPLICA.encode(m.ReplicaStop()), "Invalid value 'stop'"),
        (TO_RANK, m.TO_REPLICA.encode(m.ReplicaStop()), "Invalid value 'stop'"),
        (m.TO_REPLICA, msgspec.json.encode({"op": "call"}), "Expected `array`"),
        (TO_RANK, msgspec.msgpack.encode(["call", "step"]), "Expected `array` of at least"),
        (m.FROM_REPLICA, b"\xc1garbage", "MessagePack"),
    ],
)
def test_a_wrong_or_unknown_message_is_refused_naming_what_was_expected(messages, wire, said):
    with pytest.raises(ProtocolError) as caught:
        messages.decode(wire)
    text = str(caught.value)
    assert f"a message to {messages.to} that is none of {', '.join(messages.tags)}" in text
    assert said in text and "both ends must run the same yatt-graph" in text


def test_a_link_of_one_kind_still_checks_the_tag():
    class Ping(ChildMessage, tag="ping"):
        pass

    class Pong(ChildMessage, tag="pong"):
        pass

    pings = Messages("a test child", Ping)
    assert pings.decode(Messages.encode(Ping())) == Ping()
    with pytest.raises(ProtocolError, match="none of ping"):
        pings.decode(Messages.encode(Pong()))


@pytest.mark.timeout(120)
def test_a_replica_process_answers_a_message_it_does_not_know_with_an_error_and_goes_on():
    node = Sum(name="sum")
    replica = ReplicaProcess(node, 0)
    try:
        replica.sock.send(msgspec.json.encode({"op": "call"}))  # the old style: refused
        reply = m.FROM_REPLICA.decode(replica.sock.recv())
        assert isinstance(reply, m.ReplicaFailed)
        assert "ProtocolError: a message to a replica process that is none of" in reply.message
        out = replica.call(node, {"x": torch.ones(2, 3)}, None, [0, 1])
        assert out["total"].tolist() == [3.0, 3.0]
    finally:
        replica.close()


# --- one liveness rule ----------------------------------------------------------------------------

# Runs PARENT (a script that starts one child and prints {"pid": ...}), SIGKILLs it, and waits
# for the orphaned child as its subreaper (Linux prctl), so its exit code can be read: the
# line it prints is {"pid", "parent", "code"} (code None: still running after 120 s).
REAPER = """
import ctypes, json, os, signal, subprocess, sys, time
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER: orphans come to this process
    raise SystemExit("prctl(PR_SET_CHILD_SUBREAPER) failed")
with open(sys.argv[2], "wb") as err:
    parent = subprocess.Popen(
        [sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, stderr=err, text=True
    )
line = parent.stdout.readline()
if not line:
    raise SystemExit(f"the parent did not start (exit {parent.wait()})")
info = {**json.loads(line), "parent": parent.pid, "code": None}
os.kill(parent.pid, signal.SIGKILL)
parent.wait()
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    pid, status = os.waitpid(info["pid"], os.WNOHANG)
    if pid:
        info["code"] = os.waitstatus_to_exitcode(status)
        break
    time.sleep(0.05)
else:
    os.kill(info["pid"], signal.SIGKILL)
print(json.dumps(info), flush=True)
"""

PARENTS = {
    "plain": """
import json, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", (
    "import os, time\\n"
    "from runtime.children import exit_with_parent\\n"
    "exit_with_parent(os.getppid(), 'a test child')\\n"
    "print('watching', flush=True)\\n"
    "time.sleep(600)\\n"
)], stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(json.dumps({"pid": child.pid}), flush=True)
time.sleep(600)
""",
    "controller": """
import json, time
from runtime.zmq.driver import ZmqExecutor
from yatt_graph.refs import load_graph
ex = ZmqExecutor(load_graph("graphs.toy").plan(1))
ex.run(1)
print(json.dumps({"pid": ex.pids[0], "dir": ex.run_dir}), flush=True)
time.sleep(600)
""",
    "replica": """
import json, os, time
from sample_nodes import Sum
from runtime.zmq.replicas import ReplicaProcess
replica = ReplicaProcess(Sum(name="sum"), 0)
print(json.dumps({"pid": replica.pid, "dir": replica.dir}), flush=True)
time.sleep(600)
""",
    "rank": """
import json, time, torch
torch.set_num_threads(1)
from nodes.update import GRPOUpdate
from runtime.ranks.group import start_groups
node = GRPOUpdate(ranks=2)
start_groups({"update": node})
node.setup()
print(json.dumps({"pid": node.trainer.group.procs[0].pid}), flush=True)
time.sleep(600)
""",
}


def _orphan(kind: str, tmp_path) -> tuple[dict, str]:
    """Start a ``kind`` child under a parent, SIGKILL the parent; how the child ended, and
    what the parent's and the child's stderr said."""
    tests = str(Path(__file__).resolve().parents[1])  # sample_nodes
    root = str(Path(__file__).resolve().parents[2])
    temp = tempfile.mkdtemp(prefix="yt-")  # short: socket paths have a length limit
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, root]), "TMPDIR": temp}
    err = tmp_path / "stderr"
    try:
        done = subprocess.run(
            [sys.executable, "-c", REAPER, PARENTS[kind], str(err)],
            capture_output=True, text=True, env=env, timeout=280,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr + err.read_text()
        info = json.loads(done.stdout.splitlines()[-1])
        said = err.read_text()
        for log in glob.glob(os.path.join(info.get("dir", temp), "*.log")):
            said += Path(log).read_text()
        return info, said
    finally:
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.skipif(sys.platform != "linux", reason="reaping an orphan needs Linux's prctl")
@pytest.mark.timeout(300)
def test_a_child_that_watches_its_parent_exits_when_the_parent_is_killed(tmp_path):
    info, said = _orphan("plain", tmp_path)
    assert info["code"] == PARENT_GONE_EXIT, info
    assert f"a test child: the parent process (pid {info['parent']}) is gone; exiting" in said


@pytest.mark.skipif(sys.platform != "linux", reason="reaping an orphan needs Linux's prctl")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["controller", "replica", "rank"])
def test_every_kind_of_child_exits_when_its_parent_is_killed(kind, tmp_path):
    info, said = _orphan(kind, tmp_path)
    assert info["code"] is not None, f"the {kind} (pid {info['pid']}) outlived its parent"
    if kind == "replica":  # it waits on its socket: only the parent watch can end it
        assert info["code"] == PARENT_GONE_EXIT, info
        assert f"the parent process (pid {info['parent']}) is gone; exiting" in said


@pytest.mark.timeout(60)
def test_a_dead_child_is_told_the_same_way_whatever_its_kind(tmp_path):
    log = tmp_path / "child.log"
    child = start_child(
        "runtime.zmq.replica_main", ["--no-such-flag"], python_env(), "replica 2 of node 'x'",
        str(log),
    )  # fmt: skip
    child.popen.wait(timeout=50)
    assert child.dead() == f"replica 2 of node 'x' (pid {child.pid}) exited with code 2"
    tail = child.log_tail()
    assert f"--- last lines of replica 2 of node 'x' (pid {child.pid})'s output ---" in tail
    assert "the following arguments are required: --parent-pid" in tail
    waits = ["--connect", f"ipc://{tmp_path}/none", "--parent-pid", str(os.getpid())]
    running = start_child("runtime.zmq.replica_main", waits, python_env(), "rank 1")
    try:  # it waits for a peer that never comes
        assert running.dead() == "" and running.returncode is None
        running.popen.kill()
        running.popen.wait(timeout=50)
        assert running.dead() == f"rank 1 (pid {running.pid}) was killed by SIGKILL (9)"
    finally:
        stop([running])
