import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from process_helpers import live_children

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
    assert main(["viz", "graphs.toy", "-o", "toy.pdf"]) == 2
    assert "must end in .svg or .png" in capsys.readouterr().err
    assert main(["show", "graphs/missing.py"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_ready_graph_runs_by_name_from_any_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # outside the repository: graphs/toy.py is no file here
    for target in ("toy", "graphs/toy.py"):
        assert main(["run", target, "--steps", "1", "--quiet"]) == 0, target
    assert main(["show", "no_such_graph"]) == 2
    err = capsys.readouterr().err
    ready = "mm_agent, mm_grpo, mm_ppo, text_agent, text_grpo, text_ppo, toy"
    assert "no graph 'no_such_graph'" in err and ready in err


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


@pytest.mark.parametrize(
    "flags, message",
    [
        # Checkpoints and --resume work with --controllers (tests/runtime/test_faults.py); a
        # restart needs controllers to restart and a folder for the checkpoints.
        (
            ["--restart", "on-failure", "--out", "x"],
            "--restart on-failure restarts controller, replica or training-rank",
        ),
        (["--controllers", "2", "--restart", "on-failure"], "needs --out DIR"),
        (["--node-timeout", "5"], "apply to controller processes"),
        (
            ["--on-bad-sample", "skip"],
            "unknown option 'on_bad_sample' for toy (given by --on-bad-sample skip)",
        ),
        (["--slots", "0"], "--slots takes a CPU slot count"),
        (["--steps", "0"], "--steps must be 1 or more, got 0"),
        (["--steps", "-3"], "--steps must be 1 or more, got -3"),
        (["--controllers", "0"], "--controllers must be 1 or more"),
        (["--threads", "0"], "--threads must be 1 or more, got 0"),
        (["--pin", "reference=rollout"], "--pin keeps a node on one side of --placement partial"),
        (
            ["--controllers", "2", "--placement", "partial", "--pin", "reference"],
            "--pin takes NODE=rollout or NODE=train",
        ),
        (["--controllers", "-1"], "--controllers must be 1 or more"),
        (["--checkpoint-every", "-1"], "--checkpoint-every must be 0 or more"),
        (["--max-staleness", "-1"], "--max-staleness must be 0 or more"),
        (["--max-restarts", "-1"], "--max-restarts must be 0 or more"),
        (["--controllers", "2", "--no-spawn"], "--no-spawn waits for controllers started by hand"),
        (["--resume", "x", "--overwrite"], "choose one"),
        (["--staleness", "fixed"], "--staleness fixed chooses which old weights"),
        (["--listen", "tcp://127.0.0.1:5999"], "--listen binds the driver for controllers"),
        (
            ["--controllers", "2", "--listen", "tcp://127.0.0.1:70000"],
            "needs a port from 1 to 65535",
        ),
        # an empty path (an unset shell variable) would turn the option off
        (["--out", ""], "--out was given an empty path"),
        (["--resume", " "], "--resume was given an empty path"),
        (["--export", ""], "--export was given an empty path"),
        (["--resume", "nope"], "--resume nope: does not exist; it takes a run folder"),
        # a limit that is no number, or rounds to no limit
        (["--controllers", "2", "--node-timeout", "nan"], "--node-timeout takes 0 (no limit)"),
        (["--max-message-mb", "inf"], "--max-message-mb takes 0 (no limit) or a finite"),
        (["--controllers", "2", "--max-message-mb", "1e-9"], "is under one byte"),
        (["--max-message-mb", "1"], "--max-message-mb apply to controller processes"),
        # one option given twice
        (["--seed", "1", "--set", "seed=2"], "--seed and --set seed=... both give 'seed'"),
        (["--set", "batch_size=2", "batch_size=3"], "--set gives 'batch_size' twice"),
    ],
)
def test_bad_flags_are_refused_in_one_line_with_exit_code_2_before_training(
    tmp_path, monkeypatch, capsys, flags, message
):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "graphs.toy", "--quiet", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []  # nothing ran, no folder was made


def test_a_bug_shows_its_traceback_and_says_it_is_a_bug(monkeypatch, capsys):
    import runtime.run

    def broken(*args, **kwargs):
        raise KeyError("an internal slip")

    monkeypatch.setattr(runtime.run, "print_summary", broken)
    assert main(["run", "graphs.toy", "--steps", "1", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'an internal slip'" in err
    assert "this is a bug in yatt-graph" in err


def test_a_bad_option_value_is_the_users_error_not_a_bug(capsys):
    assert main(["run", "graphs.toy", "--set", "nope=1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "Traceback" not in err


def test_slots_split_the_per_sample_models_and_print_their_utilization(capsys):
    args = ["run", "graphs/mm_ppo.py", "--steps", "2", "--slots", "2", "--quiet"]
    assert main([*args, "--set", "batch_size=8"]) == 0
    out = capsys.readouterr().out
    assert "slots (nodes critic, reference, reward, vision split across them): cpu:0" in out
    assert "cpu:1" in out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("controllers", [7, 100])
def test_more_controllers_than_nodes_is_one_line_before_any_controller_starts(
    controllers, tmp_path, capsys
):
    """toy has 6 nodes. 100 controllers must not be started to find that out."""
    before = set(live_children())
    assert main(["run", "graphs.toy", "--controllers", str(controllers), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"--controllers {controllers}: graphs.toy has 6 nodes" in err
    assert "bug" not in err and "Traceback" not in err
    assert set(live_children()) <= before  # none started (or none left)


@pytest.mark.timeout(120)
def test_controllers_started_early_are_ended_when_the_graph_has_fewer_nodes(tmp_path, capsys):
    graph = tmp_path / "one.py"
    graph.write_text(
        "import torch\nfrom yatt_graph import Graph, Tensor, node\n"
        "@node(outputs={'x': Tensor('float32', 'B')})\ndef source():\n"
        "    return {'x': torch.zeros(2)}\n"
        "def build_graph():\n    with Graph('one') as g:\n        g.output('x', source())\n"
        "    return g\n"
    )
    assert main(["run", str(graph), "--controllers", "2", "--threads", "1", "--quiet"]) == 2
    assert "--controllers 2: " in capsys.readouterr().err
    assert live_children() == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("controllers", ["1", "2"])
def test_a_model_folder_that_does_not_load_is_the_users_error_in_one_line(
    controllers, tmp_path, capsys
):
    """Weights that do not fit their config.json (n_embd edited): the node that builds the
    policy refuses it; in-process as on controllers that is one line, exit 2, not a bug."""
    from nodes.models.hf_causal import tiny_gpt2

    folder = tmp_path / "policy"
    tiny_gpt2().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_embd": 48}))
    capsys.readouterr()
    args = ["run", "graphs.text_grpo", "--policy", str(folder), "--steps", "1", "--quiet"]
    assert main([*args, "--controllers", controllers]) == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("yatt-graph run: error:"))
    assert "error: node 'rollout' (Rollout) could not be built: UsageError:" in line
    assert str(folder) in line
    assert "this is a bug in yatt-graph" not in err
    if controllers != "1":  # (the check below is the node's, the same in every process)
        return
    # fewer layers in the config than in the files: transformers loads what fits, warns, and
    # would train a model the folder does not hold; refused, naming both sides
    (folder / "config.json").write_text(json.dumps({**config, "n_layer": 1}))
    assert main([*args, "--controllers", controllers]) == 2
    err = capsys.readouterr().err
    assert "the weights do not fit its config.json (model_type 'gpt2')" in err
    assert "in the files fit no layer of it (transformer.h.1." in err


def test_partial_placement_with_more_controllers_than_its_sides_can_use_is_one_line(capsys):
    """toy with its encoder pinned to the training side: source and rollout (2 nodes) against
    encoder, reward, advantage and update (4)."""
    args = ["run", "graphs.toy", "--placement", "partial", "--pin", "encoder=train", "--quiet"]
    args += ["--controllers", "5"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--placement partial --controllers 5: the rollout side gets 3 controllers" in err
    assert "use --controllers 4 or fewer" in err and "Traceback" not in err


def test_viz_refuses_a_plan_it_cannot_make_and_a_path_it_cannot_write(tmp_path, capsys):
    svg = str(tmp_path / "g.svg")
    for args, message in (
        (["-o", svg, "--controllers", "0"], "--controllers must be 1 or more, got 0"),
        (["-o", svg, "--controllers", "99"], "--controllers 99: toy_rlhf has 6 nodes"),
        (["-o", str(tmp_path / "no" / "g.svg")], "not a folder; name a file in an existing"),
    ):
        assert main(["viz", "graphs/toy.py", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    (tmp_path / "d.svg").mkdir()
    assert main(["viz", "graphs/toy.py", "-o", str(tmp_path / "d.svg")]) == 2
    assert "is a folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("def build_graph():\n    return 42\n", "build_graph() returned int 42, not a Graph"),
        ("build_graph = 5\n", "build_graph is a int, not a function"),
    ],
)
def test_a_graph_file_whose_build_graph_is_no_graph_says_so(tmp_path, capsys, body, message):
    graph = tmp_path / "g.py"
    graph.write_text(body)
    assert main(["show", str(graph)]) == 2
    assert message in capsys.readouterr().err


def test_more_training_ranks_than_the_cores_can_hold_is_one_line(tmp_path, capsys):
    args = ["run", "graphs.text_grpo", "--steps", "1", "--quiet", "--out", str(tmp_path / "r")]
    assert main([*args, "--train-ranks", "4096"]) == 2
    err = capsys.readouterr().err
    assert "--train-ranks 4096 on " in err and "out-of-memory" in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # before any step
