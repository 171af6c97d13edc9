"""Rows of :mod:`bench.gpu_check` that follow a vLLM engine through sleep and a trainer's turn,
and a rank group through a step and a fault. Each row calls ``row(check, result, figure)``;
a result starting with ``FAILED`` fails the check.

vLLM, on the text policy (one engine, as the ready graphs build it: bfloat16, sleep on, the
trainer's float32 recompute of the logprobs):

1. **sleep level 2 round trip**: the GPU memory the awake engine holds and the share level 2
   returns (``torch.cuda.mem_get_info()``, what another process could take); then a generation,
   which wakes it, sends the policy's weights again (level 2 dropped them) and sleeps after.
   Fails when less than ``SLEEP_FREED`` of the engine's memory came back.
2. **recompute logprob gap**: ``|vLLM's logprob - the trainer's|`` of the sampled tokens, mean
   and max a token. Fails above ``GAP_MEAN_LIMIT`` (weights that did not come back whole differ
   by nats), or at exactly 0 (nothing was recomputed).
3. **colocated hand-off**: while the engine sleeps, a GRPO update on the same GPU takes what is
   free (a ballast beside its own state: more than was free with the engine awake, which it
   could only get if the engine's memory really came back) and trains a step on the rollout;
   then it offloads and the engine wakes with the update and generates. Fails if anything in
   that raises, if the ballast was no larger than what was free beside the awake engine (the
   row would prove nothing), or if the gap after the update is over the limit (the update did
   not reach the engine).

Rank groups (two GPUs: NCCL, one GPU a rank; ``--device cpu``: gloo):

4. **FSDP2 step**: a GRPO update as 2 ranks against the same update as one: the weights after
   one call within ``RANK_TOLERANCE``.
5. **a killed rank**: rank 1 killed with SIGKILL; the next call must raise a ``RankError``
   naming rank 1 within ``RANK_FAULT_S`` (rank 0's supervisor aborts NCCL's blocked
   collective).
"""

from __future__ import annotations

import gc
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Row = Callable[..., None]

SLEEP_FREED = 0.8
"""Level 2 frees the weights and the KV cache; what stays is the engine process's CUDA context
and kernels' workspaces: well under a fifth of an engine's share of a GPU."""
GAP_MEAN_LIMIT = 0.1
"""nats a token: bfloat16 against float32 differs by about 1e-2 (up to 1e-1) a token; weights
that are stale or garbled differ by whole nats."""
BALLAST_SLACK = 2 << 30
"""What the hand-off's ballast leaves free for the update's own step."""
RANK_TOLERANCE = {"cuda": 1e-4, "cpu": 1e-5}
"""max |w(2 ranks) - w(1 rank)| after one call: the group sums gradients in another order."""
RANK_FAULT_S = 10.0

SLEEP_ROW = "qwen2: vLLM sleep level 2 round trip"
GAP_ROW = "qwen2: recompute logprob gap, vLLM bfloat16 vs trainer float32"
HANDOFF_ROW = "qwen2: colocated hand-off, a trainer under the sleeping vLLM"
VLLM_ROWS = (SLEEP_ROW, GAP_ROW, HANDOFF_ROW)
FSDP_ROW = "2 ranks: FSDP2 step against 1 rank"
KILL_ROW = "2 ranks: a killed rank named"
RANK_ROWS = (FSDP_ROW, KILL_ROW)
GiB = 1 << 30


# --- verdicts (pure: tested on the CPU) ---------------------------------------------------------
def sleep_verdict(base: int, awake: int, asleep: int) -> tuple[str, str]:
    """(result, figure) from the free bytes before the engine, with it awake and asleep."""
    held, kept = base - awake, base - asleep
    share = (asleep - awake) / held if held > 0 else 0.0
    figure = f"awake holds {held / GiB:.2f} GiB, asleep {kept / GiB:.2f} GiB ({share:.0%} freed)"
    if held <= 0:
        return "FAILED (the awake engine holds no memory: mem_get_info saw nothing)", figure
    if share < SLEEP_FREED:
        return f"FAILED (level 2 freed under {SLEEP_FREED:.0%})", figure
    return "ok", figure


def gap_verdict(gap: torch.Tensor) -> tuple[str, str]:
    """(result, figure) from the gap of every real response token."""
    if gap.numel() == 0:
        return "FAILED (no response tokens)", ""
    mean, top = float(gap.mean()), float(gap.max())
    figure = f"mean {mean:.2e}, max {top:.2e} nats a token over {gap.numel()} tokens"
    if not (math.isfinite(mean) and math.isfinite(top)):
        return "FAILED (not finite)", figure
    if mean > GAP_MEAN_LIMIT:
        return f"FAILED (mean over {GAP_MEAN_LIMIT}: the engine's weights are not the trainer's)", figure  # fmt: skip
    if top == 0.0:
        return "FAILED (no gap at all: the trainer recomputed nothing)", figure
    return "ok", figure


def rank_fault_verdict(error: BaseException | None, seconds: float) -> str:
    if error is None:
        return "FAILED (the call after the kill returned)"
    from runtime.ranks.group import RankError

    if not isinstance(error, RankError):
        return f"FAILED ({type(error).__name__}, not a RankError: {str(error)[:200]})"
    if "rank 1" not in str(error):
        return f"FAILED (the RankError does not name rank 1: {str(error)[:200]})"
    if seconds > RANK_FAULT_S:
        return f"FAILED (named after {seconds:.1f} s, over {RANK_FAULT_S:.0f} s)"
    return "ok"


def update_verdict(
    agrees: bool, changed: bool, sync: dict[str, Any], device: str
) -> tuple[str, str]:
    """(result, figure) of gpu_check's weight-update row, from whether vLLM's greedy tokens
    agree with HF's and changed, and the rollout's ``weight_sync`` output of the update: on
    CUDA the engine, colocated with the rollout, must have taken it by CUDA IPC."""
    path = "ipc" if sync.get("ipc") else "bytes"
    mib, ms = sync.get("engine_bytes", 0) / 2**20, sync.get("engine_seconds", 0.0) * 1e3
    figure = f"by {path}: {mib:.2f} MiB into vLLM in {ms:.1f} ms"
    ipc = path == "ipc" or device != "cuda"
    if agrees and changed and ipc:
        return "ok", figure
    return f"FAILED (changed: {changed}{'' if ipc else ', by bytes, not CUDA IPC'})", figure


# --- helpers ------------------------------------------------------------------------------------
def _settle(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def free_bytes(device: str) -> int:
    """What the driver says is free on the GPU (0 on the CPU: no memory figure)."""
    return torch.cuda.mem_get_info()[0] if device == "cuda" else 0


def close_engine(node: Any) -> None:
    """End a Rollout's vLLM engine now (its engine-core process and the memory it holds), not
    when the garbage collector gets to it."""
    engine = getattr(node, "_vllm", None)
    llm = getattr(engine, "llm", None)
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    shutdown = getattr(core, "shutdown", None)
    try:
        if shutdown is not None:
            shutdown()
    except Exception as err:  # the rows after it still run, on what memory is left
        print(f"  (ending the vLLM engine: {type(err).__name__}: {err})", flush=True)
    if engine is not None:
        node._vllm = None


class _Rows:
    """``row`` that remembers what it was given, so a failure part-way fails each row not
    reached, by its own name."""

    def __init__(self, row: Row, names: tuple[str, ...]) -> None:
        self.row, self.names, self.done = row, names, set()

    def __call__(self, name: str, *rest: str) -> None:
        self.done.add(name)
        self.row(name, *rest)

    def fail_rest(self, err: BaseException) -> None:
        for name in self.names:
            if name not in self.done:
                self(name, f"FAILED ({type(err).__name__}: {str(err)[:300]})")


def _gap(out: dict[str, Any]) -> torch.Tensor:
    """|recomputed - sampler's| logprob of each real response token."""
    real = out["response_mask"].bool()
    return (out["logprobs"] - out["rollout_logprobs"]).abs()[real]


def _grpo_inputs(out: dict[str, Any]) -> dict[str, Any]:
    """A GRPO update's inputs from a rollout's outputs, with +1/-1 scores in turn."""
    from nodes.rl.advantages import broadcast_to_tokens

    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs")
    mask = out["response_mask"]  # (B, R), on the rollout's device
    scores = torch.tensor([1.0, -1.0] * (mask.shape[0] // 2), device=mask.device)  # (B,)
    adv = broadcast_to_tokens(scores, mask)  # (B, R)
    return {**{k: out[k] for k in keys}, "advantages": adv}


# --- vLLM: sleep, gap, hand-off -----------------------------------------------------------------
def vllm_sleep_rows(row: Row, policy: Path, device: str, eager: bool) -> None:
    """Rows 1-3 of the module docstring on one engine serving ``policy`` (a causal LM)."""
    from nodes.rollout import Rollout, vllm_unavailable_reason

    why = vllm_unavailable_reason()
    if why:
        for name in VLLM_ROWS:
            row(name, f"skipped: {why}")
        return
    row = _Rows(row, VLLM_ROWS)
    prompts = ["what color is the shape ?", "name the shape", "is it red ?", "how many ?"] * 4
    _settle(device)
    base = free_bytes(device)
    node = Rollout(
        policy=str(policy), backend="vllm", max_new_tokens=16, seed=0, device=device,
        recompute_logprobs=True, vllm_options={"enable_sleep_mode": True, "enforce_eager": eager},
    )  # fmt: skip
    try:
        node.setup()  # the engine starts, then sleeps at once
        engine = node._vllm
        t0 = time.perf_counter()
        engine.wake_up()
        woke = time.perf_counter() - t0
        awake = free_bytes(device)
        t0 = time.perf_counter()
        engine.sleep()
        slept = time.perf_counter() - t0
        _settle(device)
        asleep = free_bytes(device)
        t0 = time.perf_counter()
        out = node.run(prompts=prompts)  # wake, the policy's weights again, generate, sleep
        trip = time.perf_counter() - t0
        result, figure = sleep_verdict(base, awake, asleep) if device == "cuda" else (
            "ok", "no memory figure on the CPU")  # fmt: skip
        times = f"wake {woke:.2f} s, sleep {slept:.2f} s, wake + weights + generation {trip:.2f} s"
        row(SLEEP_ROW, result, f"{figure}; {times}")
        row(GAP_ROW, *gap_verdict(_gap(out)))
        _handoff(row, node, out, policy, device, free_while_awake=awake)
    except Exception as err:
        row.fail_rest(err)
    finally:
        close_engine(node)
        del node
        _settle(device)


def _handoff(row: Row, node: Any, out: dict[str, Any], policy: Path, device: str,
             free_while_awake: int) -> None:  # fmt: skip
    from nodes.update import GRPOUpdate

    trainer = GRPOUpdate(policy=str(policy), lr=1e-4, device=device)
    trainer.setup()
    ballast, held = None, 0
    if device == "cuda":  # take what the sleeping engine gave back, and more
        _settle(device)
        held = max(0, free_bytes(device) - BALLAST_SLACK)
        ballast = torch.empty(held, dtype=torch.uint8, device=device)
    t0 = time.perf_counter()
    update = trainer.run(_grpo_inputs(out))["weights"]
    step = time.perf_counter() - t0
    del ballast
    moved = trainer.offload()
    _settle(device)  # the ballast's block back from torch's cache, for the engine to wake into
    t0 = time.perf_counter()
    after = node.run(prompts=["what color is the shape ?"] * 8, weights=update)
    woke = time.perf_counter() - t0
    result, gap = gap_verdict(_gap(after))
    figure = (
        f"step {step:.2f} s beside {held / GiB:.1f} GiB of ballast ({free_while_awake / GiB:.1f}"
        f" GiB was free with vLLM awake), {moved / 2**20:.0f} MiB offloaded; vLLM woke with the"
        f" update in {woke:.2f} s, gap after: {gap}"
    )
    if device == "cuda" and held <= free_while_awake:
        result = "FAILED (the ballast fit beside the awake engine: the row proves nothing)"
    row(HANDOFF_ROW, result, figure)
    del trainer


# --- rank groups ----------------------------------------------------------------------------
def rank_rows(row: Row, device: str) -> None:
    """Rows 4-5 of the module docstring (two GPUs, or the CPU's gloo)."""
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if device == "cuda" and gpus < 2:
        for name in RANK_ROWS:
            row(name, f"skipped: needs 2 GPUs, this machine has {gpus}")
        return
    from nodes.rollout import Rollout
    from nodes.update import GRPOUpdate
    from runtime.engine.calls import node_op
    from runtime.ranks.group import start_groups

    row = _Rows(row, RANK_ROWS)
    backend = "NCCL" if device == "cuda" else "gloo"
    group = GRPOUpdate(lr=1e-3, device=device, ranks=2, rank_timeout_s=120.0)
    try:
        prompts = ["hi", "what colour is it?", "x", "name the shape"]
        embeds = torch.randn(len(prompts), 32, generator=torch.Generator().manual_seed(0))  # (N, D)
        out = Rollout(n=4, max_new_tokens=8, seed=0, device=device).run(
            prompts=prompts, image_embeds=embeds
        )
        inputs = {**_grpo_inputs(out), "image_embeds": embeds}
        start_groups({group.name: group})
        group.setup()
        t0 = time.perf_counter()
        many = node_op(group, "run", inputs)["weights"].weights  # on every rank
        step = time.perf_counter() - t0
        one = GRPOUpdate(lr=1e-3, device=device).run(inputs)["weights"].weights
        diff = max(float((one[k].float() - many[k].float().to(one[k].device)).abs().max()) for k in one)  # fmt: skip
        tol = RANK_TOLERANCE[device]
        ok = sorted(one) == sorted(many) and diff <= tol
        row(FSDP_ROW, "ok" if ok else "FAILED (the weights differ)",
            f"{backend}: step {step:.2f} s, max abs weight diff {diff:.1e} (tolerance {tol:g})")  # fmt: skip
        proc = group.rank_group.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        t0, error = time.perf_counter(), None
        try:
            node_op(group, "run", inputs)
        except Exception as err:
            error = err
        seconds = time.perf_counter() - t0
        first = str(error).splitlines()[0][:160] if error is not None else ""
        row(KILL_ROW, rank_fault_verdict(error, seconds), f"{backend}: {seconds:.2f} s: {first}")
    except Exception as err:
        row.fail_rest(err)
    finally:
        group.close()
