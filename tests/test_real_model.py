"""A user's whole path on a real pretrained model: SmolLM2-135M-Instruct (llama, tied
embeddings, a chat template), prepared once by ``bench/smollm2.py`` (``make real-model``).

Each test runs ``yatt-graph`` as a user types it, in a subprocess, from a folder outside the
repository, for a step or two of a small batch (2 prompts x 2 responses of at most 8 tokens),
and checks the effect in the run folder. The model takes about 2 s to load and a step a few
seconds on one core. Where the package registry cannot be reached the model cannot be prepared
and these tests skip, saying so.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import YATT, yatt, yatt_here

SMALL = ["--set", "batch_size=2", "--set", "group_size=2", "--set", "max_new_tokens=8"]
QUESTIONS = [(a, b) for a in (3, 7, 12, 15) for b in (4, 9, 11)]

pytestmark = pytest.mark.timeout(600)


def run(cwd: Path, *argv: str, code: int = 0, timeout: float = 500) -> subprocess.CompletedProcess:
    """``yatt-graph ARGV`` in ``cwd``, as a user types it; its exit code must be ``code``."""
    done = yatt(cwd, *argv, timeout=timeout)
    assert done.returncode == code, (
        f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    )
    return done


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def write_math(path: Path, *, chat: bool, rows: int = 12) -> Path:
    """Sums to answer with a number, as chat messages (a list of ``{"role", "content"}``, as
    TRL's conversational datasets hold them) or as text."""
    records = []
    for a, b in QUESTIONS[:rows]:
        question = f"What is {a} + {b}? Answer with the number only."
        prompt = [{"role": "user", "content": question}] if chat else question
        records.append({"prompt": prompt, "answer": str(a + b)})
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        import datasets

        ds = datasets.Dataset.from_list(records)
        ds.to_parquet(str(path)) if path.suffix == ".parquet" else ds.save_to_disk(str(path))
    return path


REWARDS = '''
import re


def number(text, meta):
    """1 when the response's last number is the answer (a fn(text, meta) reward)."""
    found = re.findall(r"-?\\d+", text)
    return 1.0 if found and found[-1] == str(meta["answer"]) else 0.0


def trl_number(prompts, completions, answer, **columns):
    """The same, written for TRL (conversational data gives message lists), less a little for
    length, so that a group's scores differ and the update has something to learn."""
    out = []
    for prompt, completion, want in zip(prompts, completions, answer):
        assert isinstance(prompt, list) and prompt[-1]["role"] == "user", prompt
        assert isinstance(completion, list) and completion[0]["role"] == "assistant", completion
        found = re.findall(r"-?\\d+", completion[0]["content"])
        right = 1.0 if found and found[-1] == want else 0.0
        out.append(right - len(completion[0]["content"]) / 1000)
    return out
'''


def test_chat_message_prompts_a_trl_reward_validation_and_export(real_model, tmp_path):
    """The README's own-model command on chat-message prompts (JSONL), with a TRL-style reward,
    greedy validation on a Parquet of chat prompts, trained by 2 ranks with the reference
    sharded over them, and --export: the exported folder (gathered from the ranks) loads with
    transformers' Auto classes and its greedy answer is the project's policy's."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    write_math(tmp_path / "math.jsonl", chat=True)
    write_math(tmp_path / "val.parquet", chat=True, rows=4)
    done = run(
        tmp_path, "run", "text_grpo", "--policy", str(real_model), "--data", "math.jsonl",
        "--reward", "rewards.py:trl_number", "--val-data", "val.parquet", "--set", "val_every=1",
        "--set", "val_rows=2", "--steps", "2", "--out", "run", "--export", "run/policy",
        "--samples-every", "1", "--glance-every", "1", "--checkpoint-every", "2", *SMALL,
        "--train-ranks", "2", "--set", "shard_reference=true",
    )  # fmt: skip
    assert "prompts are formatted with the model's chat template" in done.stderr
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["samples"] == 4 and -1 <= r["scores/mean"] <= 1 for r in rows)
    assert all(r["val/samples"] == 2 for r in rows)
    assert rows[-1]["grad_norm"] > 0  # the update trained on real tokens
    # the sharded reference scores as the policy it started as: no KL at step 0 (0.0 measured;
    # rows of another response would give about a nat), and a KL once the policy has moved
    assert rows[0]["kl_ref"] <= 1e-4 < rows[-1]["kl_ref"], [r["kl_ref"] for r in rows]
    import pandas as pd

    samples = pd.read_parquet(tmp_path / "run" / "samples")
    assert len(samples) == 8
    assert samples["prompt"].str.fullmatch(r"user: What is \d+ \+ \d+\? Answer .*").all()
    assert "user: What is" in done.stdout + done.stderr  # the glance shows the messages' text

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nodes.models.policy import build_policy

    exported = tmp_path / "run" / "policy"
    hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(exported)
    start = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32)
    moved = max(
        float((a - b).abs().max())
        for a, b in zip(hf.state_dict().values(), start.state_dict().values())
    )
    assert moved > 0, "the exported weights are the starting model's"
    messages = [{"role": "user", "content": "What is 12 + 9? Answer with the number only."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=12, do_sample=False)
    hf_text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    ours = build_policy({"path": str(exported)})
    gen = ours.generate(ours.encode_prompts([messages]), max_new_tokens=12, temperature=0.0)
    ours_text = ours.tokenizer.decode(gen.response_ids[0][gen.response_mask[0] > 0],
                                      skip_special_tokens=True)  # fmt: skip
    assert ours_text.strip() and hf_text == ours_text, (hf_text, ours_text)


def test_text_prompts_from_parquet_with_a_plain_reward_and_ppo_from_a_saved_dataset(
    real_model, tmp_path
):
    """Plain-text prompts (the chat template applied) with ``fn(text, meta)`` in text_grpo,
    and chat-message prompts from a ``save_to_disk`` folder in text_ppo (critic and all),
    trained by 2 ranks with the critic and the reference scoring on them."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    write_math(tmp_path / "math.parquet", chat=False)
    write_math(tmp_path / "chat_ds", chat=True)
    run(
        tmp_path, "run", "text_grpo", "--policy", str(real_model), "--data", "math.parquet",
        "--reward", "rewards.py:number", "--steps", "1", "--out", "grpo", "--samples-every", "1",
        *SMALL,
    )  # fmt: skip
    import pandas as pd

    samples = pd.read_parquet(tmp_path / "grpo" / "samples")
    assert samples["prompt"].str.fullmatch(r"What is \d+ \+ \d+\? Answer .*").all()
    done = run(
        tmp_path, "run", "text_ppo", "--policy", str(real_model), "--data", "chat_ds",
        "--reward", "rewards.py:number", "--steps", "1", "--out", "ppo", "--quiet",
        "--set", "batch_size=2", "--set", "max_new_tokens=8", "--train-ranks", "2",
        "--set", "shard_critic=true", "--set", "shard_reference=true",
    )  # fmt: skip
    # quiet: no progress bar at all, transformers' "Loading weights" (policy, reference and
    # critic, in the driver and the rank process) included
    assert "it/s]" not in done.stderr + done.stdout, done.stderr[-3000:]
    (row,) = metrics(tmp_path / "ppo")
    assert row["samples"] == 2 and row["critic_grad_norm"] > 0, sorted(row)
    # the sampler's logprobs against the sharded reference's: only their float gap (0.011
    # measured; the bf16 test reports it), where a reference scoring other rows gives nats
    assert abs(row["advantage/kl"]) < 0.1, row["advantage/kl"]


def test_sampled_logprobs_equal_the_trainers_in_float32_and_the_bf16_gap_is_reported(
    real_model, tmp_path
):
    """With ``recompute_logprobs`` the rollout recomputes its logprobs teacher-forced, as the
    update computes them, and the update reports the gap to the sampled ones. In float32 on
    the CPU the two agree to 2e-3 nats a token (cached attention sums in another order); in
    bf16 autocast (the default where the CPU has bf16) the gap is reported, larger."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    write_math(tmp_path / "math.jsonl", chat=True)
    gaps = {}
    for precision in ("no", "bf16"):
        run(
            tmp_path, "run", "text_grpo", "--policy", str(real_model), "--data", "math.jsonl",
            "--reward", "rewards.py:number", "--steps", "1", "--out", precision,
            "--set", f"mixed_precision={precision}", "--set", "recompute_logprobs=true", *SMALL,
        )  # fmt: skip
        (row,) = metrics(tmp_path / precision)
        gaps[precision] = (row["logprob_gap_mean"], row["logprob_gap_max"])
    print("logprob gap (mean, max):", gaps)
    assert gaps["no"][1] < 2e-3, gaps
    assert gaps["bf16"][0] > gaps["no"][0], gaps


TOOL_ENV = '''
import re

from nodes.agents import ToolEnv


def add(a, b):
    return str(int(a) + int(b))


class Sums(ToolEnv):
    """Answer a sum; the ``add`` tool adds two numbers."""

    tools = {"add": add}
    max_turns = 2

    def reset(self, row):
        self.answer = row["answer"]
        return super().reset(row)

    def score(self, answer):
        found = re.findall(r"-?\\d+", answer)
        return 1.0 if found and found[-1] == self.answer else 0.0
'''


def test_text_agent_with_a_users_tool_environment(real_model, tmp_path):
    (tmp_path / "sums.py").write_text(TOOL_ENV)
    write_math(tmp_path / "math.jsonl", chat=False)
    run(
        tmp_path, "run", "text_agent", "--policy", str(real_model), "--env", "sums.py:Sums",
        "--data", "math.jsonl", "--steps", "1", "--out", "agent", "--samples-every", "1",
        *SMALL,
    )  # fmt: skip
    (row,) = metrics(tmp_path / "agent")
    assert row["samples"] == 4 and 1 <= row["agent/turns_mean"] <= 2, row
    import pandas as pd

    samples = pd.read_parquet(tmp_path / "agent" / "samples")
    assert len(samples) == 4 and samples["response"].str.len().gt(0).all()


def _peak_rss_of(cwd: Path, *argv: str) -> int:
    """The peak RSS (bytes) of ``yatt-graph ARGV`` run in-process in a fresh wrapper."""
    code = (
        "import resource, subprocess, sys\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "sys.stderr.write(done.stderr[-3000:])\n"
        "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, YATT, *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=500)  # fmt: skip
    status, peak = done.stdout.split()
    assert status == "0", done.stderr
    return int(peak)


def test_the_memory_plan_is_within_25_percent_of_the_measured_peak(real_model, tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    write_math(tmp_path / "math.jsonl", chat=True)
    argv = ["text_grpo", "--policy", str(real_model), "--data", "math.jsonl", "--reward",
            "rewards.py:number", "--set", "batch_size=4", "--set", "group_size=4",
            "--set", "max_new_tokens=16"]  # fmt: skip
    done = yatt_here(tmp_path, "show", *argv, "--memory")  # no run: in this process
    assert done.returncode == 0, done.stderr
    shown = done.stdout
    match = re.search(r"cpu: ([\d.]+) (GB|MB) at the peak", shown)
    assert match, shown
    plan = float(match[1]) * (1e9 if match[2] == "GB" else 1e6)
    peak = _peak_rss_of(tmp_path, "run", *argv, "--steps", "2", "--out", "mem", "--quiet")
    print(f"memory plan {plan / 1e9:.2f} GB, measured peak {peak / 1e9:.2f} GB")
    assert abs(plan - peak) <= 0.25 * peak, (plan, peak)
    shutil.rmtree(tmp_path / "mem")
