"""Benchmark: one GRPO update step of a real-shaped model, with and without a token budget.

A Qwen2-architecture causal LM of about 100M parameters and a BPE tokenizer, both built in
code (:func:`build_model`) and saved to a folder, loaded by the update as ``{"path": DIR}`` as
``--policy DIR`` would. The rollout is stood in for by a synthetic batch of B responses (prompts
of 8-24 tokens, responses of 8-``--max-response`` tokens, random ids, advantages +-1), so that
only the update is measured. For each batch size and budget, a fresh process builds the node,
runs one update step to warm up and a second one that is timed, and reports:

* the update step's peak RSS (``VmHWM``, reset just before the step through
  ``/proc/self/clear_refs``), and how far it rose above the RSS before the step, and
* tokens/s: real prompt + response tokens of the batch over the step's wall time.

    .venv/bin/python -m bench.real_model --batches 64 256 --budget 1024

The target (docs/PERFORMANCE.md): with a budget the step's peak memory does not grow with the
batch (within 10 % from 64 to 256 responses), and its tokens/s is within 10 % of the unsplit
step's where that fits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench._util import last_json, machine, table

WORDS = 6000
"""Distinct words of the generated corpus the tokenizer is trained on."""


def build_model(path: Path, vocab: int = 8192, hidden: int = 768, layers: int = 14) -> int:
    """Write a random Qwen2 causal LM of about 100M parameters and a BPE tokenizer trained in
    code to ``path``; returns the parameter count."""
    import random

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(WORDS)]
    corpus = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(4000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    special = ["<unk>", "<pad>", "<eos>"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=special))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    config = Qwen2Config(
        vocab_size=len(fast), hidden_size=hidden, intermediate_size=int(hidden * 8 / 3),
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=2,
        max_position_embeddings=1024, tie_word_embeddings=False, attention_dropout=0.0,
        pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id,
        bos_token_id=fast.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _batch(size: int, vocab: int, max_response: int, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    P, R = 24, max_response
    plen = torch.randint(8, P + 1, (size,), generator=g)  # (B,)
    rlen = torch.randint(8, R + 1, (size,), generator=g)  # (B,)
    prompt_mask = (torch.arange(P)[None, :] >= P - plen[:, None]).long()  # (B, P) left-padded
    response_mask = (torch.arange(R)[None, :] < rlen[:, None]).float()  # (B, R)
    return {
        "prompt_ids": torch.randint(3, vocab, (size, P), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "response_ids": torch.randint(3, vocab, (size, R), generator=g) * response_mask.long(),
        "response_mask": response_mask,
        "logprobs": -torch.rand(size, R, generator=g) * 8 * response_mask,
        "advantages": torch.where(torch.rand(size, generator=g) > 0.5, 1.0, -1.0)[:, None]
        * response_mask,
    }


def _status_mb(key: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (the peak since the last reset) of this process, in MB."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(key))
    return int(line.split()[1]) / 1024


def one(path: str, size: int, budget: int, max_response: int, pack: bool = False) -> dict:
    """One configuration, in this process: warm-up step, then the measured step."""
    import torch

    from nodes.update import GRPOUpdate

    torch.set_num_threads(os.cpu_count() or 1)
    node = GRPOUpdate(policy={"path": path}, lr=1e-6, micro_batch_tokens=budget, kl_coef=0.0,
                      pack_sequences=pack)  # fmt: skip
    node.setup()
    vocab = node.policy.vocab_size
    inputs = _batch(size, vocab, max_response)
    tokens = int(inputs["prompt_mask"].sum() + inputs["response_mask"].sum())
    node.run(_batch(8, vocab, max_response, seed=1))  # warm-up: Adam's state, the kernels
    before = _status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the RSS now
    start = time.perf_counter()
    node.run(inputs)
    wall = time.perf_counter() - start
    peak = _status_mb("VmHWM")
    return {
        "size": size,
        "budget": budget,
        "pack": pack,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "rss_before_mb": before,
        "peak_mb": peak,
        "step_peak_mb": peak - before,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.real_model")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--budget", type=int, default=1024, help="micro_batch_tokens of the split runs")
    p.add_argument("--max-response", type=int, default=64)
    p.add_argument("--model", default="", help="a folder from an earlier run (else built anew)")
    p.add_argument(
        "--pack",
        action="store_true",
        help="also each budgeted step with pack_sequences (rows packed, no padding)",
    )
    p.add_argument("--one", nargs=4, type=int, metavar=("SIZE", "BUDGET", "MAX_RESPONSE", "PACK"),
                   help=argparse.SUPPRESS)  # fmt: skip
    args = p.parse_args(argv)
    if args.one:
        size, budget, longest, pack = args.one
        print(json.dumps(one(args.model, size, budget, longest, bool(pack))))
        return 0
    folder = Path(args.model or tempfile.mkdtemp(prefix="yatt-real-model-"))
    params = build_model(folder) if not args.model else None
    rows = []
    results = []
    for size in args.batches:
        for budget, pack in [(0, 0), (args.budget, 0), *([(args.budget, 1)] if args.pack else [])]:
            cmd = [sys.executable, "-m", "bench.real_model", "--model", str(folder),
                   "--one", str(size), str(budget), str(args.max_response), str(pack)]  # fmt: skip
            r = last_json(cmd)
            results.append(r)
            rows.append([
                str(size), f"{budget or 'none'}{' packed' if pack else ''}", str(r["tokens"]),
                f"{r['wall_s']:.1f}",
                f"{r['tokens_per_s']:.0f}", f"{r['peak_mb']:.0f}", f"{r['step_peak_mb']:.0f}",
            ])  # fmt: skip
            print(rows[-1], flush=True)
    print(machine())
    if params:
        print(f"model: Qwen2, {params / 1e6:.0f}M parameters, BPE tokenizer trained in code")
    print(table(["responses", "micro_batch_tokens", "tokens", "step s", "tokens/s",
                 "peak RSS MB", "rise MB"], rows))  # fmt: skip
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
