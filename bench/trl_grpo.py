"""Benchmark: one GRPO task in TRL's GRPOTrainer and in ``yatt-graph run text_grpo``, side by
side in one run.

The model is ``bench.real_model``'s 98M Qwen2 with a BPE tokenizer built in code, loaded from
its folder by both. The data is a JSONL of prompts (words of the tokenizer's corpus); the
reward is one TRL-style function, ``reward(prompts, completions, **columns)``, which both take
as it is (yatt-graph tells it from ``fn(text, meta)`` by its ``completions`` parameter). Both
run the same step: ``--prompts`` prompts x ``--group`` completions of up to
``--max-new-tokens`` tokens, temperature 1, no KL term (TRL's default ``beta=0``: no
reference model in either), token-mean loss (TRL's default ``dapo``), one optimizer step per
generation batch, AdamW at lr 1e-6, float32 on the CPU, and micro-batches: TRL's
``per_device_train_batch_size`` rows with gradient accumulation, ours a budget of padded tokens
(``micro_batch_tokens``) that holds about as many rows.

Each framework runs in a fresh process for ``--steps`` steps; the first step is a warm-up and
the rest are timed (TRL: a callback at each step's end; ours: the metrics' step times).
Reported: seconds a step, completions/s, completion tokens/s, and the process's peak RSS.

    bash bench/install_trl.sh                  # TRL into .bench/trl (bench only)
    .venv/bin/python -m bench.trl_grpo --model DIR   # about 10 min
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from bench._util import last_json, machine, peak_run, table

REWARD = '''
def reward(prompts, completions, **columns):
    """The share of a completion's words that appear in its prompt (a TRL-style reward)."""
    out = []
    for prompt, completion in zip(prompts, completions):
        words = completion.split()
        seen = set(prompt.split())
        out.append(sum(w in seen for w in words) / len(words) if words else 0.0)
    return out
'''

_TRL = r"""
import json, sys, time
sys.path.append(sys.argv[1])  # .bench/trl, after site-packages
import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
model_dir, data, reward_file, out, steps, prompts, group, new_tokens, micro = sys.argv[2:11]
steps, prompts, group, new_tokens, micro = map(int, (steps, prompts, group, new_tokens, micro))
torch.manual_seed(0)
namespace = {}
exec(open(reward_file).read(), namespace)
ends = []
class Clock(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        ends.append(time.perf_counter())
completions = prompts * group
config = GRPOConfig(
    output_dir=out, use_cpu=True, max_steps=steps, learning_rate=1e-6, beta=0.0,
    num_generations=group, max_completion_length=new_tokens, temperature=1.0,
    per_device_train_batch_size=micro, gradient_accumulation_steps=completions // micro,
    logging_steps=1, report_to=[], save_strategy="no", bf16=False, seed=0,
    dataloader_num_workers=0, disable_tqdm=True,
)
trainer = GRPOTrainer(
    model=AutoModelForCausalLM.from_pretrained(model_dir),
    processing_class=AutoTokenizer.from_pretrained(model_dir),
    reward_funcs=namespace["reward"], args=config,
    train_dataset=load_dataset("json", data_files=data, split="train"),
    callbacks=[Clock()],
)
start = time.perf_counter()
trainer.train()
lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
with open("/proc/self/status") as f:
    peak = next(int(x.split()[1]) for x in f if x.startswith("VmHWM")) * 1024
step_s = [b - a for a, b in zip(ends, ends[1:])]
print(json.dumps({"step_s": step_s, "length": lengths[1:], "peak": peak}))
"""


def _write_data(path: Path, rows: int = 512, seed: int = 0) -> None:
    from bench.real_model import WORDS

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    rng0 = random.Random(0)  # the corpus bench.real_model trained the tokenizer on
    words = ["".join(rng0.choice(letters) for _ in range(rng0.randint(2, 9))) for _ in range(WORDS)]
    with path.open("w") as f:
        for _ in range(rows):
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(6, 16)))
            f.write(json.dumps({"prompt": prompt, "answer": ""}) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.trl_grpo")
    p.add_argument("--model", default="", help="bench.real_model's folder (else built anew)")
    p.add_argument("--steps", type=int, default=4, help="steps, the first one a warm-up")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--micro", type=int, default=16, help="TRL's micro-batch, in rows")
    args = p.parse_args(argv)
    trl_path = Path(__file__).resolve().parent.parent / ".bench" / "trl"
    if not (trl_path / "trl").is_dir():
        raise SystemExit("TRL is not installed for the benchmark: bash bench/install_trl.sh")
    tmp = Path(tempfile.mkdtemp(prefix="yatt-trl-"))
    model = Path(args.model) if args.model else tmp / "model"
    if not args.model:
        from bench.real_model import build_model

        build_model(model)
    data, reward = tmp / "prompts.jsonl", tmp / "reward.py"
    _write_data(data)
    reward.write_text(REWARD)
    completions = args.prompts * args.group
    # our budget: TRL's micro-batch of rows at the longest prompt + completion
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [json.loads(x)["prompt"] for x in data.read_text().splitlines()]
    longest = max(len(tokenizer(x)["input_ids"]) for x in prompts)
    budget = args.micro * (longest + args.max_new_tokens)
    rows = []

    trl = last_json([
        sys.executable, "-c", _TRL, str(trl_path), str(model), str(data), str(reward),
        str(tmp / "trl-out"), str(args.steps), str(args.prompts), str(args.group),
        str(args.max_new_tokens), str(args.micro),
    ])  # fmt: skip
    ours_cmd = [
        "run", "text_grpo", "--policy", str(model),
        "--data", str(data), "--reward", f"{reward}:reward", "--steps", str(args.steps),
        "--out", str(tmp / "ours"), "--quiet", "--seed", "0", "--set",
        f"batch_size={args.prompts}", f"group_size={args.group}",
        f"max_new_tokens={args.max_new_tokens}", "kl_coef=0", "aggregation=token-mean",
        f"micro_batch_tokens={budget}", "lr=1e-6", "chat_template=false",
    ]  # fmt: skip
    ours = peak_run(ours_cmd)
    metrics = [json.loads(x) for x in (tmp / "ours" / "metrics.jsonl").read_text().splitlines()]
    ours_steps = [m["time/step"] for m in metrics[1:]]
    ours_lengths = [m["response_lengths/mean"] for m in metrics[1:]]

    for name, steps, lengths, peak in (
        ("TRL GRPOTrainer", trl["step_s"], trl["length"], trl["peak"]),
        ("yatt-graph text_grpo", ours_steps, ours_lengths, ours["peak"]),
    ):
        step = sum(steps) / len(steps)
        length = sum(lengths) / len(lengths) if lengths else float("nan")
        rows.append([name, f"{step:.2f}", f"{completions / step:.1f}",
                     f"{completions * length / step:.0f}", f"{length:.1f}",
                     f"{peak / 2**20:.0f}"])  # fmt: skip
        print(rows[-1], flush=True)
    print(machine())
    print(f"{args.prompts} prompts x {args.group} completions of up to {args.max_new_tokens} "
          f"tokens; TRL micro-batch {args.micro} rows, ours micro_batch_tokens={budget}")  # fmt: skip
    print(table(["framework", "step s", "completions/s", "completion tokens/s",
                 "mean length", "peak RSS MB"], rows))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
