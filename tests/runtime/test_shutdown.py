"""No controller process and no file outlives a run: success, node error, Ctrl-C, a killed driver.

Each test starts processes, so each has a hard timeout; ~30 s in all on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import zmq_graphs
from zmq_graphs import assert_gone, controller_processes, default_sigint

from runtime.zmq.driver import ZmqExecutor
from runtime.zmq.processes import OWNER_FILE, remove_stale_runs
from yatt_graph import NodeExecutionError
from yatt_graph.refs import load_graph

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(60)
def test_no_children_after_success():
    with ZmqExecutor(load_graph("graphs.toy").plan(2)) as ex:
        assert len(controller_processes()) == 2
        ex.run(2)
        pids, run_dir = ex.pids, ex.run_dir
        assert os.path.isdir(run_dir)
    assert_gone(pids, run_dir)
    assert controller_processes() == []


@pytest.mark.timeout(60)
def test_no_children_after_a_node_error():
    with (
        pytest.raises(NodeExecutionError),
        ZmqExecutor(zmq_graphs.build_graph("boom", fail_at=0).plan(2)) as ex,
    ):
        pids, run_dir = ex.pids, ex.run_dir
        ex.run(3)
    assert_gone(pids, run_dir)
    assert controller_processes() == []


def _start_driver():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([HERE, os.getcwd(), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", "import zmq_graphs; zmq_graphs.drive()"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        preexec_fn=default_sigint,
    )
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"the driver did not start: {proc.stderr.read()}")
    return proc, json.loads(line)


@pytest.mark.timeout(60)
def test_sigint_to_the_driver_stops_everything():
    proc, info = _start_driver()
    try:
        assert len(info["pids"]) == 2 and os.path.isdir(info["run_dir"])
        time.sleep(0.3)  # mid-run
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=20)
        assert proc.returncode != 0
        assert "KeyboardInterrupt" in stderr
        assert_gone(info["pids"], info["run_dir"], timeout_s=15)
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def own_temp_dir(monkeypatch):
    """A temp folder of this test's for the runs' socket folders, in the driver it starts and
    in this process: a run that starts in another test at the same time (a second pytest
    worker) sweeps the default temp folder and would remove the killed driver's folder first."""
    parent = tempfile.mkdtemp(prefix="yt-")  # short: socket paths have a length limit
    monkeypatch.setenv("TMPDIR", parent)
    monkeypatch.setattr(tempfile, "tempdir", parent)
    yield parent
    shutil.rmtree(parent, ignore_errors=True)


@pytest.mark.timeout(60)
def test_controllers_exit_on_their_own_when_the_driver_is_killed(own_temp_dir):
    proc, info = _start_driver()
    assert os.path.dirname(info["run_dir"]) == own_temp_dir
    try:
        proc.kill()  # SIGKILL: no clean-up runs in the driver
        proc.wait()
        assert_gone(info["pids"], timeout_s=15)  # they notice the parent is gone
        assert os.path.isdir(info["run_dir"])  # a SIGKILLed driver cannot remove its folder
        with ZmqExecutor(load_graph("graphs.toy").plan(1)) as ex:  # the next run does
            assert not os.path.exists(info["run_dir"])
            ex.run(1)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(info["run_dir"], ignore_errors=True)


def test_only_folders_of_dead_drivers_are_removed(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid is now one of no process (pids are not reused this soon)
    dead, alive, other = tmp_path / "yatt-dead", tmp_path / "yatt-alive", tmp_path / "yatt-other"
    for folder, pid in ((dead, child.pid), (alive, os.getpid())):
        folder.mkdir()
        (folder / OWNER_FILE).write_text(str(pid))
    other.mkdir()  # no owner file: not a run folder, left alone
    assert remove_stale_runs(str(tmp_path)) == [str(dead)]
    assert alive.is_dir() and other.is_dir() and not dead.exists()
