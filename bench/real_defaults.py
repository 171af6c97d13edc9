"""Benchmark: the precision and budget a real model gets by default, measured on it.

``yatt-graph run text_grpo`` on SmolLM2-135M-Instruct (``bench/smollm2.py``) with chat-message
sums to answer, once per setting, side by side in one run, each in a fresh process: float32
weights computing in float32 or in bf16 autocast (``mixed_precision``: the update, the
rollout's sampling and the reference alike), each with the whole batch in one forward or a
token budget (``micro_batch_tokens``), weights in bfloat16 (``dtype=bfloat16``: the rollout
samples in bf16 and recomputes its logprobs), and the defaults a model gets on this machine.
Reported per setting: the rollout's and the update's seconds a step (the median of the steps
after the first), the step's, its peak RSS, and the sampler/trainer logprob gap where one is
measured.

    .venv/bin/python -m bench.real_defaults --steps 3     # about 10 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench import smollm2
from bench._util import machine, peak_run, table

SETTINGS = {
    "float32, whole batch (the old default)": ["mixed_precision=no", "micro_batch_tokens=0"],
    "float32, budget 1024": ["mixed_precision=no", "micro_batch_tokens=1024"],
    "bf16 autocast, whole batch": ["mixed_precision=bf16", "micro_batch_tokens=0"],
    "bf16 autocast, budget 1024": ["mixed_precision=bf16", "micro_batch_tokens=1024"],
    "bf16 autocast, budget 2048": ["mixed_precision=bf16", "micro_batch_tokens=2048"],
    "bf16 weights, budget 1024": [
        "dtype=bfloat16",
        "mixed_precision=no",
        "micro_batch_tokens=1024",
    ],
    "defaults": [],
}


def _data(folder: Path, rows: int = 64) -> Path:
    path = folder / "sums.jsonl"
    lines = []
    for i in range(rows):
        a, b = 3 + i % 17, 5 + (i * 7) % 23
        question = f"What is {a} + {b}? Answer with the number only."
        lines.append(json.dumps({"prompt": [{"role": "user", "content": question}],
                                 "answer": str(a + b)}))  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    (folder / "reward.py").write_text(
        "import re\n\ndef score(text, meta):\n"
        "    found = re.findall(r'-?\\d+', text)\n"
        "    return 1.0 if found and found[-1] == meta['answer'] else 0.0\n"
    )
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.real_defaults")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="prompts a step")
    p.add_argument("--group", type=int, default=4, help="responses a prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--only", nargs="*", default=None, help="some of the settings, by name")
    args = p.parse_args(argv)
    model = smollm2.prepare()
    folder = Path(tempfile.mkdtemp(prefix="yatt-real-defaults-"))
    data = _data(folder)
    rows = []
    for name, extra in SETTINGS.items():
        if args.only is not None and name not in args.only:
            continue
        out = folder / name.replace(" ", "_").replace(",", "")
        sets = [f"batch_size={args.batch}", f"group_size={args.group}",
                f"max_new_tokens={args.max_new_tokens}", *extra]  # fmt: skip
        run = peak_run(["run", "text_grpo", "--policy", str(model), "--data", str(data),
                        "--reward", f"{folder / 'reward.py'}:score", "--steps", str(args.steps),
                        "--out", str(out), "--quiet", "--set", *sets])  # fmt: skip
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        later = metrics[1:] or metrics

        def med(key: str, rows: list[dict] = later) -> float:
            return statistics.median(r[key] for r in rows)

        gap = f"{med('logprob_gap_mean'):.4f}" if "logprob_gap_mean" in later[0] else "-"
        rows.append([name, f"{med('time/rollout'):.1f}", f"{med('time/grpo'):.1f}",
                     f"{med('time/reference'):.1f}", f"{med('time/step'):.1f}",
                     f"{run['peak'] / 1e9:.2f}", gap])  # fmt: skip
        print(rows[-1], flush=True)
    print(machine())
    print(f"SmolLM2-135M-Instruct, {args.batch} prompts x {args.group} responses of up to "
          f"{args.max_new_tokens} tokens, steps 1-{args.steps - 1} (median)")  # fmt: skip
    print(table(["setting", "rollout s", "update s", "reference s", "step s", "peak GB",
                 "logprob gap"], rows))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
