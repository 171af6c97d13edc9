"""``--set`` values parsed by the graph's option types, ``show --options``, and errors that
name the place in the user's graph file."""

import json
import textwrap

import pytest

from runtime.cli import build_parser, main
from runtime.flags import graph_args
from runtime.run import graph_options
from yatt_graph.refs import load_graph

# A user's graph: typed, untyped-with-default and untyped parameters; it records what it got.
RECORDING_GRAPH = """
import json
from pathlib import Path

from graphs.toy import build_graph as toy


def build_graph(flag: bool = True, count: int = 1, rate: float = 0.5, name: str = "a",
                inferred=3, anything=None, fail: str = ""):
    Path(__file__).with_suffix(".json").write_text(json.dumps(dict(
        flag=flag, count=count, rate=rate, name=name, inferred=inferred, anything=anything)))
    if fail == "zero":
        return 1 / 0
    if fail == "node":
        return toy(batch_size=count, colour=3)
    return toy(batch_size=count)
"""


@pytest.fixture
def user_graph(tmp_path):
    path = tmp_path / "my_graph.py"
    path.write_text(RECORDING_GRAPH)
    return path


def options_of(*argv: str) -> dict:
    return graph_options(graph_args(build_parser().parse_args(["show", *argv])))


def received(path, *sets: str) -> dict:
    argv = ["show", str(path)]
    for pair in sets:
        argv += ["--set", pair]
    assert main(argv) == 0
    return json.loads(path.with_suffix(".json").read_text())


@pytest.mark.parametrize(
    ("word", "value"),
    [("no", False), ("OFF", False), ("false", False), ("0", False), ("yes", True), ("On", True)],
)
def test_booleans_read_yes_no_on_off_as_words(word, value):
    options = options_of("graphs/mm_ppo.py", "--set", f"stream={word}", "--set", "batch_size=2")
    assert options == {"stream": value, "batch_size": 2}
    graph = load_graph("graphs.mm_ppo", **options)
    assert graph.nodes["rollout"].config()["stream"] is value


def test_numbers_are_parsed_by_their_declared_type():
    options = options_of("graphs/mm_grpo.py", "--set", "lr=3", "--set", "group_size=2")
    assert options == {"lr": 3.0, "group_size": 2}
    assert isinstance(options["lr"], float)
    assert options_of("graphs/mm_ppo.py", "--set", "policy=/no/such/dir") == {
        "policy": "/no/such/dir"
    }
    spec = '{"name": "tiny-prefix-vlm", "seed": 1}'
    assert options_of("graphs/mm_ppo.py", "--set", f"policy={spec}") == {"policy": json.loads(spec)}


@pytest.mark.parametrize(
    ("pair", "expected"),
    [
        ("batch_size=abc", "option 'batch_size' of graphs/mm_ppo.py: 'abc' is not int"),
        ("batch_size=2.5", "option 'batch_size' of graphs/mm_ppo.py: '2.5' is not int"),
        ("lr=abc", "option 'lr' of graphs/mm_ppo.py: 'abc' is not float"),
        ("stream=maybe", "option 'stream' of graphs/mm_ppo.py: 'maybe' is not bool"),
        ("on_bad_sample=error", "'error' is not raise|skip"),
        (
            "batch_sise=4",
            "yatt-graph show: unknown option 'batch_sise' for mm_ppo (did you mean "
            "'batch_size'?); `yatt-graph show mm_ppo --options` lists the options of mm_ppo",
        ),
        ("lr=-1", "option lr=-1.0: must be a finite number > 0"),
        ("temperature=1e-30", "option temperature=1e-30: must be a finite number >= 0.01"),
        ("dtype=float16", "option 'dtype' of graphs/mm_ppo.py: 'float16' is not float32|bfloat16"),
        ("policy_loss=cispo", "option 'policy_loss' of graphs/mm_ppo.py: 'cispo' is not ppo|gspo"),
        ("tis_level=sentence", "'sentence' is not token|sequence"),
        ("val_samples=0", "option val_samples=0: must be >= 1"),
        ("val_temperature=-1", "option val_temperature=-1.0: must be 0 or a finite number >= 0.01"),
        ("val_top_p=1.5", "option val_top_p=1.5: must be in (0, 1]"),
    ],
)
def test_a_wrong_key_or_value_is_refused_in_one_line_with_exit_code_2(pair, expected, capsys):
    assert main(["show", "graphs/mm_ppo.py", "--set", pair]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1
    assert "valid:" not in err and len(err) < 240, err  # the option at fault, not all of them


def test_a_named_model_flag_the_graph_lacks_is_refused(capsys):
    assert main(["show", "graphs/text_ppo.py", "--vision", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "unknown option 'vision' for text_ppo (given by --vision tiny)" in err
    assert "it is an option of mm_grpo and mm_ppo, not of text_ppo" in err


def test_a_user_graph_gets_types_from_its_signature(user_graph, capsys):
    got = received(user_graph, "flag=off", "count=2", "rate=1", "name=42", "inferred=7")
    assert got == {
        "flag": False,
        "count": 2,
        "rate": 1.0,
        "name": "42",
        "inferred": 7,
        "anything": None,
    }
    got = received(user_graph, "anything=[1, 2]")
    assert got["anything"] == [1, 2]  # no annotation, no typed default: JSON ...
    assert received(user_graph, "anything=plain words")["anything"] == "plain words"  # ... or text
    for pair, expected in [
        ("count=2.5", "'2.5' is not int"),
        ("inferred=x", "'x' is not int"),  # typed by its default 3
        ("flag=maybe", "'maybe' is not bool"),
    ]:
        assert main(["show", str(user_graph), "--set", pair]) == 2
        err = capsys.readouterr().err
        name = pair.split("=")[0]
        assert f"error: option {name!r} of {user_graph}: {expected}\n" in err, err
    assert main(["show", str(user_graph), "--set", "colour=red"]) == 2
    err = capsys.readouterr().err
    assert f"unknown option 'colour' for {user_graph}; `yatt-graph show {user_graph} " in err


def test_a_user_graph_with_kwargs_takes_other_keys_as_json_or_text(tmp_path, capsys):
    path = tmp_path / "open_graph.py"
    path.write_text(
        "from graphs.toy import build_graph as toy\n\n\n"
        "def build_graph(size: int, **options):\n    return toy(batch_size=size, **options)\n"
    )
    assert options_of(str(path), "--set", "size=2", "--set", "seed=3") == {"size": 2, "seed": 3}
    assert main(["show", str(path), "--set", "size=x"]) == 2
    assert "option 'size' of" in capsys.readouterr().err
    assert main(["show", str(path), "--options"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["size", "int", "(required)"]
    assert "other keys are passed through" in out


def test_on_bad_sample_is_spelled_raise_or_skip():
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["run", "graphs/mm_ppo.py", "--on-bad-sample", "error"])
    assert info.value.code == 2
    args = build_parser().parse_args(["run", "graphs/mm_ppo.py", "--on-bad-sample", "raise"])
    assert args.on_bad_sample == "raise"


def test_an_exception_in_build_graph_names_the_file_and_line(user_graph, capsys):
    assert main(["show", str(user_graph), "--set", "fail=zero"]) == 2
    err = capsys.readouterr().err
    assert "my_graph.py:13 (return 1 / 0): ZeroDivisionError: division by zero" in err
    assert err.count("\n") == 1
    assert main(["show", str(user_graph), "--set", "fail=node"]) == 2  # a TypeError inside it
    err = capsys.readouterr().err
    assert "my_graph.py:15 (return toy(batch_size=count, colour=3)): TypeError: " in err
    assert "'colour'" in err and err.count("\n") == 1


def test_a_graph_file_that_fails_to_import_names_the_file_and_line(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("import os\n\nimport not_a_module_anywhere\n")
    assert main(["show", str(broken)]) == 2
    err = capsys.readouterr().err
    assert "broken.py:3 (import not_a_module_anywhere): ModuleNotFoundError" in err
    bad_syntax = tmp_path / "bad_syntax.py"
    bad_syntax.write_text("def build_graph(:\n    pass\n")
    assert main(["show", str(bad_syntax), "--options"]) == 2
    assert "bad_syntax.py:1: SyntaxError" in capsys.readouterr().err


def test_show_options_lists_types_defaults_and_docs_without_building(user_graph, capsys):
    assert main(["show", "graphs/mm_grpo.py", "--options"]) == 0
    lines = capsys.readouterr().out.splitlines()
    group = next(line for line in lines if line.startswith("group_size"))
    assert group.split()[:3] == ["group_size", "int", "4"] and "Samples per prompt" in group
    assert any(line.split()[:3] == ["on_bad_sample", "raise|skip", "'raise'"] for line in lines)
    assert not any(line.startswith("critic_lr") for line in lines)
    assert main(["show", str(user_graph), "--options"]) == 0
    table = textwrap.dedent(capsys.readouterr().out)
    assert table.splitlines()[0].split() == ["flag", "bool", "True"]
    assert not user_graph.with_suffix(".json").exists()  # build_graph was not called


def test_show_options_says_what_the_defaults_resolve_to_and_hides_what_does_nothing(capsys):
    def table(*flags):
        assert main(["show", "text_grpo", "--options", *flags]) == 0
        out = capsys.readouterr().out
        return {line.split()[0]: line for line in out.splitlines() if line}, out

    rows, out = table()
    assert "None -> 0.001 " in rows["lr"]  # the tiny policy's
    assert "vllm_sleep" not in rows and "lora_alpha" not in rows and "prompt_key" not in rows
    assert "vllm_gpu_memory, vllm_tensor_parallel" in out and "(with rollout=vllm)" in out
    rows, _ = table("--rollout", "vllm", "--set", "lora_r=8")
    assert "None -> True " in rows["vllm_sleep"] and "None -> 2.0 " in rows["tis_cap"]
    assert "lora_alpha" in rows and "prompt_key" not in rows
    rows, out = table("--all")
    assert "prompt_key" in rows and "not shown" not in out


def test_one_set_takes_several_pairs_and_numbers_as_python_writes_them():
    options = options_of("graphs/mm_ppo.py", "--set", "batch_size=1_6", "lr=.5e-3", "seed=+3")
    assert options == {"batch_size": 16, "lr": 0.0005, "seed": 3}


def test_a_graph_named_after_set_says_where_the_graph_goes(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["show", "--set", "batch_size=2", "graphs/mm_ppo.py"])
    assert exit_.value.code == 2
    assert "the graph goes before --set" in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_weights_dtype_and_include_shrink_what_the_rollout_loads_across_controllers(tmp_path):
    """``--set weights_dtype=bfloat16`` halves the bytes the rollout loads from the update on
    another controller (``weight_sync/bytes``), and ``weights_include`` sends only the names
    it matches; in one process the shared policy is loaded from nothing either way. The
    first run is a process of its own, the others run the same command's ``main`` here (a
    driver of its own each; the controllers are processes either way)."""
    from cli_helpers import yatt, yatt_here

    def loaded(name: str, *sets: str) -> float:
        out = tmp_path / name
        argv = ["run", "text_grpo", "--steps", "2", "--controllers", "2", "--quiet",
                "--set", "batch_size=4", "--out", str(out)]  # fmt: skip
        for pair in sets:
            argv += ["--set", pair]
        done = yatt(tmp_path, *argv, timeout=540) if name == "whole" else yatt_here(tmp_path, *argv)
        assert done.returncode == 0, done.stderr[-2000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return rows[-1]["weight_sync/bytes"]

    whole = loaded("whole")
    assert whole > 0
    assert loaded("bf16", "weights_dtype=bfloat16") == whole / 2
    assert 0 < loaded("head", 'weights_include=["lm_head|wte"]') < whole / 2


def _run_metrics(tmp_path, name: str, *argv: str) -> tuple[list[dict], dict]:
    """``yatt-graph run text_grpo`` for 2 steps of 4 prompts from ``tmp_path``: the metrics
    rows and the recorded settings."""
    from cli_helpers import yatt

    out = tmp_path / name
    done = yatt(tmp_path, "run", "text_grpo", "--steps", "2", "--quiet", "--out", str(out),
                "--set", "batch_size=4", *argv, timeout=150)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads((out / "settings.json").read_text())


@pytest.mark.timeout(300)
def test_policy_loss_gspo_and_sequence_masked_is_reach_the_update(tmp_path):
    """``--set policy_loss=gspo`` with GSPO's clip range clips whole responses of the second
    pass over each batch (the tiny policy's default is two); the sequence-level masked IS
    weights are reported (the sampler and the trainer are one float32 model here: nothing is
    masked at a cap of 10)."""
    ppo, _ = _run_metrics(tmp_path, "ppo")
    gspo, settings = _run_metrics(
        tmp_path, "gspo", "--set", "policy_loss=gspo", "clip_eps=3e-4", "clip_eps_high=4e-4",
        "tis_cap=10", "tis_level=sequence", "tis_mode=mask",
    )  # fmt: skip
    config = settings["config"]
    assert (config["policy_loss"], config["tis_level"], config["tis_mode"]) == (
        "gspo", "sequence", "mask",
    )  # fmt: skip
    assert "tis_masked" not in ppo[0] and "policy_loss" not in ppo[0]
    assert gspo[0]["clip_fraction"] > 0 and gspo[0]["clip_fraction"] != ppo[0]["clip_fraction"]
    assert all(r["tis_masked"] == 0.0 and r["tis_weight_mean"] > 0.99 for r in gspo)


@pytest.mark.timeout(300)
def test_val_samples_give_avg_and_pass_at_k_beside_the_greedy_reward(tmp_path):
    """``--set val_samples=4`` scores 4 sampled responses a validation row: with a reward that
    reads only the row (1 for a red shape, 0.25 otherwise), avg@4 and greedy are the rows'
    mean and pass@4 the share of red rows, every val_every steps; the report draws them."""
    answers = ["red", "blue", "red", "green", "red", "yellow"]
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": "what colour is the shape?", "answer": a})
                           + "\n" for a in answers))  # fmt: skip
    (tmp_path / "rewards.py").write_text(
        "def score(text, meta):\n    return 1.0 if meta['answer'] == 'red' else 0.25\n"
    )
    rows, settings = _run_metrics(
        tmp_path, "val", "--val-data", str(val), "--reward", "rewards.py:score",
        "--set", "val_samples=4", "val_temperature=0.7", "val_top_p=0.9", "val_every=1",
    )  # fmt: skip
    assert settings["config"]["val_samples"] == 4
    red = answers.count("red") / len(answers)
    for r in rows:
        assert "val/reward" not in r and r["val/samples"] == len(answers)
        assert r["val/avg@4"] == pytest.approx(red + (1 - red) * 0.25)
        assert r["val/greedy"] == pytest.approx(red + (1 - red) * 0.25)
        assert r["val/pass@4"] == pytest.approx(red)
    from runtime.train.report import report_data

    curves = {c["id"]: c for c in report_data(tmp_path / "val")["metrics"]["curves"]}
    assert curves["val-pass"]["key"] == "val/pass@4" and curves["val-avg"]["y"][0] > 0


def test_the_loss_and_correction_choices_are_listed_and_checked(capsys):
    """``show --options`` lists the registered policy losses; masked IS needs a cap above 1."""
    assert main(["show", "text_grpo", "--options", "--set", "tis_cap=2"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line}
    assert rows["policy_loss"].split()[1:3] == ["ppo|gspo", "'ppo'"]
    assert rows["tis_level"].split()[1] == "token|sequence" and "tis_mode" in rows
    assert main(["show", "text_grpo", "--set", "tis_mode=mask", "tis_cap=1"]) == 2
    err = capsys.readouterr().err
    assert "option tis_cap=1.0: must be > 1 with tis_mode=mask" in err and err.count("\n") == 1
