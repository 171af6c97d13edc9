"""Benchmark: GRPO on a real pretrained model in TRL's GRPOTrainer and in ``yatt-graph run
text_grpo``, side by side in one run: speed, peak memory, and the reward curve.

The model is SmolLM2-135M-Instruct (``bench/smollm2.py``), loaded from its folder by both. The
task is chat-message sums with a verifiable answer ("What is 14 + 9? Answer with the number
only."), on which the model starts low (a few percent at temperature 1); the reward is one
TRL-style function, ``score(prompts, completions, answer, **columns)`` (1 when the response's
last number is the answer), which both take as it is. Both run the same step: ``--prompts``
prompts x ``--group`` completions of up to ``--max-new-tokens`` tokens, temperature 1, no KL
term (TRL's default ``beta=0``: no reference model in either), token-mean loss (TRL's default
``dapo``), one AdamW step a generation batch at a constant learning rate ``--lr``, max grad
norm 1, the chat template applied by each.

Two phases, each framework in a fresh process a run:

1. **TRL's best setting**, by measurement: float32 and bf16 (``bf16=True``: autocast over
   generation and training, where the CPU has bf16 instructions) x micro-batches of 8 and of all
   rows, gradient checkpointing off, ``--sweep-steps`` steps each. The fastest is TRL's setting
   in phase 2. Our default run is timed beside them.
2. **Learning**: ``--steps`` steps for each seed of ``--seeds``, TRL at its best setting and
   yatt-graph at its defaults for a model (precision and token budget chosen for this CPU, as
   the run prints). Reported: seconds a step (median of steps after the first), peak RSS, the
   mean reward of the first and the last five steps, and each step's reward (``--curves``).

For our runs the rollout's and the update's achieved FLOP/s are set against this CPU's
measured matmul peak (float32 and bf16): 2 N FLOPs a token for the rollout's forward passes and
6 N for the update's forward and backward (N: the model's parameters, the tied embedding
counted once, as the LM head).

    bash bench/install_trl.sh                        # TRL into .bench/trl (bench only)
    .venv/bin/python -m bench.trl_grpo --curves docs/trl_curves.json   # about 70 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

from bench import smollm2
from bench._util import last_json, machine, peak_run, table

REWARD = '''
import re


def score(prompts, completions, answer, **columns):
    """1 when a completion's last number is its row's answer (a TRL-style reward)."""
    out = []
    for completion, want in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        found = re.findall(r"-?\\d+", text)
        out.append(1.0 if found and found[-1] == str(want) else 0.0)
    return out
'''

_TRL = r"""
import json, sys, time
sys.path.append(sys.argv[1])  # .bench/trl, after site-packages
import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
model_dir, data, reward_file, out, settings = sys.argv[2:7]
s = json.loads(settings)
namespace = {}
exec(open(reward_file).read(), namespace)
ends = []
class Clock(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        ends.append(time.perf_counter())
completions = s["prompts"] * s["group"]
micro = s["micro"] or completions
config = GRPOConfig(
    output_dir=out, use_cpu=True, max_steps=s["steps"], learning_rate=s["lr"], beta=0.0,
    num_generations=s["group"], max_completion_length=s["new_tokens"], temperature=1.0,
    per_device_train_batch_size=micro, gradient_accumulation_steps=completions // micro,
    lr_scheduler_type="constant", gradient_checkpointing=False, bf16=s["bf16"],
    logging_steps=1, report_to=[], save_strategy="no", seed=s["seed"],
    dataloader_num_workers=0, disable_tqdm=True,
)
trainer = GRPOTrainer(
    model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
    processing_class=AutoTokenizer.from_pretrained(model_dir),
    reward_funcs=namespace["score"], args=config,
    train_dataset=load_dataset("json", data_files=data, split="train"),
    callbacks=[Clock()],
)
start = time.perf_counter()
trainer.train()
logs = [h for h in trainer.state.log_history if "reward" in h]
with open("/proc/self/status") as f:
    peak = next(int(x.split()[1]) for x in f if x.startswith("VmHWM")) * 1024
step_s = [b - a for a, b in zip([start, *ends], ends)]
print(json.dumps({"step_s": step_s, "reward": [h["reward"] for h in logs],
                  "length": [h["completions/mean_length"] for h in logs], "peak": peak}))
"""

_PEAK = r"""
import json, time, torch
out = {}
for name, dtype in (("float32", torch.float32), ("bf16", torch.bfloat16)):
    best = 0.0
    for m, k, n in ((2048, 576, 1536), (2048, 2048, 2048)):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        for _ in range(3):
            a @ b
        t = time.perf_counter()
        reps = 10
        for _ in range(reps):
            a @ b
        best = max(best, 2 * m * k * n * reps / (time.perf_counter() - t))
    out[name] = best
print(json.dumps(out))
"""


def write_task(folder: Path, rows: int = 512, seed: int = 0) -> tuple[Path, Path]:
    """The sums (chat-message prompts and their answers) and the reward file, in ``folder``."""
    rng = random.Random(seed)
    data = folder / "sums.jsonl"
    with data.open("w") as f:
        for _ in range(rows):
            a, b = rng.randint(3, 19), rng.randint(5, 27)
            question = f"What is {a} + {b}? Answer with the number only."
            f.write(json.dumps({"prompt": [{"role": "user", "content": question}],
                                "answer": str(a + b)}) + "\n")  # fmt: skip
    reward = folder / "reward.py"
    reward.write_text(REWARD)
    return data, reward


def _parameters(model: Path) -> int:
    """The model's parameters from its safetensors headers (a tied embedding once)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open is not iterable)
                shape = f.get_slice(key).get_shape()
                count = 1
                for size in shape:
                    count *= size
                total += count
    return total


def _prompt_tokens(model: Path, data: Path) -> float:
    """The mean length of the data's prompts in tokens, chat template applied."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
             for r in rows]  # fmt: skip
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return sum(lengths) / len(lengths)


def _trl(args: argparse.Namespace, model: Path, data: Path, reward: Path, out: Path,
         steps: int, seed: int, bf16: bool, micro: int) -> dict:  # fmt: skip
    trl_path = Path(__file__).resolve().parent.parent / ".bench" / "trl"
    settings = {"steps": steps, "seed": seed, "bf16": bf16, "micro": micro, "lr": args.lr,
                "prompts": args.prompts, "group": args.group, "new_tokens": args.max_new_tokens}  # fmt: skip
    return last_json([sys.executable, "-c", _TRL, str(trl_path), str(model), str(data),
                      str(reward), str(out), json.dumps(settings)])  # fmt: skip


def _ours(args: argparse.Namespace, model: Path, data: Path, reward: Path, out: Path,
          steps: int, seed: int) -> dict:  # fmt: skip
    run = peak_run([
        "run", "text_grpo", "--policy", str(model), "--data", str(data),
        "--reward", f"{reward}:score", "--steps", str(steps), "--out", str(out), "--quiet",
        "--seed", str(seed), "--set", f"batch_size={args.prompts}", f"group_size={args.group}",
        f"max_new_tokens={args.max_new_tokens}", f"lr={args.lr}", "kl_coef=0",
        "aggregation=token-mean",
    ])  # fmt: skip
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    settings = json.loads((out / "settings.json").read_text())
    return {
        "step_s": [m["time/step"] for m in metrics],
        "rollout_s": [m["time/rollout"] for m in metrics],
        "update_s": [m["time/grpo"] for m in metrics],
        "reward": [m["scores/mean"] for m in metrics],
        "length": [m["response_lengths/mean"] for m in metrics],
        "peak": run["peak"],
        "settings": settings,
    }


def _step(result: dict) -> float:
    later = result["step_s"][1:] or result["step_s"]
    return statistics.median(later)


def _ends(rewards: list[float], n: int = 5) -> tuple[float, float]:
    return sum(rewards[:n]) / len(rewards[:n]), sum(rewards[-n:]) / len(rewards[-n:])


def curve_table(curves: dict[str, list[float]], window: int = 5) -> str:
    """The reward curves as a table: each run's mean reward over windows of ``window`` steps."""
    longest = max(len(c) for c in curves.values())
    spans = [(a, min(a + window, longest)) for a in range(0, longest, window)]
    rows = [[name, *(f"{sum(c[a:b]) / len(c[a:b]):.2f}" if c[a:b] else "-" for a, b in spans)]
            for name, c in curves.items()]  # fmt: skip
    return table(["run (reward, mean of steps)", *(f"{a}-{b - 1}" for a, b in spans)], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.trl_grpo")
    p.add_argument("--model", default="", help="a chat model's folder (else SmolLM2-135M)")
    p.add_argument("--steps", type=int, default=30, help="learning steps a run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--sweep-steps", type=int, default=3, help="phase 1's steps (0: skip it)")
    p.add_argument("--trl", default="", help="TRL's setting without the sweep: bf16,32 or ...")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--curves", default="", help="write each run's per-step figures here (JSON)")
    args = p.parse_args(argv)
    if not (Path(__file__).resolve().parent.parent / ".bench" / "trl" / "trl").is_dir():
        raise SystemExit("TRL is not installed for the benchmark: bash bench/install_trl.sh")
    model = Path(args.model) if args.model else smollm2.prepare()
    tmp = Path(tempfile.mkdtemp(prefix="yatt-trl-"))
    data, reward = write_task(tmp)
    completions = args.prompts * args.group
    peak = last_json([sys.executable, "-c", _PEAK])
    print(f"matmul peak GFLOP/s: {json.dumps({k: round(v / 1e9) for k, v in peak.items()})}")

    speed_rows = []
    best: tuple[float, bool, int] | None = None
    if args.sweep_steps:
        for bf16 in (False, True):
            for micro in (8, 0):
                r = _trl(args, model, data, reward, tmp / f"sweep-{bf16}-{micro}",
                         args.sweep_steps, 0, bf16, micro)  # fmt: skip
                step = _step(r)
                name = f"TRL {'bf16' if bf16 else 'float32'}, micro-batch {micro or completions}"
                speed_rows.append([name, f"{step:.1f}", f"{r['peak'] / 1e9:.2f}"])
                print(speed_rows[-1], flush=True)
                if best is None or step < best[0]:
                    best = (step, bf16, micro)
        r = _ours(args, model, data, reward, tmp / "sweep-ours", args.sweep_steps, 0)
        speed_rows.append(["yatt-graph defaults", f"{_step(r):.1f}", f"{r['peak'] / 1e9:.2f}"])
        print(speed_rows[-1], flush=True)
    bf16, micro = (best[1], best[2]) if best else (
        args.trl.split(",")[0] == "bf16", int(args.trl.split(",")[1]) if args.trl else 0)  # fmt: skip
    trl_name = f"TRL {'bf16' if bf16 else 'float32'}, micro-batch {micro or completions}"

    runs: dict[str, dict] = {}
    rows = []
    prompt_tokens = _prompt_tokens(model, data)
    n = _parameters(model)
    for seed in args.seeds:
        for name in (trl_name, "yatt-graph defaults"):
            out = tmp / f"learn-{seed}-{'trl' if name.startswith('TRL') else 'ours'}"
            if name.startswith("TRL"):
                r = _trl(args, model, data, reward, out, args.steps, seed, bf16, micro)
            else:
                r = _ours(args, model, data, reward, out, args.steps, seed)
            runs[f"{name}, seed {seed}"] = r
            first, last = _ends(r["reward"])
            rows.append([name, seed, f"{_step(r):.1f}", f"{r['peak'] / 1e9:.2f}",
                         f"{first:.2f}", f"{last:.2f}", f"{max(r['reward']):.2f}"])  # fmt: skip
            print(rows[-1], flush=True)

    flops_rows = []
    for key, r in runs.items():
        if "rollout_s" not in r:
            continue
        later = slice(1, None)
        tokens = [completions * (prompt_tokens + length) for length in r["length"][later]]
        rollout = statistics.median(2 * n * t / s for t, s in zip(tokens, r["rollout_s"][later]))
        update = statistics.median(6 * n * t / s for t, s in zip(tokens, r["update_s"][later]))
        precision = r["settings"]["config"]["mixed_precision"]  # the rollout's and the update's
        of = peak["bf16" if precision == "bf16" else "float32"]
        flops_rows.append([key, precision, f"{rollout / 1e9:.0f}", f"{rollout / of:.0%}",
                           f"{update / 1e9:.0f}", f"{update / of:.0%}"])  # fmt: skip

    print(machine())
    print(f"SmolLM2-135M-Instruct ({n / 1e6:.1f}M parameters), {args.prompts} prompts x "
          f"{args.group} completions of up to {args.max_new_tokens} tokens, lr {args.lr}, "
          f"prompts {prompt_tokens:.0f} tokens on average")  # fmt: skip
    if speed_rows:
        print(table(["setting", "step s (median)", "peak RSS GB"], speed_rows))
    print(table(["run", "seed", "step s", "peak RSS GB", "reward, first 5", "reward, last 5",
                 "best step"], rows))  # fmt: skip
    print(
        f"matmul peak: float32 {peak['float32'] / 1e9:.0f} GFLOP/s, bf16 {peak['bf16'] / 1e9:.0f}"
    )
    print(table(["our run", "precision", "rollout GFLOP/s", "of peak", "update GFLOP/s",
                 "of peak"], flops_rows))  # fmt: skip
    print(curve_table({k: v["reward"] for k, v in runs.items()}))
    if args.curves:
        Path(args.curves).write_text(json.dumps(
            {k: {"reward": v["reward"], "step_s": v["step_s"]} for k, v in runs.items()}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
