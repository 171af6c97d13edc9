"""The GPU paths, checked in one prepared run on a machine with CUDA (and the vllm extra).

    make install-gpu && .venv-gpu/bin/python -m bench.gpu_check [--steps 20] [--out DIR]

Builds a tiny Qwen2-VL and a tiny Qwen2 in code, saves them, then on CUDA:

1. HF rollout of each (transformers ``generate``): samples/s;
2. vLLM rollout of each: samples/s;
3. a weight update into the running vLLM engine (seeded noise on every weight), then greedy
   generations: vLLM's must equal the HF policy's with the same weights, and differ from
   before the update;
4. logprob agreement between vLLM's own logprobs and the HF teacher-forced recompute on the
   same samples: max abs difference, within TOLERANCE;
5. 20 steps of mm_grpo and text_grpo through the CLI with ``--device cuda``: wall time and
   reward first/last.

It prints one table (check, result, figure). Without CUDA every row says "skipped: no CUDA"
and it exits 0, so it can be run anywhere; a failed check exits 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

TOLERANCE = 2e-2
"""vLLM's and HF's logprobs of the same tokens differ by kernel and dtype; in float32 they
agree far closer, and the check is about wiring (wrong names or weights give differences of
whole nats)."""

ROWS: list[tuple[str, str, str]] = []


def row(check: str, result: str, figure: str = "") -> None:
    ROWS.append((check, result, figure))
    print(f"  {check}: {result} {figure}", flush=True)


def _policies(tmp: Path) -> dict[str, tuple[Any, Path]]:
    from nodes.data import task_vocabulary
    from nodes.models.policy import build_policy, tiny_qwen2_vl

    vlm = tiny_qwen2_vl(seed=0)
    vlm.save_pretrained(tmp / "qwen2_vl")
    text = build_policy({"name": "tiny-qwen2", "seed": 0, "words": task_vocabulary()})
    text.save_pretrained(tmp / "qwen2")
    return {"qwen2_vl": (vlm, tmp / "qwen2_vl"), "qwen2": (text, tmp / "qwen2")}


def _rollouts(name: str, path: Path) -> None:
    from PIL import Image

    from nodes.rollout import Rollout, vllm_unavailable_reason

    prompts = ["what color is the shape ?"] * 32
    images = [Image.new("RGB", (32, 32), (200, 10, 10))] * 32 if name == "qwen2_vl" else None
    ports: dict[str, Any] = {"prompts": prompts}
    if images is not None:
        ports["images"] = images
    hf = Rollout(policy=str(path), max_new_tokens=16, seed=0, device="cuda")
    start = time.perf_counter()
    hf.run(**ports)
    row(f"{name}: HF rollout", "ok", f"{32 / (time.perf_counter() - start):.1f} samples/s")
    why = vllm_unavailable_reason()
    if why:
        row(f"{name}: vLLM rollout", f"skipped: {why}")
        return
    node = Rollout(
        policy=str(path),
        backend="vllm",
        max_new_tokens=16,
        seed=0,
        device="cuda",
        vllm_options={"gpu_memory_utilization": 0.2},
    )
    start = time.perf_counter()
    out = node.run(**ports)
    row(f"{name}: vLLM rollout", "ok", f"{32 / (time.perf_counter() - start):.1f} samples/s")
    with torch.no_grad():
        batch = node.policy.prepare(out["prompt_ids"], out["prompt_mask"], images=images)
        ref = node.policy.response_logprobs(
            batch.to("cuda"), out["response_ids"].cuda(), out["response_mask"].cuda()
        )
    diff = float((out["logprobs"].cuda() - ref).abs().max())
    row(
        f"{name}: vLLM vs HF logprobs",
        "ok" if diff <= TOLERANCE else "FAILED",
        f"max |diff| {diff:.2e} (tolerance {TOLERANCE:g})",
    )
    # a weight update (seeded noise on every weight), then greedy generations of vLLM and
    # of the HF policy holding the same weights: they must agree, and differ from before
    node._vllm.sampling["temperature"] = 0.0
    short = prompts[:4], (images[:4] if images else None)
    before = node._vllm.generate(*short, seed=1).response_ids
    gen = torch.Generator().manual_seed(0)
    update = {
        k: v + 0.5 * v.float().std().nan_to_num() * torch.randn(v.shape, generator=gen).to(v)
        for k, v in node.policy.state_dict().items()
        if v.is_floating_point()
    }
    node.policy.load_weights(update)
    start = time.perf_counter()
    sent = node._vllm.load_weights(update)
    seconds = time.perf_counter() - start
    after = node._vllm.generate(*short, seed=1).response_ids
    batch = node.policy.encode_prompts(short[0], images=short[1]).to("cuda")
    hf_after = node.policy.generate(batch, max_new_tokens=16, temperature=0.0).response_ids
    same = after.shape == hf_after.shape and torch.equal(after, hf_after.cpu())
    changed = before.shape != after.shape or not torch.equal(before, after)
    row(
        f"{name}: weight update into vLLM",
        "ok" if same and changed else f"FAILED (agrees with HF: {same}, changed: {changed})",
        f"{sent} tensors in {seconds * 1e3:.0f} ms",
    )


def _cli_runs(steps: int, out: Path, policies: dict[str, tuple[Any, Path]]) -> None:
    for graph, extra in (
        ("graphs/mm_grpo.py", []),
        ("graphs/text_grpo.py", ["--policy", str(policies["qwen2"][1])]),
    ):
        folder = out / Path(graph).stem
        cmd = [str(Path(sys.executable).parent / "yatt-graph"), "run", graph, "--steps", str(steps)]
        cmd += ["--device", "cuda", "--out", str(folder), "--quiet", *extra]
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["?"])[-1]
            row(f"{graph} --device cuda", f"FAILED (exit {done.returncode}: {last})")
            continue
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        row(
            f"{graph} --device cuda, {steps} steps",
            "ok",
            f"{seconds:.0f} s, reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f}",
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=None, help="run folders (default: a temporary folder)")
    args = p.parse_args(argv)
    checks = ("HF rollout", "vLLM rollout", "vLLM vs HF logprobs", "weight update into vLLM")
    if not torch.cuda.is_available():
        for check in checks + ("mm_grpo/text_grpo --device cuda",):
            row(check, "skipped: no CUDA")
    else:
        row("device", torch.cuda.get_device_name(0), f"torch {torch.__version__}")
        with tempfile.TemporaryDirectory() as tmp:
            policies = _policies(Path(tmp))
            for name, (_, path) in policies.items():
                _rollouts(name, path)
            _cli_runs(args.steps, Path(args.out or tmp), policies)
    width = max(len(c) for c, _, _ in ROWS)
    print("\n| check | result | figure |\n|---|---|---|")
    for check, result, figure in ROWS:
        print(f"| {check.ljust(width)} | {result} | {figure} |")
    return 1 if any(r.startswith("FAILED") for _, r, _ in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
