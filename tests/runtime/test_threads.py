"""The thread policy of a run (runtime/sched/devices.py): how many torch threads, and whether
idle OpenMP threads spin, from what the cores are doing at start."""

import json
import os
import subprocess
import sys
import time

import pytest

from runtime.sched.devices import SPIN_COUNT, busy_elsewhere, decide, openmp_env


def test_an_idle_machine_gets_a_thread_per_core_and_spinning_threads():
    policy = decide(2, 0.1, env={})
    assert (policy.threads, policy.spin) == (2, True)
    assert "1.9 of 2 cores free" in policy.describe()
    assert policy.metrics() == {"sched/threads": 2.0, "sched/spin": 1.0}


@pytest.mark.parametrize(("busy", "threads"), [(2.0, 1), (1.6, 1), (1.0, 1), (0.4, 2)])
def test_cores_other_processes_keep_busy_are_left_to_them(busy, threads):
    policy = decide(2, busy, env={})
    assert policy.threads == threads
    assert policy.spin is (threads > 1)  # one thread has no team to keep warm


def test_a_run_that_shares_its_cores_with_its_own_processes_does_not_spin():
    policy = decide(4, 0.0, shared=True, env={})
    assert (policy.threads, policy.spin) == (4, False)
    assert "share the cores" in policy.reason


def test_the_user_decides_over_the_measurement():
    assert decide(2, 2.0, threads=2, env={}).threads == 2  # --threads
    assert decide(8, 0.0, env={"OMP_NUM_THREADS": "3"}).threads == 3
    assert decide(2, 0.0, env={"OMP_WAIT_POLICY": "passive"}).spin is False
    assert decide(2, 2.0, threads=2, env={"OMP_WAIT_POLICY": "ACTIVE"}).spin is True
    assert decide(2, 0.0, env={"GOMP_SPINCOUNT": "0"}).spin is False
    # not measurable (not Linux): every core counts as free
    assert decide(2, None, env={}).threads == 2


def test_the_wait_policy_travels_in_the_environment_and_keeps_a_users():
    spin = openmp_env({"PATH": "/bin"}, spin=True)
    assert spin["GOMP_SPINCOUNT"] == str(SPIN_COUNT) and "OMP_WAIT_POLICY" not in spin
    sleep = openmp_env(spin, spin=False)  # a replica started by a spinning run
    assert sleep["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in sleep
    assert openmp_env(spin, spin=None) == spin  # a controller inherits the run's choice
    assert openmp_env({}, spin=None)["OMP_WAIT_POLICY"] == "PASSIVE"  # no choice made: sleep
    users = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert openmp_env(users, spin=False) == users


@pytest.mark.timeout(30)
def test_a_busy_process_on_a_core_is_measured_there():
    core = sorted(os.sched_getaffinity(0))[-1]
    loop = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"]
    )
    try:
        time.sleep(0.3)
        busy = busy_elsewhere([core], window_s=0.2)
    finally:
        loop.kill()
        loop.wait()
    assert busy is not None and busy >= 0.7  # the loop's core, whatever else runs there


def test_a_moment_of_work_elsewhere_is_not_a_busy_core(monkeypatch):
    """The least of the windows counts: a burst in one window (a shell command) is not a core
    someone keeps busy; a core busy in every window is."""
    import runtime.sched.devices as threads

    def measure(busy_per_window):  # ticks of 2 cores, 10 a window each (0.1 s at 100 Hz)
        ticks = iter([(0, 0)] + [(sum(busy_per_window[: i + 1]), 20 * (i + 1)) for i in range(3)])
        monkeypatch.setattr(threads, "_cpu_ticks", lambda cores: next(ticks))
        monkeypatch.setattr(threads.time, "sleep", lambda s: None)
        monkeypatch.setattr(threads.os, "times", lambda: (0.0, 0.0, 0.0, 0.0, 0.0))
        return busy_elsewhere([0, 1], window_s=0.1)

    assert measure([20, 0, 0]) == 0.0  # both cores busy in the first window only
    assert measure([20, 20, 20]) == 2.0  # busy all along
    assert measure([10, 12, 10]) == 1.0  # one core all along


@pytest.mark.timeout(120)
def test_a_run_logs_its_thread_policy_once_and_puts_it_in_the_metrics(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "YATT_OPENMP")}
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "runtime.cli", "run", "graphs.toy", "--steps", "2", "--quiet"]
    proc = subprocess.run(
        [*cmd, "--out", str(out)], env=env, capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "threads:" in line]
    assert len(lines) == 1 and "cores free" in lines[0], proc.stderr
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert f"{int(row['sched/threads'])} torch thread" in lines[0]
    assert ("spinning" in lines[0]) is (row["sched/spin"] == 1.0)


@pytest.mark.timeout(60)
def test_the_command_decides_threads_before_torch_loads():
    """``yatt-graph`` imports no torch before its run measures the cores: the driver's own
    OpenMP setting is still the run's to make."""
    code = "import sys, runtime.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("busy", [0.0, 2.0])
def test_controllers_get_the_policy_the_run_says_though_this_process_loaded_torch(
    monkeypatch, busy
):
    """Controllers start after the policy and inherit it from the environment, so a driver
    whose torch is loaded (a caller's) still gives them the wait policy it reports."""
    import runtime.sched.devices as devices

    assert "torch" in sys.modules  # (the suite's)
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "YATT_OPENMP", "OMP_NUM_THREADS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(devices, "busy_elsewhere", lambda cores: busy)
    policy = devices.run_policy([0, 1], threads=None, shared=False, controllers=True)
    assert policy.spin is (busy == 0.0)
    assert os.environ["YATT_OPENMP"] == ("spin" if policy.spin else "passive")
