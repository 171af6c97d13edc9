"""What a new user of the nodes meets, run as the user types it (``yatt-graph ...`` from a folder
outside the repository): a model folder that lacks a part, an agent's samples and glances, an
exported tiny policy read back with transformers' Auto classes, a reward that returns the wrong
thing, and an environment that raises or hangs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import YATT, yatt, yatt_here
from process_helpers import hanging_graph, hanging_lines

from nodes.agents import ToolEnv
from nodes.data import task_vocabulary
from yatt_graph import UsageError

PROMPT = "what color is the shape ?"  # a task prompt (the shapes task's colour question)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """The run's refusal: exit code 2, one ``error:`` line and no traceback."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "a bug in yatt-graph" not in done.stderr, done.stderr
    lines = [x for x in done.stderr.splitlines() if " error: " in x]
    assert len(lines) == 1, done.stderr
    return lines[0]


def metric_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# --- 1. a model folder that lacks a part ------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Whole folders of the tiny policies, as save_pretrained writes them."""
    from nodes.models.policy import build_policy

    root = tmp_path_factory.mktemp("models")
    words = task_vocabulary()
    for name, spec in (
        ("lm", {"name": "tiny-qwen2", "words": words}),
        ("vlm", {"name": "tiny-qwen2-vl", "words": words}),
        ("prefix", {"name": "tiny-prefix-vlm", "words": words}),
    ):
        build_policy(spec).save_pretrained(root / name)
    return root


def _variant(saved: Path, base: str, into: Path, drop=(), write=None) -> Path:
    shutil.copytree(saved / base, into)
    for name in drop:
        (into / name).unlink()
    for name, text in (write or {}).items():
        (into / name).write_text(text)
    return into


def _sharded(folder: Path) -> None:
    """The weights as a two-shard checkpoint whose second shard did not arrive."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    save_file({k: tensors[k] for k in names[:half]}, folder / "model-00001-of-00002.safetensors")
    weight_map = {
        k: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, k in enumerate(names)
    }
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model.safetensors").unlink()


@pytest.mark.timeout(600)
def test_an_incomplete_model_folder_is_one_line_naming_it_before_any_step(saved, tmp_path):
    """A folder without its tokenizer or weights, or a VLM without its processor, for
    --policy, --reward-model and --judge: exit 2, one line naming the folder, what is missing
    and the fix, and no step run (no metrics.jsonl), where some were a traceback ending in
    "a bug in yatt-graph" from inside the memory plan."""
    _variant(saved, "lm", tmp_path / "no-tokenizer", ["tokenizer.json"])
    _variant(saved, "lm", tmp_path / "no-weights", ["model.safetensors"])
    _variant(saved, "vlm", tmp_path / "vlm-no-processor", ["processor_config.json"])
    no_tokenizer = ["'no-tokenizer' holds no tokenizer", "tokenizer.save_pretrained(path)"]
    no_weights = ["'no-weights' holds no weights", "model.save_pretrained(path)"]
    cases = [
        (["text_grpo", "--policy", "no-tokenizer"], no_tokenizer),
        (["text_ppo", "--policy", "no-weights"], no_weights),
        (
            ["mm_grpo", "--policy", "vlm-no-processor"],
            [
                "'vlm-no-processor' holds an image-text-to-text model but no image processor",
                "AutoProcessor.from_pretrained(original).save_pretrained(path)",
            ],
        ),
        (["text_grpo", "--reward-model", "no-weights"], ["node 'reward'", *no_weights]),
        (["text_grpo", "--judge", "no-tokenizer"], ["node 'reward'", *no_tokenizer]),
    ]
    for i, (args, words) in enumerate(cases):
        out = tmp_path / f"out-{i}"
        run = yatt if i == 0 else yatt_here  # (one in a process of its own, as typed)
        done = run(tmp_path, "run", *args, "--steps", "1", "--out", str(out), "--quiet")
        line = one_error_line(done)
        for word in words:
            assert word in line, line
        assert not (out / "metrics.jsonl").exists()


def test_every_part_a_model_folder_can_lack_is_named_with_its_fix(saved, tmp_path):
    """What the nodes of every model flag check when they are made (check_model_dir): each
    part a folder can lack, as a UsageError (one line, exit 2 in yatt-graph)."""
    from nodes.models.policy import check_model_dir, check_policy_spec

    def refused(folder: Path, *words: str) -> None:
        with pytest.raises(UsageError) as info:
            check_policy_spec({"path": str(folder)})  # what the policy's nodes call
        assert "\n" not in str(info.value)
        for word in words:
            assert word in str(info.value), info.value

    refused(
        _variant(saved, "lm", tmp_path / "bad-config", write={"config.json": '{"model_'}),
        "bad-config/config.json' is not valid JSON",
        "rewrite it",
    )
    refused(
        _variant(saved, "lm", tmp_path / "no-type", write={"config.json": "{}"}),
        "names no model_type",
    )
    _sharded(_variant(saved, "lm", tmp_path / "shard-missing"))
    refused(
        tmp_path / "shard-missing",
        "model.safetensors.index.json' names 1 of 2 weight files that are not in the folder",
        "(model-00002-of-00002.safetensors)",
        "copy every file it lists",
    )
    refused(
        _variant(saved, "prefix", tmp_path / "no-projector", ["projector.safetensors"]),
        "no-projector/projector.safetensors' is missing",
        "save the policy again",
    )
    refused(
        _variant(saved, "prefix", tmp_path / "prefix-lm-no-tokenizer", ["lm/tokenizer.json"]),
        "prefix-lm-no-tokenizer/lm' holds no tokenizer",
    )
    folder = _variant(saved, "lm", tmp_path / "vocab-only", ["tokenizer.json"])
    (folder / "vocab.json").write_text("{}")
    refused(folder, "has the tokenizer's vocab.json but not its merges.txt")
    if importlib.util.find_spec("sentencepiece") is None:
        folder = _variant(saved, "lm", tmp_path / "spm-only", ["tokenizer.json"])
        (folder / "tokenizer.model").write_bytes(b"\0")
        refused(folder, "only as tokenizer.model (SentencePiece)", "pip install sentencepiece")
    folder = _variant(saved, "lm", tmp_path / "adapter", ["model.safetensors"])
    (folder / "adapter_config.json").write_text("{}")
    refused(folder, "holds a LoRA adapter", "merge it into its base model")
    assert check_model_dir(saved / "vlm") == "vlm"  # a whole folder passes


@pytest.mark.timeout(300)
def test_the_real_model_without_its_tokenizer_is_one_line_not_a_bug(real_model, tmp_path):
    """The report: SmolLM2's config.json and weights, no tokenizer. The weights are linked,
    not copied; nothing loads them."""
    folder = tmp_path / "smol"
    folder.mkdir()
    shutil.copy(real_model / "config.json", folder / "config.json")
    os.symlink(real_model / "model.safetensors", folder / "model.safetensors")
    done = yatt(tmp_path, "run", "text_grpo", "--policy", "smol", "--steps", "1", "--quiet")
    line = one_error_line(done)
    assert "'smol' holds no tokenizer (none of tokenizer.json" in line, line


# --- 2. and 5. an agent's samples, and an environment that raises ------------------------------
QUIZ_ENV = """
from nodes.agents import Environment, Observation


class Quiz(Environment):
    max_turns = 2
    failure_reward = -1.0
    words = ("please", "answer", ":")

    def reset(self, row):
        return Observation("please answer : " + row["prompt"])

    def step(self, action):
        raise ValueError("the quiz broke")
"""


@pytest.mark.timeout(300)
def test_agent_samples_show_what_reset_showed_and_a_failing_step_ends_its_trajectory(
    tmp_path,
):
    """The samples file's prompt and the glance are the reset observation's text, not the
    data row's prompt; a step that raises ends its trajectory with failure_reward, is counted
    in agent/env_errors and kept in the samples, said once on stderr, and the run goes on."""
    (tmp_path / "quiz.py").write_text(QUIZ_ENV)
    out = tmp_path / "run"
    done = yatt(
        tmp_path, "run", "text_agent", "--env", "quiz.py:Quiz", "--steps", "2", "--out", str(out),
        "--samples-every", "1", "--glance-every", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = f"please answer : {PROMPT}"
    import pandas

    samples = pandas.read_parquet(out / "samples" / "step-000000.parquet")
    assert set(samples["prompt"]) == {shown}, samples["prompt"]
    assert set(samples["env_error"]) == {"Quiz.step raised ValueError: the quiz broke"}
    assert set(samples["reward"]) == {-1.0} and set(samples["turns"]) == {1}
    glances = [x for x in done.stderr.splitlines() if x.strip().startswith(repr(shown))]
    assert len(glances) >= 2, done.stderr  # each step's glance shows what the policy saw
    said = [x for x in done.stderr.splitlines() if "the quiz broke" in x]
    assert len(said) == 1, done.stderr  # once, over both steps
    assert "Quiz.step raised ValueError: the quiz broke" in said[0]
    assert "quiz.py:" in said[0] and "agent/env_errors" in said[0]
    rows = metric_rows(out)
    assert [r["agent/env_errors"] for r in rows] == [len(samples)] * 2


# --- 5. an environment that hangs, and SIGTERM while it does ------------------------------------
HANGING_ENV = """
import time
from pathlib import Path

from nodes.agents import Environment, Observation


class Stuck(Environment):
    max_turns = 2
    time_limit_s = {limit}

    def reset(self, row):
        return Observation(row["prompt"])

    def step(self, action):
        Path("hung").touch()
        time.sleep(1000)
"""


@pytest.mark.timeout(300)
def test_a_step_past_its_time_limit_ends_its_trajectory_and_the_run_goes_on(tmp_path):
    """A step that sleeps 1000 s under time_limit_s = 0.5: each trajectory ends, counted
    every step, said once, and the run ends (an in-process run hung on it before)."""
    (tmp_path / "stuck.py").write_text(HANGING_ENV.format(limit=0.5))
    out = tmp_path / "run"
    done = yatt(
        tmp_path, "run", "text_agent", "--env", "stuck.py:Stuck", "--steps", "2", "--out",
        str(out), "--quiet", "--set", "batch_size=2", "group_size=2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = [x for x in done.stderr.splitlines() if "ran past its time limit" in x]
    assert len(said) == 1 and "Stuck.step ran past its time limit of 0.5 s" in said[0], said
    assert [r["agent/env_errors"] for r in metric_rows(out)] == [4.0, 4.0]


@pytest.mark.timeout(300)
def test_a_first_sigterm_during_a_hung_call_says_it_is_stopping_and_what_it_waits_on(tmp_path):
    """In-process, an environment step that hangs (its limit far off): the first SIGTERM
    prints at once that the run stops after the step and the node and line it waits on; the
    second stops it, exit 143."""
    (tmp_path / "stuck.py").write_text(HANGING_ENV.format(limit=600))
    cmd = [YATT, "run", "text_agent", "--env", "stuck.py:Stuck", "--steps", "3", "--out", "run",
           "--quiet", "--set", "batch_size=2", "group_size=2"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 200
        while not (tmp_path / "hung").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        while not any("SIGTERM" in x for x in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        assert proc.poll() is None  # still waiting for the step
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        proc.kill()
    said = next(x for x in lines if "SIGTERM: stopping" in x)
    assert "stopping after the step in progress, which is waiting on node 'rollout' " in said
    assert "(AgentRollout), step 0" in said and "in call_with_limit" in said, said
    assert "a second SIGTERM stops at once" in said
    assert proc.returncode == 143, "".join(lines)


@pytest.mark.timeout(120)
def test_a_first_sigterm_names_the_line_of_the_users_node_it_waits_on(tmp_path):
    (tmp_path / "my_graph.py").write_text(hanging_graph())
    cmd = [YATT, "run", "my_graph.py", "--steps", "3", "--quiet"]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "hung"
        proc.send_signal(signal.SIGTERM)
        said = ""
        while "SIGTERM" not in said:
            said = proc.stderr.readline()
            assert said, "stderr ended before the SIGTERM line"
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "waiting on node 'stuck' (FunctionNode), step 0, for " in said, said
    # the line of the node's own code it is at: its print, or the sleep after it
    printed, slept = hanging_lines()
    assert re.search(rf"\(at my_graph\.py:({printed}|{slept}) in stuck\)", said), said
    assert proc.returncode == 143


# --- 3. an exported tiny policy, read back with the Auto classes ------------------------------
def _round_trips(folder: Path, **kwargs) -> None:
    """AutoTokenizer of ``folder`` encodes the task prompt as its tokenizer.json does, with
    no unknown word, and decodes it back to the prompt."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    own = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert ids == own.encode(PROMPT, add_special_tokens=False).ids
    assert len(ids) == len(PROMPT.split()) and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == PROMPT


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("graph", "policy", "lm"),
    [("text_grpo", "tiny-qwen2", "."), ("mm_grpo", "tiny", "lm")],
)
def test_an_exported_tiny_policy_loads_with_the_auto_classes(tmp_path, graph, policy, lm):
    """``--export`` of the tiny Qwen2 (AutoTokenizer gave it Qwen2's own class, which dropped
    every word) and of the prefix-VLM (whose tokenizer was only in lm/)."""
    from transformers import AutoModelForCausalLM

    done = yatt(tmp_path, "run", graph, "--policy", policy, "--steps", "1", "--export", "exported",
                "--quiet")  # fmt: skip
    assert done.returncode == 0, done.stderr
    folder = tmp_path / "exported"
    _round_trips(folder)
    _round_trips(folder, trust_remote_code=True)  # the class its auto_map names, beside it
    model = AutoModelForCausalLM.from_pretrained(folder / lm)
    assert model.get_input_embeddings().num_embeddings >= len(task_vocabulary())


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-qwen2-vl"])
def test_every_tiny_policy_saved_as_export_writes_it_loads_with_the_auto_classes(name, tmp_path):
    from transformers import AutoProcessor

    from nodes.models.policy import build_policy, load_policy

    policy = build_policy({"name": name, "words": task_vocabulary()})
    policy.save_pretrained(tmp_path / "p")  # what --export calls
    _round_trips(tmp_path / "p")
    _round_trips(tmp_path / "p", trust_remote_code=True)
    if name == "tiny-qwen2-vl":
        processor = AutoProcessor.from_pretrained(tmp_path / "p")
        assert processor.tokenizer(PROMPT)["input_ids"] == policy.tokenizer(PROMPT)["input_ids"]
    again = load_policy(tmp_path / "p")
    assert again.tokenizer(PROMPT)["input_ids"] == policy.tokenizer(PROMPT)["input_ids"]


# --- 4. a reward that returns the wrong thing ----------------------------------------------------
REWARDS = """
def short(prompts, completions, **columns):
    return [1.0] * (len(completions) - 1)


def text_score(text, meta):
    return "high"
"""


@pytest.mark.timeout(400)
def test_a_reward_returning_the_wrong_thing_is_one_line_naming_it_or_skipped(tmp_path):
    """A TRL-style reward one score short, and a fn(text, meta) returning a word: one line
    naming the function, what it returned and what is expected, exit 2; with
    --on-bad-sample skip the short batch's samples are scored 0, counted, and the run ends."""
    (tmp_path / "rw.py").write_text(REWARDS)
    args = ["run", "text_grpo", "--steps", "1", "--quiet", "--set", "batch_size=2", "group_size=2"]
    line = one_error_line(yatt(tmp_path, *args, "--reward", "rw.py:short"))
    assert "reward function rw:short returned a list of 3 score(s) for 4 completions" in line
    assert "returns a list of one score per completion" in line and "--on-bad-sample skip" in line
    line = one_error_line(yatt(tmp_path, *args, "--reward", "rw.py:text_score"))
    assert (
        "sample 0 got a non-numeric score (str) 'high' from reward function rw:text_score" in line
    )
    assert "a reward must be a finite number" in line
    out = tmp_path / "skipped"
    done = yatt(tmp_path, *args, "--reward", "rw.py:short", "--on-bad-sample", "skip",
                "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "reward function rw:short returned a list of 3 score(s) for 4 completions" in done.stderr
    (row,) = metric_rows(out)
    assert row["skipped_samples"] == 4


def test_a_trl_reward_returning_no_list_names_what_it_returned():
    from nodes.rewards import RuleReward

    node = RuleReward(scalar_reward, name="r")
    with pytest.raises(UsageError, match=r"returned a float \(1.0\) for 2 completions"):
        node.run(texts=["a", "b"], prompts=["p", "q"])
    arrays = RuleReward(tensor_reward)  # a 1-D tensor (or numpy array) is a list
    assert arrays.run(texts=["a", "b"], prompts=["p", "q"])["scores"].tolist() == [0.0, 1.0]


def scalar_reward(prompts, completions, **columns):
    return 1.0


def tensor_reward(prompts, completions, **columns):
    return torch.arange(len(completions), dtype=torch.float32)


# --- 5. in one call: a reset that fails ends its trajectory; a UsageError stops the run ---------
class Picky:
    """Fails to reset on the second prompt; stops the run on a prompt it cannot take."""

    max_turns = 1
    failure_reward = -2.0

    def reset(self, row):

        if row["prompt"] == "stop":
            raise UsageError("Picky: the data has no questions")
        if row["prompt"] == "how many shapes ?":
            raise KeyError("answer")
        return row["prompt"]

    def step(self, action):
        return None, 1.0, True


def test_a_reset_that_raises_ends_only_its_trajectories():
    from nodes.agents import AgentRollout, AgentStats

    node = AgentRollout(
        policy={"name": "tiny-qwen2", "words": task_vocabulary()}, env=Picky, n=2,
        max_new_tokens=2,
    )  # fmt: skip
    out = node.run(prompts=[PROMPT, "how many shapes ?"], meta=None)
    assert out["scores"].tolist() == [1.0, 1.0, -2.0, -2.0]
    records = out["trajectories"]
    assert [r["env_error"] for r in records] == [
        None,
        None,
        *["Picky.reset raised KeyError: 'answer'"] * 2,
    ]
    assert [r["turns"] for r in records] == [1, 1, 0, 0]
    assert AgentStats().run(trajectories=records)["stats"]["env_errors"] == 2.0
    with pytest.raises(UsageError, match="Picky: the data has no questions"):
        node.run(prompts=["stop"], meta=None)
    with pytest.raises(UsageError, match=r"reset failed for every trajectory of the call \(2\)"):
        node.run(prompts=["how many shapes ?"], meta=None)  # nothing left to train on


class Hangs(ToolEnv):
    """Every action calls a tool that hangs past the limit."""

    max_turns = 1
    time_limit_s = 0.5
    failure_reward = -1.0

    @property
    def tools(self):
        return {"hang": lambda: time.sleep(1000)}

    def step(self, action):
        return super().step("hang")

    def score(self, answer):
        return 1.0


def test_a_tool_past_the_limit_under_the_rollout_is_still_the_tools_error():
    """One mechanism, two limits: the rollout waits a grace past a ToolEnv's limit, so the
    ToolEnv ends the hung tool call itself and it counts as that tool's error."""
    from nodes.agents import AgentRollout, AgentStats

    node = AgentRollout(
        policy={"name": "tiny-qwen2", "words": task_vocabulary()}, env=Hangs, n=2,
        max_new_tokens=2,
    )  # fmt: skip
    out = node.run(prompts=[PROMPT], meta=None)
    records = out["trajectories"]
    assert [r["tool_errors"] for r in records] == [["hang: ran past its time limit of 0.5 s"]] * 2
    assert [r["env_error"] for r in records] == [None, None]
    assert out["scores"].tolist() == [-1.0, -1.0]
    stats = AgentStats().run(trajectories=records)["stats"]
    assert stats["tool_errors"] == 2.0 and stats["env_errors"] == 0.0
