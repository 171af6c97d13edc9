"""What a new user of ``yatt-graph`` meets when a setting is wrong or does less than it seems:
an option the graph does not take, one of the other algorithm's, a node keyword in a message,
a learning-rate schedule that ends before the run, memory advice for the settings given, and
the summary of a resumed run. Each class is run as the user types it (``yatt-graph ...`` from
a folder outside the repository); its other cases go through ``runtime.cli.main`` in this
process, which is the same code without a new interpreter each time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import yatt, yatt_here

from graphs.config import PPOConfig, TextGRPOConfig
from runtime.cli import main
from yatt_graph.options import load_graph_module, module_options


def one_line(err: str) -> str:
    """The single line of ``err``: a refusal before anything is built is one line."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def last_line(err: str) -> str:
    """The last line of ``err`` (a run's first lines, memory plan and threads, come before)."""
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def graph_options_of(graph: str) -> set[str]:
    """The option names of a ready graph (its typed config's fields)."""
    return {o.name for o in module_options(load_graph_module(f"graphs.{graph}"))[0]}


def metric_rows(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A folder outside the repository, as the working folder of in-process commands."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --- 1. an unknown option: one line, the nearest options, where the options are listed -------
@pytest.mark.timeout(300)
def test_a_mistyped_option_is_one_line_with_the_nearest_options_and_exit_code_2(tmp_path):
    done = yatt(tmp_path, "run", "text_ppo", "--steps", "1", "--out", "o", "--set", "batch_sise=4")
    assert done.returncode == 2
    assert one_line(done.stderr) == (
        "yatt-graph run: unknown option 'batch_sise' for text_ppo (did you mean 'batch_size'?); "
        "`yatt-graph show text_ppo --options` lists the options of text_ppo"
    )
    assert not (tmp_path / "o" / "metrics.jsonl").exists()  # nothing ran
    listed = yatt(tmp_path, "show", "text_ppo", "--options")  # what the line points to
    assert listed.returncode == 0 and listed.stdout.splitlines()[0].split()[0] == "batch_size"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        # a name from another trainer: the options whose docs say it
        (
            ["run", "text_ppo", "--set", "learning_rate=1e-5"],
            "unknown option 'learning_rate' for text_ppo (did you mean 'lr' or 'critic_lr'?); ",
        ),
        (["run", "mm_grpo", "--set", "kl=0"], "for mm_grpo (did you mean 'kl_coef' or "),
        # a flag of the command given with --set: the flag, with its value
        (
            ["run", "text_ppo", "--set", "steps=5"],
            "for text_ppo: it is not a graph option but a flag of yatt-graph run: --steps 5; ",
        ),
        (["show", "text_ppo", "--set", "mermaid=yes"], "a flag of yatt-graph show: --mermaid; "),
        # a graph of the user's (options from its signature), for show and viz alike
        (["show", "my_graph.py", "--set", "vocabb=3"], "for my_graph.py (did you mean 'vocab'?)"),
        (["viz", "my_graph.py", "-o", "g.svg", "--set", "vocabb=3"], "yatt-graph viz: unknown "),
    ],
)
def test_each_way_to_give_an_unknown_option_says_the_same_line(here, capsys, argv, said):
    (here / "my_graph.py").write_text(
        "from graphs.toy import build_graph as toy\n\n\n"
        "def build_graph(vocab: int = 8):\n    return toy(vocab=vocab)\n"
    )
    assert main(argv) == 2
    line = one_line(capsys.readouterr().err)
    graph = argv[1]
    assert line.startswith(f"yatt-graph {argv[0]}: unknown option ") and said in line
    assert line.endswith(f"`yatt-graph show {graph} --options` lists the options of {graph}")
    assert "valid:" not in line and "TypeError" not in line
    assert not (here / "g.svg").exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("given", "said"),
    [
        (
            ["--vision", "tiny"],
            "unknown option 'vision' for text_ppo (given by --vision tiny): it is an option of "
            "mm_grpo and mm_ppo, not of text_ppo",
        ),
        (  # an option of the other algorithm names the graphs that take it
            ["--set", "group_size=4"],
            "unknown option 'group_size' for text_ppo: it is an option of mm_agent, mm_grpo, "
            "text_agent and text_grpo, not of text_ppo",
        ),
    ],
)
def test_an_option_of_other_graphs_names_them_in_the_same_line(tmp_path, given, said):
    done = yatt_here(tmp_path, "run", "text_ppo", "--steps", "1", *given)
    assert done.returncode == 2
    assert one_line(done.stderr) == (
        f"yatt-graph run: {said}; `yatt-graph show text_ppo --options` lists the options of "
        "text_ppo"
    )


def test_on_bad_sample_skip_for_a_graph_without_the_option_is_the_same_line(here, capsys):
    assert main(["run", "toy", "--steps", "1", "--on-bad-sample", "skip"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(
        "yatt-graph run: unknown option 'on_bad_sample' for toy (given by --on-bad-sample skip): "
        "its reward nodes decide"
    )
    assert line.endswith("`yatt-graph show toy --options` lists the options of toy")
    # raise is what a graph without the option does: the run goes on
    assert main(["run", "toy", "--steps", "1", "--on-bad-sample", "raise", "--quiet"]) == 0


# --- 2. an option of the other algorithm names the graphs that take it -----------------------


@pytest.mark.parametrize(
    ("graph", "pair", "others"),
    [
        ("mm_ppo", "estimator=rloo", ["mm_agent", "mm_grpo", "text_agent", "text_grpo"]),
        ("mm_grpo", "critic_lr=1e-3", ["mm_ppo", "text_ppo"]),
        ("text_grpo", "gamma=1", ["mm_ppo", "text_ppo"]),
        # the agent graphs have the field only to refuse a value: the graphs that take it
        ("text_ppo", "dynamic_sampling=0.5", ["mm_grpo", "text_grpo"]),
    ],
)
def test_an_option_of_the_other_algorithm_names_the_graphs_that_take_it(
    here, capsys, graph, pair, others
):
    assert main(["run", graph, "--steps", "1", "--set", pair]) == 2
    listed = f"{', '.join(others[:-1])} and {others[-1]}"
    line = one_line(capsys.readouterr().err)
    assert f"for {graph}: it is an option of {listed}, not of {graph}; " in line
    option = pair.partition("=")[0]  # the configs say the same: each of them has the field
    assert all(option in graph_options_of(g) for g in others)
    assert option not in graph_options_of(graph)


@pytest.mark.timeout(300)
def test_a_checkpoint_recording_an_option_the_graph_no_longer_takes_is_one_line(here, capsys):
    argv = ["run", "toy", "--steps", "2", "--out", "run", "--checkpoint-every", "2", "--quiet"]
    assert main(argv) == 0
    meta_path = here / "run" / "checkpoints" / "step_000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["graph_options"] = {"vocabb": 8}  # an option renamed since
    meta_path.write_text(json.dumps(meta))
    done = yatt(here, "export", "run", "policy")
    assert done.returncode == 2
    assert one_line(done.stderr).startswith(
        "yatt-graph export: error: run/checkpoints/step_000002/meta.json records the option "
        "'vocabb'=8 for graphs.toy, which takes no such option today (did you mean 'vocab'?)"
    )
    assert not (here / "policy").exists()
    # a folder that is not there is said to be not there, not to hold no checkpoints
    capsys.readouterr()
    assert main(["export", "rnu", "policy"]) == 2
    assert one_line(capsys.readouterr().err) == (
        "yatt-graph export: error: rnu does not exist; give a run folder (the --out of a run) "
        "or one of its checkpoints/step_N folders"
    )


# --- 3. node keywords in messages, as the user types them --------------------------------------
@pytest.mark.timeout(300)
def test_a_bad_reward_names_the_flag_that_skips_it_and_the_flag_does(here, capsys):
    (here / "nan_reward.py").write_text("def score(text, meta):\n    return float('nan')\n")
    argv = ["run", "text_ppo", "--steps", "2", "--reward", "nan_reward.py:score", "--quiet"]
    done = yatt(here, *argv)
    assert done.returncode == 2
    line = last_line(done.stderr)
    assert line.startswith("yatt-graph run: error: node 'reward' (RuleReward) stopped at step 0")
    assert "pass --on-bad-sample skip to score such samples 0" in line
    assert "on_bad_sample=" not in line
    assert main([*argv, "--on-bad-sample", "skip", "--out", "run"]) == 0  # what it says works
    assert metric_rows(here / "run")[-1]["skipped_samples_total"] > 0


@pytest.mark.timeout(300)
def test_a_node_refusing_a_value_names_the_set_the_user_types(tmp_path):
    done = yatt(tmp_path, "run", "text_ppo", "--steps", "1", "--set", "pack_sequences=true")
    assert done.returncode == 2
    line = last_line(done.stderr)
    assert "node 'ppo': --set pack_sequences=true needs a text causal LM" in line
    assert line.endswith("(use --set pack_sequences=false)")


def test_the_runtimes_and_the_configs_messages_name_the_flags_too(here, capsys):
    argv = ["run", "text_ppo", "--steps", "1", "--replicas", "rollout=2", "--set", "stream=true"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot have 2 replicas: it streams (--set stream=true)" in last_line(err)
    assert main(["show", "text_ppo", "--set", "tis_cap=2", "stream=true"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.endswith("use --set tis_cap=0 or use --set stream=false")


def test_keywords_become_what_the_user_types_and_other_text_stays():
    from runtime.run import typed_words

    def said(text: str, graph: str = "graphs.text_ppo") -> str:
        return typed_words(text, graph)

    assert said("or pass on_bad_sample='skip' to") == "or pass --on-bad-sample skip to"
    assert said("use rollout=hf.") == "use --rollout hf."  # a flag's option, any spelling
    assert said("device=cuda, but") == "--device cuda, but"
    assert said("(stream=True)") == "(--set stream=true)"
    assert said("set kl_coef=0 to leave it out") == "use --set kl_coef=0 to leave it out"
    assert said("prompt_key='my column'") == "--set 'prompt_key=my column'"
    # a value described, a keyword typed already, or one the graph does not take: as it is
    for text in (
        "max_new_tokens=2 more, 14 in all",
        "option lr=-1.0: must be > 0",
        "pass --set answer_key=<column>",
        "vf_coef=0.5 and value_clip_eps=None",
        "got 'rollout=abc'",  # the user's words, echoed
        "--replicas takes NODE=R pairs (--replicas rollout=2), got 'x'",  # a flag's value
    ):
        assert said(text) == text
    assert said("pass on_bad_sample='skip'", "graphs.toy") == "pass on_bad_sample='skip'"


def test_a_flags_message_keeps_its_own_words(tmp_path, monkeypatch, capsys):
    """A flag's error echoes what was typed: ``rollout=abc`` is --replicas' value, not the
    --rollout flag's, in a graph that has that flag."""
    monkeypatch.chdir(tmp_path)
    assert main(["run", "mm_ppo", "--replicas", "rollout=abc", "--quiet"]) == 2
    assert one_line(capsys.readouterr().err).endswith(
        "error: --replicas takes NODE=R pairs with R >= 1, separated by commas (--replicas "
        "rollout=2), got 'rollout=abc'"
    )


USER_FILES = {
    "broken.py": "def f(:\n",
    "boom.py": "import os\n\nraise RuntimeError('boom at import')\n",
    "fine.py": "def score(text, meta):\n    return 1.0\n\n\nclass Env:\n    pass\n",
}


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--reward", "broken.py:f"], "reward 'broken.py:f': broken.py:1: SyntaxError: "),
        (
            ["--reward", "boom.py:f"],
            "reward 'boom.py:f': boom.py:3 (raise RuntimeError('boom at import')): RuntimeError: "
            "boom at import",
        ),
        (["--reward", "fine.py:scor"], "reward 'fine.py:scor': fine.py has no 'scor'; what it "
         "defines to call: Env, score"),
        (["--reward", "gone.py:f"], "reward 'gone.py:f': Python file 'gone.py' does not exist "
         "(relative paths are from the folder the run starts in, "),
        (["--judge", "gone"], "node 'reward': judge model 'gone' is not a directory"),
        (["--reward-model", "fine.py"], "node 'reward': reward model path 'fine.py' is not a "
         "directory"),
        (["--env", "broken.py:Env"], "env 'broken.py:Env' cannot be loaded: broken.py:1: "),
        (["--env", "fine.py:Envv"], "env 'fine.py:Envv' cannot be loaded: fine.py has no 'Envv'"),
    ],
)  # fmt: skip
def test_a_users_file_or_folder_that_does_not_load_is_one_line_saying_where(
    flags, said, tmp_path, monkeypatch, capsys
):
    """A reward, environment or model the user names that is not there, does not import, or
    lacks the name: one line naming the place in the user's file, or what it defines, never
    the graph's own code (``building graphs... failed at graphs/text_grpo.py``)."""
    monkeypatch.chdir(tmp_path)
    for name, text in USER_FILES.items():
        (tmp_path / name).write_text(text)
    graph = "text_agent" if flags[0] == "--env" else "text_grpo"
    assert main(["run", graph, *flags, "--steps", "1", "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"yatt-graph run: error: graphs.{graph}: ") and said in line, line
    assert "/graphs/" not in line and "The spellings are" not in line


# --- 4. a learning rate that reaches 0 before the run's end -------------------------------
@pytest.mark.timeout(300)
def test_a_schedule_that_ends_before_the_run_is_said_at_start(here, capsys):
    argv = ["run", "text_ppo", "--steps", "5", "--out", "run", "--quiet"]
    done = yatt(here, *argv, "--set", "lr_schedule=linear", "lr_decay_steps=2")
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stderr.splitlines() if "learning rate to 0" in line]
    assert warned == [
        "yatt-graph run: warning: lr_schedule=linear brings the learning rate to 0 at step 2 "
        "(lr_warmup_steps 0 + lr_decay_steps 2), so steps 2-4 of this run will not train; use "
        "--set lr_decay_steps=5 to decay over the whole run, or stop the run there with --steps 2"
    ]
    lrs = [r["lr"] for r in metric_rows(here / "run")]
    assert lrs[0] > lrs[1] > 0 and lrs[2:] == [0.0, 0.0, 0.0]  # what the line said
    # a decay option with the constant schedule does nothing, and the run says so
    assert main([*argv, "--overwrite", "--set", "lr_decay_steps=2"]) == 0
    err = capsys.readouterr().err
    assert (
        "yatt-graph run: lr_decay_steps does nothing with these settings: it needs lr_schedule "
        "linear or cosine"
    ) in err.splitlines()
    assert "learning rate to 0" not in err


def test_no_warning_when_the_schedule_lasts_the_run():
    from graphs.advice import run_notes

    config = PPOConfig(lr_schedule="cosine", lr_warmup_steps=2, lr_decay_steps=8)
    assert run_notes(config, 10) == run_notes(config, 3) == []
    (note,) = run_notes(config, 11)
    assert "to 0 at step 10" in note and "so step 10 of this run" in note


# --- 5. memory advice that fits the settings -----------------------------------------------
HUGE = ["show", "text_grpo", "--memory", "--set", "group_size=10000000"]
"""A step of 160 million responses: no machine has room for it."""


def device_line(out: str) -> str:
    (line,) = [x for x in out.splitlines() if x.startswith("cpu: ")]
    return line


@pytest.mark.timeout(300)
def test_memory_advice_turns_micro_batches_on_with_a_value_when_off(tmp_path):
    done = yatt(tmp_path, *HUGE)
    assert done.returncode == 0, done.stderr
    line = device_line(done.stdout)
    assert "largest call: grpo" in line and "WILL NOT FIT" in line
    assert (
        "--set micro_batch_tokens=" in line
        and "(off now: one forward takes its whole batch)" in line
    )
    value = int(line.split("--set micro_batch_tokens=")[1].split()[0])
    assert value > 0 and value % 14 == 0  # whole rows (a prompt of 12 tokens, a response of 2)
    assert "--set gradient_checkpointing=true" in line
    assert "lower micro_batch_tokens" not in line and "lora_r" not in line  # tiny weights


def test_memory_advice_lowers_micro_batches_when_on_and_names_what_bounds_the_rollout(capsys):
    assert main([*HUGE, "micro_batch_tokens=1000000000"]) == 0
    line = device_line(capsys.readouterr().out)
    assert "--set micro_batch_tokens=" in line and "(now 1000000000)" in line
    assert "off now" not in line
    assert int(line.split("--set micro_batch_tokens=")[1].split()[0]) < 1000000000
    # one row a forward, checkpointed: the rollout's KV cache is what is left, and no budget
    # bounds it
    assert main([*HUGE, "micro_batch_tokens=14", "gradient_checkpointing=true"]) == 0
    line = device_line(capsys.readouterr().out)
    assert "largest call: rollout" in line
    assert "micro_batch_tokens" not in line and "gradient_checkpointing" not in line
    assert "lower batch_size (now 16), group_size (now 10000000) or max_new_tokens (now 2)" in line
    assert main(["show", "text_grpo", "--memory"]) == 0
    assert "fits in" in device_line(capsys.readouterr().out)


def test_memory_advice_for_the_state_follows_the_settings():
    from graphs.advice import memory_fixes
    from nodes.memory import Load
    from nodes.memory_plan import MemoryPlan

    gb = 2**30
    load = Load(prompts=4, responses=16, prompt_tokens=12, response_tokens=2)
    rows = [("grpo", "0", "cuda:0", {"weights": 20 * gb, "optimizer": 40 * gb, "activations": gb})]
    plan = MemoryPlan(load, rows, room={"cuda:0": 40 * gb})
    fixes = memory_fixes(TextGRPOConfig(), plan, "cuda:0")
    assert fixes[0].startswith("set lora_r=16") and fixes[1].startswith("set dtype=bfloat16")
    set_already = TextGRPOConfig(lora_r=8, dtype="bfloat16", gradient_checkpointing=True)
    assert not any("lora_r" in f or "dtype" in f for f in memory_fixes(set_already, plan, "cuda:0"))


# --- 6. a resumed run's summary covers the whole run --------------------------------------
@pytest.mark.timeout(300)
def test_a_resumed_runs_summary_and_report_cover_every_step(here, capsys):
    common = ["run", "toy", "--seed", "1", "--quiet"]
    assert main([*common, "--steps", "4", "--out", "run", "--checkpoint-every", "2"]) == 0
    done = yatt(here, *common, "--steps", "6", "--resume", "run")
    assert done.returncode == 0, done.stderr
    rows = metric_rows(here / "run")
    assert [r["step"] for r in rows] == list(range(6))
    summary = json.loads((here / "run" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["last_step"] == 5 and summary["resumed_at"] == 4
    first = sum(r["scores/mean"] for r in rows[:3]) / 3  # the window of a 6-step run is 3
    assert summary["window"] == 3 and summary["reward_first"] == pytest.approx(first, abs=1e-6)
    closing = done.stdout.strip().splitlines()
    assert json.loads(closing[-1]) == summary  # the closing line is the file's
    assert any(x.startswith("6 steps (resumed at step 4) in ") for x in closing)
    assert summary["wall_s"] > 0 and summary["samples_per_s"] > 0
    report = yatt(here, "report", "run")
    assert report.returncode == 0, report.stderr
    assert "finished: 6 steps (resumed at step 4) in " in (here / "run" / "report.html").read_text()
    # continued in another folder: that folder holds the whole run too
    resume = ["--resume", "run/checkpoints/step_000004", "--out", "more"]
    assert main([*common, "--steps", "6", *resume]) == 0
    more = metric_rows(here / "more")
    assert [r["scores/mean"] for r in more] == [r["scores/mean"] for r in rows]
    assert json.loads((here / "more" / "summary.json").read_text())["steps"] == 6


@pytest.mark.parametrize(
    ("name", "text"),
    [("header_only.csv", "prompt,answer\n"), ("blank.jsonl", "\n\n"), ("empty.csv", "")],
)
def test_a_data_file_without_rows_is_one_line_naming_it_not_a_bug(tmp_path, name, text):
    """Found while the run plans its memory (the first read of the data), before any step."""
    (tmp_path / name).write_text(text)
    run = yatt_here(tmp_path, "run", "text_grpo", "--data", name, "--steps", "1")
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and name in lines[0], run.stderr
    assert "bug" not in run.stderr and "Traceback" not in run.stderr
