"""Faults, injected: a controller SIGKILLed mid-step (with and without --restart on-failure), a
hung node, a killed driver, a corrupted checkpoint, garbage on the runtime sockets.

Every test starts processes, so each has a hard timeout and ends with none of them left.
About 60 s in all on 2 cores (each executor start costs 2-4 s, mostly importing torch).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
import zmq_graphs
from zmq_graphs import assert_gone, controller_processes

from runtime.cli import main
from runtime.engine.engine import LocalExecutor
from runtime.train.checkpoint import checkpoints
from runtime.train.metrics import read_metrics
from runtime.zmq import messages as m
from runtime.zmq.driver import ControllerError, NodeTimeoutError, ZmqExecutor
from yatt_graph import NodeExecutionError
from yatt_graph.refs import load_graph

HERE = Path(__file__).resolve().parent
# By module name: with tests/ on sys.path before tests/runtime/, yatt_graph.refs.load_module
# would import the file path as `runtime.zmq_graphs`.
GRAPHS = "zmq_graphs"
STEPS, SEED, BATCH = 12, 3, 16
LEARNING = ("step", "scores/mean", "scores/std", "loss", "samples_total")


def learning(rows):
    return [{k: r[k] for k in LEARNING} for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted in-process run of the seeded toy graph (what the ZeroMQ runs must match)."""
    out = tmp_path_factory.mktemp("reference")
    args = ["run", "graphs.toy", "--seed", str(SEED), "--steps", str(STEPS), "--out", str(out)]
    assert main([*args, "--quiet"]) == 0
    return learning(read_metrics(out))


def raw_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# --- a controller killed ------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_controller_killed_mid_step_is_named_with_its_nodes_within_5s():
    graph = zmq_graphs.build_graph("slow", sleep_s=0.05, sink_sleep_s=0.2)
    ex = ZmqExecutor(graph.plan(2))
    pids, run_dir = ex.pids, ex.run_dir
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(pids[1], signal.SIGKILL)  # inside the 0.2 s sink call of some step

    try:
        ex.run(1)
        threading.Timer(0.5, kill).start()
        with pytest.raises(ControllerError) as info:
            ex.run(100)
        noticed = time.monotonic() - killed_at[0]
    finally:
        ex.close()
    assert noticed < 5, f"the dead controller was noticed after {noticed:.1f}s"
    err = info.value
    assert err.controller == 1 and err.nodes == ["double"]
    assert "controller 1" in str(err) and "killed by SIGKILL (9)" in str(err)
    assert "while running step" in str(err) and "['double']" in str(err)
    assert_gone(pids, run_dir)


@pytest.mark.timeout(90)
def test_restart_on_failure_resumes_from_the_checkpoint_and_loses_or_repeats_no_sample(
    tmp_path, reference
):
    out, marker = tmp_path / "run", tmp_path / "killed"
    code = main(
        [
            "run", GRAPHS, "--set", "kind=toy_chaos", "--set", f"marker={marker}",
            "--set", "at_step=7", "--seed", str(SEED), "--steps", str(STEPS),
            "--controllers", "3", "--checkpoint-every", "3", "--restart", "on-failure",
            "--out", str(out), "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    assert marker.is_file(), "the chaos node should have killed its controller at step 7"
    rows = raw_rows(out)
    # Step accounting: every step once (the re-run steps replaced the lost ones), every sample once.
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["samples_total"] for r in rows] == [BATCH * (k + 1) for k in range(STEPS)]
    assert learning(rows) == reference  # the same run as an uninterrupted one
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert len(events) == 1 and events[0]["event"] == "restart"
    assert events[0]["controller"] == 1 and "chaos" in events[0]["nodes"]
    assert "killed by SIGKILL (9)" in events[0]["error"]
    assert [p.name for p in checkpoints(out)][-1] == f"step_{STEPS:06d}"
    assert controller_processes() == []


@pytest.mark.timeout(60)
def test_without_restart_a_killed_controller_stops_the_run_cleanly(tmp_path, capsys):
    out, marker = tmp_path / "run", tmp_path / "killed"
    code = main(
        [
            "run", GRAPHS, "--set", "kind=toy_chaos", "--set", "controllers=2",
            "--set", f"marker={marker}", "--set", "at_step=2", "--steps", "6",
            "--controllers", "2", "--out", str(out), "--quiet",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    assert "the run stopped: controller 1" in err and "killed by SIGKILL (9)" in err
    assert "chaos" in err and "Traceback" not in err
    assert controller_processes() == []
    # Each finished step once, in order, none from after the kill; whether step 1's report got
    # out of controller 1 before its SIGKILL depends on the load, so 1 or 2 steps.
    steps = [r["step"] for r in raw_rows(out)]
    assert steps in ([0], [0, 1])


# --- a node that hangs --------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("node_limit", "run_limit", "source"),
    [(1.0, 0.0, "its BatchPolicy.timeout_s of 1s"), (0.0, 1.0, "the run's node_timeout_s of 1s")],
    ids=["batch_policy", "run_default"],
)
def test_a_hung_node_is_reported_by_name_controller_and_step(node_limit, run_limit, source):
    graph = zmq_graphs.build_graph("hang", timeout_s=node_limit, fail_at=1)
    ex = ZmqExecutor(graph.plan(2), node_timeout_s=run_limit, shutdown_grace_s=3.0)
    pids, run_dir = ex.pids, ex.run_dir
    try:
        t0 = time.monotonic()
        with pytest.raises(NodeTimeoutError) as info:
            ex.run(3)
        elapsed = time.monotonic() - t0
    finally:
        ex.close()
    err = info.value
    assert elapsed >= 1.0  # the limit; how soon after it the report comes depends on the load
    assert err.node == "stuck" and err.context["step"] == 1 and err.context["controller"] == 1
    assert err.context["limit_s"] == 1.0 and err.context["seconds"] >= 1.0
    text = str(err)
    assert "node 'stuck' (Boom) on controller 1 has run step 1" in text and source in text
    assert "zmq_graphs.py" in text and "time.sleep" in text  # the stack it was stuck in
    assert_gone(pids, run_dir)  # a thread stuck in a node does not keep its process alive


# --- the driver killed --------------------------------------------------------------------
_DRIVER = """
import sys
from runtime.zmq.driver import ZmqExecutor
from yatt_graph import NodeExecutionError
from yatt_graph.refs import load_graph
ex = ZmqExecutor(load_graph("graphs.toy").plan(1), spawn=False,
                 address=sys.argv[1], heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)
ex.run(2)
print("running", flush=True)
ex.run(100000)
"""


@pytest.mark.timeout(60)
def test_a_controller_not_started_by_the_driver_exits_when_the_driver_is_killed(tmp_path):
    # Spawned controllers watch their parent (tests/runtime/test_shutdown.py); one started by
    # hand (`yatt-graph controller`) has only the driver's heartbeats to go by.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.getcwd()])}
    address = f"ipc://{tmp_path}/driver"
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, address], stdout=subprocess.PIPE, text=True, env=env
    )
    controller = subprocess.Popen(
        [sys.executable, "-m", "runtime.zmq.controller_main", "--connect", address, "--index", "0"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert driver.stdout.readline().strip() == "running"
        driver.kill()
        driver.wait()
        t0 = time.monotonic()
        controller.wait(timeout=15)
        gone_after = time.monotonic() - t0
        assert gone_after < 2.0 + 8.0  # heartbeat_timeout_s (2 s) + exiting on a loaded machine
        assert "the driver has been silent" in controller.stderr.read()
    finally:
        for proc in (driver, controller):
            proc.kill()
            proc.wait()


# --- checkpoints: the ZeroMQ path -------------------------------------------------------------
@pytest.mark.timeout(90)
def test_a_zeromq_run_resumes_past_a_corrupted_checkpoint_with_the_metrics_of_an_uninterrupted_run(
    tmp_path, reference
):
    part = tmp_path / "part"
    common = ["run", "graphs.toy", "--seed", str(SEED), "--controllers", "2", "--out", str(part)]
    assert main([*common, "--steps", "8", "--checkpoint-every", "3", "--quiet"]) == 0
    assert [p.name for p in checkpoints(part)] == ["step_000003", "step_000006", "step_000008"]
    newest = checkpoints(part)[-1] / "state.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as by a full disk
    with pytest.warns(RuntimeWarning, match="step_000008: state.pt does not match its checksum"):
        code = main([*common, "--steps", str(STEPS), "--resume", str(part), "--quiet"])
    assert code == 0
    assert learning(read_metrics(part)) == reference  # steps 6, 7 ran again from step_000006
    assert controller_processes() == []


@pytest.mark.timeout(60)
def test_state_round_trip_with_max_staleness_keeps_the_lagged_values():
    xs = [r.outputs["y"] / 2 for r in LocalExecutor(zmq_graphs.build_graph("boom", fail_at=-1).plan(2)).run(6)]  # fmt: skip
    graph = zmq_graphs.build_graph("feedback")
    with ZmqExecutor(graph.plan(2), max_staleness=1) as ex:
        first = ex.run(3)
        state = ex.state_dict()
    assert state["step"] == 3 and len(state["rng"]["controllers"]) == 2
    # [src, port, produced step, value]: the two values steps 3 and 4 read
    assert [(s, p, k) for s, p, k, _ in state["delayed"]] == [
        ("mirror", "out", 1),
        ("mirror", "out", 2),
    ]
    local = LocalExecutor(zmq_graphs.build_graph("feedback").plan(2), max_staleness=1)
    local.load_state_dict(state)  # the format is LocalExecutor's
    assert local.next_step == 3
    in_process = local.run(3)
    with ZmqExecutor(zmq_graphs.build_graph("feedback").plan(2), max_staleness=1) as ex:
        ex.load_state_dict(state)
        rest = ex.run(3)
    for a, b in zip(in_process, rest, strict=True):
        torch.testing.assert_close(a.outputs["total"], b.outputs["total"], rtol=0, atol=0)
    # Lag 2: step k adds x[k] to the total of step k-2, so even and odd steps accumulate apart.
    expected = [xs[0], xs[1], xs[0] + xs[2], xs[1] + xs[3], xs[0] + xs[2] + xs[4], xs[1] + xs[3] + xs[5]]  # fmt: skip
    for k, got in enumerate(first + rest):
        assert got.step == k
        torch.testing.assert_close(got.outputs["total"], expected[k], rtol=0, atol=1e-6)


# --- garbage on the sockets ----------------------------------------------------------------
def _garbage(limit: int) -> list[list[bytes]]:
    return [
        [b"\xffnot a header"],  # an unknown kind byte
        [m.Kind.DATA.frame],  # truncated: a kind byte with no header
        [m.Kind.STEP_DONE.frame + b"\x93garbage"],  # a header that does not decode
        [m.Kind.DATA.frame + os.urandom(64), os.urandom(300)],  # noise
        [m.Kind.HELLO.frame, b"\x93garbage"],  # a protocol-2 HELLO that does not decode
        m.encode_header(m.Hello(999, 0, 1, "elsewhere", "ipc://nowhere")),  # another version
        m.encode_header(m.Hello(m.PROTOCOL_VERSION, 1, 1, "elsewhere", "ipc://x")),  # late HELLO
        [*m.encode_header(m.Data(3, "nobody", "x", 0)), b"\xc0"],  # an edge no node reads
        [*m.encode_header(m.Data(10**6, "update", "weights", 0)), b"\xc0"],  # a step far away
        m.encode_header(m.Release("yatt-not-ours-c0-0")),  # a segment nobody owns
        [m.Kind.DATA.frame, b"\0" * (limit + 1)],  # oversized: libzmq drops the sender
    ]


@pytest.mark.timeout(60)
def test_garbage_on_the_driver_and_data_sockets_is_dropped_and_the_run_stays_correct():
    plan = load_graph("graphs.toy", seed=SEED).plan(2)
    limit = 1 << 20
    ex = ZmqExecutor(plan, max_message_bytes=limit)
    ctx = zmq.Context()
    try:
        results = ex.run(2)
        # Mid-run, a stranger writes to the driver's socket and to both data sockets.
        targets = [(zmq.DEALER, ex.address)] + [
            (zmq.PUSH, f"ipc://{ex.run_dir}/c{i}") for i in range(2)
        ]
        for kind, address in targets:
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address)
            for frames in _garbage(limit):
                sock.send_multipart(frames)
        results += ex.run(4)
        # zmq delivers the strangers' frames in its own time: run on, a step at a time, until
        # every socket has seen them (the verdict then does not depend on how fast that is).
        deadline = time.monotonic() + 30

        def logs():
            return [Path(c.log_path).read_text() for c in ex.controllers]

        while time.monotonic() < deadline and not (
            ex.dropped_messages >= 9
            and all("dropped a message on controller" in log for log in logs())
            and "which no node here reads" in "".join(logs())
        ):
            results += ex.run(1)
        logs, dropped = logs(), ex.dropped_messages
    finally:
        ex.close()
        ctx.destroy(linger=0)
    reference = LocalExecutor(load_graph("graphs.toy", seed=SEED).plan(1)).run(len(results))
    for ref, got in zip(reference, results, strict=True):
        assert torch.equal(ref.outputs["scores"], got.outputs["scores"])
        assert ref.outputs["metrics"] == got.outputs["metrics"]
    assert dropped >= 9  # all but the oversized one reach the driver's code and are dropped there
    for log in logs:
        assert "dropped a message on controller" in log and "data socket" in log
    assert "which no node here reads" in "".join(logs)
    assert_gone(ex.pids, ex.run_dir)


# --- bad samples, non-finite steps -----------------------------------------------------------
def test_on_bad_sample_skip_scores_them_zero_and_counts_them(tmp_path, capsys):
    out = tmp_path / "skip"
    args = ["run", GRAPHS, "--set", "kind=bad_reward", "--steps", "4", "--quiet"]
    assert main([*args, "--on-bad-sample", "skip", "--out", str(out)]) == 0
    rows = raw_rows(out)
    assert [r["skipped_samples"] for r in rows] == [0, 1, 0, 1]  # sample 1 of odd steps is NaN
    assert [r["skipped_samples_total"] for r in rows] == [0, 1, 1, 2]
    assert rows[-1]["samples_total"] == 16
    assert "skipped samples: 2 of 16" in capsys.readouterr().out
    for controllers in ("1", "2"):  # the user's reward: one line, on controllers as in-process
        assert main([*args, "--on-bad-sample", "raise", "--controllers", controllers]) == 2
        err = capsys.readouterr().err
        assert "error: node 'reward' (" in err and "stopped at step 1: sample 1 got" in err
        assert "nan" in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2


class _Steps:
    """A stand-in executor whose update skipped a non-finite step at step 1."""

    graph = None

    def __init__(self):
        self.next_step = 0

    def step(self):
        from runtime.engine.engine import StepResult

        metrics = {"loss": 0.1, "skipped_nonfinite": float(self.next_step == 1)}
        result = StepResult(self.next_step, {"scores": torch.ones(4), "metrics": metrics}, {})
        self.next_step += 1
        return result

    def state_dict(self):
        return {"step": self.next_step}

    def load_state_dict(self, state):
        self.next_step = state["step"]


def test_accounting_counts_skipped_update_steps_and_keeps_totals_in_checkpoints():
    from runtime.train.loop import Accounting

    ex = Accounting(_Steps())
    totals = [ex.step().outputs["skipped_steps_total"] for _ in range(3)]
    assert totals == [0, 1, 1]
    state = ex.state_dict()
    assert state["accounting"] == {"samples": 12, "skipped_samples": 0, "skipped_steps": 1}
    again = Accounting(_Steps())
    again.load_state_dict(state)
    assert again.next_step == 3 and again.step().outputs["samples_total"] == 16


@pytest.mark.timeout(60)
def test_an_output_over_max_message_bytes_is_an_error_naming_it_not_a_silent_drop():
    graph = zmq_graphs.build_graph("rich", big=300_000)  # a 1.2 MB tensor as one frame
    ex = ZmqExecutor(graph.plan(2), shm_threshold=0, max_message_bytes=1 << 20)
    try:
        with pytest.raises(NodeExecutionError) as info:
            ex.step()
    finally:
        ex.close()
    assert info.value.node == "source"
    assert "node 'source' output 'big'" in str(info.value) and "max_message_bytes" in str(
        info.value
    )
    assert_gone(ex.pids, ex.run_dir)


@pytest.mark.timeout(90)
def test_a_tiny_message_limit_fails_at_the_first_value_not_at_start_up():
    # SETUP (the plan) is far over 64 bytes: it goes on the driver links, which carry no
    # data limit, so the run starts and the first value over the limit is named with the flag.
    plan = load_graph("graphs.toy").plan(2)
    limit = r"max_message_bytes=64.*--max-message-mb"
    with pytest.raises(NodeExecutionError, match=limit) as err, ZmqExecutor(plan, max_message_bytes=64) as ex:  # fmt: skip
        ex.run(2)
    assert "--- traceback" not in str(err.value)


@pytest.mark.timeout(60)
def test_a_call_far_past_its_usual_time_is_warned_about_with_its_stack(caplog):
    # No time limit: the run goes on, but a call past hang_warning_s is reported once, with
    # where it is (the automatic threshold is 10x the node's longest call, at least 60 s).
    graph = zmq_graphs.build_graph("slow", sleep_s=0.0, sink_sleep_s=2.0)
    reference = LocalExecutor(zmq_graphs.build_graph("slow", sleep_s=0.0).plan(2)).run(2)
    with (
        caplog.at_level(logging.WARNING, logger="yatt_graph.runtime"),
        ZmqExecutor(graph.plan(2), hang_warning_s=0.5) as ex,
    ):
        results = ex.run(2)
    for ref, got in zip(reference, results, strict=True):
        assert torch.equal(ref.outputs["y"], got.outputs["y"])
    warnings = [r.getMessage() for r in caplog.records if "may be hung" in r.getMessage()]
    assert warnings, caplog.text
    assert "node 'double' (Boom) on controller 1 has run step" in warnings[0]
    assert "--node-timeout" in warnings[0] and "time.sleep" in warnings[0]  # the stack
