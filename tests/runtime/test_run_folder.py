"""Run folders: one run at a time, never mixed with another run, checked before the first step;
resume, overwrite, export later, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_helpers import hanging_graph
from zmq_graphs import default_sigint

from runtime.cli import main
from runtime.engine.engine import LocalExecutor
from runtime.errors import ControllerError
from runtime.train.checkpoint import checkpoints
from runtime.train.loop import train, train_with_restarts
from runtime.train.metrics import read_metrics
from runtime.train.run_folder import RunLock
from runtime.train.trace import read_trace
from yatt_graph.refs import load_graph

ROOT = Path(__file__).resolve().parents[2]
YATT = str(Path(sys.executable).with_name("yatt-graph"))
LEARNING = ("scores/mean", "scores/std", "loss")


def learning(rows):
    return [{k: r[k] for k in LEARNING} for r in rows]


def run(*flags: str) -> int:
    return main(["run", "graphs.toy", "--quiet", *flags])


def raw_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


# --- 1. one run per folder -------------------------------------------------------------------
def test_a_second_run_into_a_locked_folder_is_refused_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    with RunLock(out):
        assert run("--steps", "2", "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert f"--out {out} is in use by another run (pid {os.getpid()} on " in err
    assert not (out / "metrics.jsonl").exists()
    assert run("--steps", "2", "--out", str(out)) == 0  # released with the run that held it


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / ".lock").write_text(json.dumps({"pid": dead.pid, "host": "elsewhere"}))
    assert run("--steps", "2", "--out", str(out)) == 0
    assert f"taking over the stale lock of {out} (pid {dead.pid} on elsewhere, gone)" in (
        capsys.readouterr().err
    )


# --- 2. a folder that holds a run ----------------------------------------------------------
def test_a_folder_holding_a_run_is_refused_unless_overwritten_and_then_kept_aside(tmp_path, capsys):
    out = tmp_path / "run"
    assert run("--steps", "3", "--out", str(out), "--checkpoint-every", "3") == 0
    capsys.readouterr()
    assert run("--steps", "2", "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert f"--out {out} already holds a run (metrics.jsonl, 1 checkpoint(s))" in err
    assert "--resume" in err and "--overwrite" in err
    assert raw_steps(out) == [0, 1, 2]
    assert run("--steps", "2", "--out", str(out), "--overwrite") == 0
    assert raw_steps(out) == [0, 1] and checkpoints(out) == []
    (previous,) = out.glob("previous-*")
    assert raw_steps(previous) == [0, 1, 2]
    assert [p.name for p in checkpoints(previous)] == ["step_000003"]


# --- 3. output paths, checked before the first step; export later ----------------------------
@pytest.mark.parametrize(
    "case",
    ["out_is_a_file", "checkpoints_is_a_file", "out_unwritable", "export_exists", "no_policy"],
)
def test_bad_output_paths_are_refused_before_training(tmp_path, capsys, case):
    out = tmp_path / "run"
    flags = ["--steps", "2", "--out", str(out)]
    if case == "out_is_a_file":
        out.write_text("")
        expected = f"--out {out}: this is a file, not a folder"
    elif case == "checkpoints_is_a_file":
        out.mkdir()
        (out / "checkpoints").write_text("")
        expected = f"--out: its checkpoint folder {out / 'checkpoints'}: this is a file"
    elif case == "out_unwritable":
        if sys.platform != "linux" or not Path("/sys/kernel").is_dir():
            pytest.skip("needs a folder nobody may write into (/sys on Linux)")
        flags = ["--steps", "2", "--out", "/sys/yatt-graph-run"]
        expected = "--out /sys/yatt-graph-run: cannot write there ("
    elif case == "export_exists":
        (tmp_path / "policy").mkdir()
        flags += ["--export", str(tmp_path / "policy")]
        expected = f"--export {tmp_path / 'policy'}: it already exists"
    else:
        flags += ["--export", str(tmp_path / "policy")]
        expected = "graph 'toy_rlhf' has no update node holding a policy"
    assert run(*flags) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.timeout(300)
def test_an_export_that_fails_at_the_end_leaves_a_checkpoint_to_export_from(
    tmp_path, capsys, monkeypatch
):
    from nodes.models.prefix_vlm import PrefixVLM

    out, target = tmp_path / "run", tmp_path / "policy"
    real = PrefixVLM.save_pretrained

    def full_disk(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PrefixVLM, "save_pretrained", full_disk)
    args = ["run", "graphs.mm_ppo", "--steps", "1", "--set", "batch_size=4", "--quiet"]
    assert main([*args, "--out", str(out), "--export", str(target)]) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err
    ckpt = out / "checkpoints" / "step_000001"
    assert f"the trained policy is in {ckpt}: export it with `yatt-graph export {ckpt} PATH`" in err
    monkeypatch.setattr(PrefixVLM, "save_pretrained", real)
    assert main(["export", str(ckpt), str(target)]) == 0
    assert "exported the policy of node 'ppo'" in capsys.readouterr().out
    assert any(target.iterdir())
    assert main(["export", str(ckpt), str(target)]) == 2  # exists now
    assert "already exists" in capsys.readouterr().err


# --- 4. graph identity ---------------------------------------------------------------------
def test_resuming_with_other_options_is_refused_naming_the_nodes_and_options(tmp_path, capsys):
    out = tmp_path / "run"
    assert run("--seed", "1", "--steps", "4", "--out", str(out), "--checkpoint-every", "2") == 0
    capsys.readouterr()
    assert run("--seed", "2", "--steps", "6", "--resume", str(out)) == 2
    err = capsys.readouterr().err
    ckpts = out / "checkpoints"
    assert f"{ckpts / 'step_000004'}, {ckpts / 'step_000002'}: written by another graph" in err
    assert "node 'rollout' option(s) seed 1 vs 2" in err and "Traceback" not in err
    assert run("--seed", "1", "--set", "vocab=6", "--steps", "6", "--resume", str(out)) == 2
    assert "node 'reward' option(s) vocab 8 vs 6" in capsys.readouterr().err
    assert raw_steps(out) == [0, 1, 2, 3]  # refused before a step ran


@pytest.mark.timeout(300)
def test_an_mm_ppo_checkpoint_resumed_by_text_ppo_is_refused_naming_the_difference(
    tmp_path, capsys
):
    out = tmp_path / "run"
    small = ["--set", "batch_size=4", "--quiet"]
    args = ["run", "graphs.mm_ppo", "--steps", "1", "--checkpoint-every", "1", *small]
    assert main([*args, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["run", "graphs.text_ppo", "--steps", "2", "--resume", str(out), *small]) == 2
    err = capsys.readouterr().err
    assert "graph 'mm_ppo' (checkpoint) vs 'text_ppo' (now)" in err
    assert "node(s) ['vision'] only in the checkpoint" in err and "Traceback" not in err


def test_a_checkpoint_of_another_graph_names_the_classes_that_differ():
    from yatt_graph.serialize import graph_identity, identity_differences

    toy = graph_identity(load_graph("graphs.toy"))
    other = json.loads(json.dumps(toy))
    other["name"] = "other"
    other["nodes"]["update"]["class"] = "nodes.rl:PPOUpdate"
    del other["nodes"]["reward"]
    diffs = identity_differences(other, toy)
    assert diffs == [
        "graph 'other' (checkpoint) vs 'toy_rlhf' (now)",
        "node(s) ['reward'] only in this graph",
        "node 'update': class nodes.rl:PPOUpdate vs nodes.toy:ToyUpdate",
    ]
    assert identity_differences([1, 2], toy) == ["the checkpoint's graph record is not readable"]


@pytest.mark.parametrize("meta", ["[1, 2]", '{"format": 1, "step": "x"}', '"text"'])
def test_meta_of_the_wrong_shape_falls_back_to_the_previous_checkpoint(tmp_path, capsys, meta):
    out = tmp_path / "run"
    assert run("--steps", "4", "--out", str(out), "--checkpoint-every", "2") == 0
    (out / "checkpoints" / "step_000004" / "meta.json").write_text(meta)
    with pytest.warns(RuntimeWarning, match="step_000004: meta.json"):
        assert run("--steps", "5", "--resume", str(out)) == 0
    assert raw_steps(out) == [0, 1, 2, 3, 4]
    (out / "checkpoints" / "step_000002" / "meta.json").write_text(meta)
    for step in (4, 5):
        path = out / "checkpoints" / f"step_{step:06d}"
        if path.exists():
            (path / "meta.json").write_text(meta)
    capsys.readouterr()
    assert run("--steps", "6", "--resume", str(out)) == 2
    err = capsys.readouterr().err
    assert "no usable checkpoint in" in err and "meta.json" in err and "Traceback" not in err


def test_a_corrupt_checkpoint_is_one_line_naming_the_file(tmp_path, capsys):
    out = tmp_path / "run"
    assert run("--steps", "2", "--out", str(out), "--checkpoint-every", "2") == 0
    state = out / "checkpoints" / "step_000002" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    capsys.readouterr()
    assert run("--steps", "4", "--resume", str(out)) == 2
    err = capsys.readouterr().err
    assert f"{state.parent}: state.pt does not match its checksum" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


# --- 5. resume ---------------------------------------------------------------------------------
def test_resume_without_out_continues_its_folder_once_per_step_and_keeps_the_trace(
    tmp_path, capsys
):
    whole, out = tmp_path / "whole", tmp_path / "run"
    assert run("--seed", "3", "--steps", "8", "--out", str(whole)) == 0
    assert run("--seed", "3", "--steps", "6", "--out", str(out), "--checkpoint-every", "4") == 0
    assert raw_steps(out) == [0, 1, 2, 3, 4, 5]  # rows 4, 5 are past the checkpoint
    assert run("--seed", "3", "--steps", "3", "--resume", str(out)) == 2
    assert "--steps 3 is below the step of" in capsys.readouterr().err
    summary = (out / "summary.json").read_text()
    assert run("--seed", "3", "--steps", "6", "--resume", str(out)) == 2  # nothing to run
    assert "--steps 6 is already the step of" in capsys.readouterr().err
    assert (out / "summary.json").read_text() == summary  # the run's summary is kept
    assert run("--seed", "3", "--steps", "8", "--resume", str(out)) == 0
    assert raw_steps(out) == list(range(8))  # every step once, in the folder it resumed
    assert learning(read_metrics(out)) == learning(read_metrics(whole))
    spans = json.loads((out / "trace.json").read_text())["traceEvents"]
    steps = sorted({e["args"]["step"] for e in spans if e["ph"] == "X"})
    assert steps == list(range(8))
    per_step = [sum(1 for e in spans if e["ph"] == "X" and e["args"]["step"] == k) for k in steps]
    assert len(set(per_step)) == 1  # no step's spans twice


class FailsOnce:
    """An in-process executor whose controller 'dies' once, at a given step."""

    def __init__(self, executor, fail_at, failed):
        self.executor, self.fail_at, self.failed = executor, fail_at, failed

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def run(self, steps, on_step=None, stop=None):
        for _ in range(steps):
            if self.executor.next_step == self.fail_at and not self.failed:
                self.failed.append(True)
                raise ControllerError("controller 1 was killed by signal 9", 1, ["update"])
            result = self.executor.step()
            if on_step:
                on_step(result)


def test_a_restart_never_resumes_an_older_run_of_another_graph_in_its_folder(tmp_path):
    out = tmp_path / "run"
    old = LocalExecutor(load_graph("graphs.toy", seed=1))
    train(old, 9, out, checkpoint_every=3, progress=False)  # step_000003, 6, 9 of seed 1
    failed: list[bool] = []

    def make():
        return FailsOnce(LocalExecutor(load_graph("graphs.toy", seed=2)), 4, failed)

    with pytest.warns(RuntimeWarning, match="step_000006: written by another graph"):
        rows, restarts = train_with_restarts(
            make, 6, out, checkpoint_every=3, restart="on-failure", progress=False
        )
    assert restarts == 1 and failed == [True]
    whole = train(LocalExecutor(load_graph("graphs.toy", seed=2)), 6, progress=False)
    # Resumed from its own step_000003, not the other run's step_000009 (which would end at once).
    assert [r["step"] for r in rows] == list(range(6))
    assert learning(rows) == learning(whole)


def test_restart_on_failure_into_a_folder_of_an_older_run_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert run("--steps", "3", "--out", str(out), "--checkpoint-every", "3") == 0
    capsys.readouterr()
    flags = ["--controllers", "2", "--restart", "on-failure", "--checkpoint-every", "3"]
    assert run("--steps", "6", "--seed", "5", "--out", str(out), *flags) == 2
    assert "already holds a run" in capsys.readouterr().err


# --- 6. SIGTERM ------------------------------------------------------------------------------
def _sigterm_run(
    out: Path, *flags: str, sig: int = signal.SIGTERM
) -> tuple[subprocess.CompletedProcess, list[int]]:
    cmd = [YATT, "run", "graphs.toy", "--steps", "10000000", "--out", str(out), "--quiet", *flags]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    try:
        metrics = out / "metrics.jsonl"
        while not metrics.is_file() or len(metrics.read_text().splitlines()) < 3:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        import psutil

        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert alive == [], f"left running: {alive}"
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), raw_steps(out)


@pytest.mark.timeout(120)
def test_sigterm_in_process_stops_after_the_step_with_a_checkpoint_and_exit_143(tmp_path):
    out = tmp_path / "run"
    done, steps = _sigterm_run(out, "--checkpoint-every", "1000")
    assert done.returncode == 143, done.stderr
    n = len(steps)
    assert steps == list(range(n))
    assert f"stopped by SIGTERM after step {n}" in done.stderr
    assert f"checkpoint {out / 'checkpoints' / f'step_{n:06d}'}" in done.stderr
    assert [p.name for p in checkpoints(out)] == [f"step_{n:06d}"]
    assert "Traceback" not in done.stderr
    spans = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert max(e["args"]["step"] for e in spans if e["ph"] == "X") == n - 1
    assert run("--steps", str(n + 2), "--resume", str(out)) == 0
    assert raw_steps(out) == list(range(n + 2))


@pytest.mark.timeout(180)
def test_sigterm_with_two_controllers_shuts_them_down_and_exits_143(tmp_path):
    out = tmp_path / "run"
    done, steps = _sigterm_run(out, "--controllers", "2", "--checkpoint-every", "1000")
    assert done.returncode == 143, done.stderr
    n = len(steps)
    assert steps == list(range(n))  # the steps in flight were finished and recorded
    assert f"stopped by SIGTERM after step {n}" in done.stderr and "Traceback" not in done.stderr
    assert [p.name for p in checkpoints(out)] == [f"step_{n:06d}"]  # the controllers' state
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    assert run("--steps", str(n + 2), "--resume", str(out)) == 0
    assert raw_steps(out) == list(range(n + 2))


@pytest.mark.timeout(120)
def test_a_killed_runs_trace_holds_every_recorded_step_and_reports(tmp_path):
    out = tmp_path / "run"
    done, steps = _sigterm_run(out, sig=signal.SIGKILL)
    assert done.returncode == -signal.SIGKILL
    events, origin, whole = read_trace(out / "trace.json")
    assert not whole and origin is not None  # cut short, not lost
    traced = {e["args"]["step"] for e in events if e["ph"] == "X"}
    assert set(steps) <= traced, (steps, sorted(traced))
    assert main(["report", str(out)]) == 0
    assert "trace.json is cut short" in (out / "report.html").read_text()


@pytest.mark.timeout(120)
def test_ctrl_c_in_process_is_one_line_with_exit_130_and_the_metrics_kept(tmp_path):
    out = tmp_path / "run"
    done, steps = _sigterm_run(out, sig=signal.SIGINT)
    assert done.returncode == 130, done.stderr
    assert steps == list(range(len(steps)))
    assert f"stopped by Ctrl-C; metrics and trace are in {out}" in done.stderr
    assert "Traceback" not in done.stderr and (out / "trace.json").is_file()


# --- 8, 9: --max-staleness in-process, check_finite ------------------------------------------
@pytest.mark.timeout(120)
def test_max_staleness_in_process_equals_the_two_controller_run(tmp_path):
    flags = ["--seed", "4", "--steps", "6", "--max-staleness", "1", "--staleness", "fixed"]
    assert run(*flags, "--out", str(tmp_path / "local")) == 0
    assert run(*flags, "--out", str(tmp_path / "zmq"), "--controllers", "2") == 0
    assert run("--seed", "4", "--steps", "6", "--out", str(tmp_path / "on_policy")) == 0
    local = learning(read_metrics(tmp_path / "local"))
    assert local == learning(read_metrics(tmp_path / "zmq"))
    assert local != learning(read_metrics(tmp_path / "on_policy"))  # the flag reached it


@pytest.mark.timeout(120)
def test_max_staleness_is_a_bound_by_default(tmp_path):
    flags = ["--seed", "4", "--steps", "6", "--max-staleness", "1"]
    assert run(*flags, "--out", str(tmp_path / "local")) == 0
    assert run(*flags, "--out", str(tmp_path / "zmq"), "--controllers", "2") == 0
    assert run("--seed", "4", "--steps", "6", "--out", str(tmp_path / "on_policy")) == 0
    # one process, one step at a time: the newest weights are always the last step's
    local = read_metrics(tmp_path / "local")
    assert learning(local) == learning(read_metrics(tmp_path / "on_policy"))
    for rows in (local, read_metrics(tmp_path / "zmq")):
        ages = [r["staleness/rollout.weights"] for r in rows]
        # step 0 has nothing to read, step 1 what there is (step 0's or still nothing), later
        # steps a value at most K=1 versions old
        assert ages[0] == -1 and ages[1] in (-1, 0) and all(0 <= a <= 1 for a in ages[2:]), ages


NAN_GRAPH = """
from nodes.toy import ToySource
from yatt_graph import Graph, Tensor, node


@node(outputs={"value": Tensor("float32", "B")}, kind="reward")
def zero_over_zero(labels: Tensor("int64", "B")) -> dict:
    return {"value": labels.float() * 0.0 / 0.0}


def build_graph():
    with Graph("nan") as g:
        batch = ToySource(batch_size=4, classes=4, seed=0, name="source")()
        g.output("value", zero_over_zero(batch.labels, name="nan"))
    return g
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("controllers", ["1", "2"])
def test_non_finite_outputs_stop_the_run_unless_no_check_finite(tmp_path, capsys, controllers):
    import inspect

    from runtime.zmq.driver import ZmqExecutor

    if controllers == "2" and "check_finite" not in inspect.signature(ZmqExecutor).parameters:
        pytest.skip("ZmqExecutor takes no check_finite yet")
    graph = tmp_path / "nan_graph.py"
    graph.write_text(NAN_GRAPH)
    args = ["run", str(graph), "--steps", "2", "--quiet", "--controllers", controllers]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "the run stopped: " in err and "'nan'" in err
    assert main([*args, "--no-check-finite"]) == 0


def test_a_checkpoint_may_resume_with_other_train_ranks_but_not_other_options():
    from yatt_graph.refs import load_graph
    from yatt_graph.serialize import graph_identity, identity_differences

    one = graph_identity(load_graph("graphs.mm_grpo", train_ranks=1))
    two = graph_identity(load_graph("graphs.mm_grpo", train_ranks=2, train_backend="ddp"))
    assert identity_differences(one, two) == []  # how the update runs, not what it is
    other = graph_identity(load_graph("graphs.mm_grpo", train_ranks=2, lr=0.01))
    assert any("lr" in d for d in identity_differences(one, other))


@pytest.mark.timeout(120)
def test_a_second_sigterm_stops_an_in_process_run_hung_in_a_node_and_keeps_its_trace(tmp_path):
    graph, out = tmp_path / "hang.py", tmp_path / "run"
    graph.write_text(hanging_graph(returns=2))  # step 2 never ends
    cmd = [sys.executable, "-m", "runtime.cli", "run", str(graph), "--steps", "10",
           "--out", str(out), "--quiet"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "hung"
        proc.send_signal(signal.SIGTERM)  # the step in progress should end first: it cannot
        time.sleep(1.0)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)  # a second one stops at once
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM after step 2" in err
    spans = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert max(e["args"]["step"] for e in spans if e["ph"] == "X") == 1


def test_a_second_sigterm_while_the_loop_closes_still_says_the_step(tmp_path, capsys):
    """The loop gives the first SIGTERM its step; one that comes while the loop closes (its
    trace and writers) replaces it, and the line still says where the run stopped."""
    from runtime.run import _interrupted
    from runtime.train.loop import Terminated

    first = Terminated(signal.SIGTERM)
    first.step, first.checkpoint = 7, tmp_path / "checkpoints" / "step_000007"
    try:
        try:
            raise first
        except Terminated:
            raise Terminated(signal.SIGTERM)  # noqa: B904  # (a second signal, not a cause)
    except Terminated as second:
        assert second.__context__ is first
        assert _interrupted(second, tmp_path) == 143
    err = capsys.readouterr().err
    assert f"stopped by SIGTERM after step 7; metrics and trace are in {tmp_path}" in err
    assert "checkpoint" in err and "step_000007" in err
