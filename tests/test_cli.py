import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from runtime.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_viz_writes_an_svg_with_every_node(tmp_path, capsys):
    out = tmp_path / "toy.svg"
    assert main(["viz", "graphs/toy.py", "-o", str(out), "--controllers", "2"]) == 0
    texts = " ".join(ET.parse(out).getroot().itertext())
    for name in ("source", "encoder", "rollout", "reward", "advantage", "update", "controller 1"):
        assert name in texts
    assert "wrote" in capsys.readouterr().out


def test_show_prints_the_listing_and_mermaid(capsys):
    assert main(["show", "graphs.toy", "--set", "batch_size=4"]) == 0
    assert capsys.readouterr().out.startswith("graph toy_rlhf (6 nodes, 10 edges)")
    assert main(["show", "graphs.toy", "--mermaid"]) == 0
    assert capsys.readouterr().out.startswith("flowchart LR")


def test_run_reports_the_reward(capsys):
    assert main(["run", "graphs/toy.py", "--steps", "12", "--seed", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "mean reward: first 5 steps" in out and "graph toy_rlhf" not in out
    assert main(["run", "graphs/toy.py", "--steps", "2", "--quiet", "--show-graph"]) == 0
    assert capsys.readouterr().out.startswith("graph toy_rlhf (6 nodes, 10 edges)")


def test_a_graph_file_that_fails_to_import_names_the_file(tmp_path, capsys):
    bad = tmp_path / "broken_graph.py"
    bad.write_text("import not_a_module_anywhere\n")
    assert main(["show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "broken_graph.py" in err and "not_a_module_anywhere" in err


def test_bad_output_suffix_and_missing_file(capsys):
    with pytest.raises(SystemExit, match=r"must end in .svg or .png"):
        main(["viz", "graphs.toy", "-o", "toy.pdf"])
    assert main(["show", "graphs/missing.py"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_console_script_is_installed():
    exe = Path(sys.executable).with_name("yatt-graph")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and "viz" in out.stdout and "run" in out.stdout


@pytest.mark.timeout(120)
def test_run_on_three_controllers_matches_the_in_process_run(tmp_path, capsys):
    from runtime.train.metrics import read_metrics

    local, zmq = tmp_path / "local", tmp_path / "zmq"
    assert main(["run", "graphs.toy", "--steps", "5", "--out", str(local), "--quiet"]) == 0
    assert (
        main(
            [
                "run",
                "graphs.toy",
                "--steps",
                "5",
                "--controllers",
                "3",
                "--out",
                str(zmq),
                "--quiet",
            ]
        )
        == 0
    )
    keep = ("scores/mean", "scores/std", "loss")
    assert [{k: r[k] for k in keep} for r in read_metrics(local)] == [
        {k: r[k] for k in keep} for r in read_metrics(zmq)
    ]
    trace = json.loads((zmq / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1, 2}


def test_fault_flags_that_cannot_apply_are_refused_clearly():
    # Checkpoints and --resume work with --controllers (tests/runtime/test_faults.py); a
    # restart needs controllers to restart and a folder for the checkpoints.
    with pytest.raises(SystemExit, match="--restart on-failure restarts controller processes"):
        main(["run", "graphs.toy", "--restart", "on-failure", "--out", "x"])
    with pytest.raises(SystemExit, match="needs --out DIR"):
        main(["run", "graphs.toy", "--controllers", "2", "--restart", "on-failure"])
    with pytest.raises(SystemExit, match="apply to controller processes"):
        main(["run", "graphs.toy", "--node-timeout", "5"])
    with pytest.raises(SystemExit, match="takes no on_bad_sample option"):
        main(["run", "graphs.toy", "--on-bad-sample", "skip"])


def test_devices_splits_the_per_sample_models_and_prints_their_utilization(capsys):
    with pytest.raises(SystemExit, match="--devices takes a CPU slot count"):
        main(["run", "graphs.toy", "--devices", "0"])
    args = ["run", "graphs/mm_ppo.py", "--steps", "2", "--devices", "2", "--quiet"]
    assert main([*args, "--set", "batch_size=8"]) == 0
    out = capsys.readouterr().out
    assert "devices (nodes critic, reference, reward, vision split across them): cpu:0" in out
    assert "cpu:1" in out
