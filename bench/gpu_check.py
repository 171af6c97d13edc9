"""The GPU paths, checked in one prepared run on a machine with CUDA (and the vllm extra).

    make gpu-check            # = make install-gpu && .venv-gpu/bin/python -m bench.gpu_check
    make gpu-check QUICK=1    # --quick: every kind of row, small and few (8 minutes on one H100)
    python -m bench.gpu_check [--quick] [--steps 20] [--out DIR] [--skip-cli] [--device cpu]

Builds a tiny Qwen2-VL and a tiny Qwen2 in code, saves them, then on CUDA:

1. for each model: HF rollout (transformers ``generate``, samples/s); vLLM rollout of the same
   prompts (one greedy float32 engine, samples/s); vLLM's logprobs against the HF
   teacher-forced recompute of the same samples (max abs difference within ``TOLERANCE``); a
   weight update into the running engine through the rollout's ``weights`` port (seeded
   noise on every weight), then greedy generations of the prompts it has already seen: vLLM's
   must agree with the HF policy's holding the same weights (at least ``AGREEMENT`` of the
   tokens) and differ from before, which they would not if its prefix, multimodal or encoder
   caches outlived the update; it must go by CUDA IPC (bytes and seconds: ``weight_sync``);
2. the text model on one engine as the ready graphs build it (:mod:`bench.gpu_rows`): sleep
   level 2 and back (memory freed, by ``torch.cuda.mem_get_info()``), the gap between vLLM's
   bfloat16 logprobs and the trainer's float32 recompute, and a colocated hand-off: a GRPO
   update trains a step on the GPU memory the sleeping engine gave back, offloads, and the
   engine wakes with the update;
3. text_grpo's model state (policy, optimizer, reference) offloaded to pinned host memory and
   reloaded: time, GB/s, the memory freed as the driver counts it (``mem_get_info``: what
   another process could take, where ``memory_allocated`` would count blocks torch still caches
   as free) and the weights equal after;
4. CUDA tensors between two controllers on one GPU by CUDA IPC and by the host copy, over a
   sweep of sizes (:mod:`bench.cuda_ipc`): ms per size, the bytes that went by IPC (the IPC
   row fails when none did), and where IPC starts to beat the copy (``cuda_ipc.MIN_BYTES``);
5. ``--steps`` steps through the CLI with ``--device cuda`` of mm_grpo and text_grpo with
   ``--rollout vllm`` (the Qwen2-VL and the Qwen2 as ``--policy``), of mm_grpo on two
   controllers that time-share the GPU (``--controllers 2 --offload auto``), and without
   ``--quick`` also with the HF rollout: wall time, reward first -> last, the logprob gap, the
   switch time a step and the bytes that went between the controllers by CUDA IPC; with vLLM a
   gap missing or over ``GAP_MEAN_LIMIT`` fails, and so does the two-controller run when no
   tensor went by IPC; a row says skipped with the CLI's reason if it refuses the flags;
6. with two GPUs (:mod:`bench.gpu_rows`): a GRPO update as an FSDP2 group of 2 ranks on NCCL
   against 1 rank, and a rank killed under it, which must be a RankError naming it within
   seconds.

It prints one table (check, result, figure, seconds: the time since the row before). Its last
row, the total, fails on CUDA when a row was skipped for another reason than ``--skip-cli`` or
a missing second GPU (vllm not installed: those rows checked nothing), and with ``--quick``
(3 CLI steps, 4 IPC sizes, engines without CUDA graphs) when the whole took over
``QUICK_BUDGET_S``. Asked to check CUDA where there is none, the device row fails (with torch's
CUDA build and the driver's version) and it exits 1: a check that checked nothing does not
pass. A failed row exits 1. ``--device cpu`` runs the same script on the CPU (the vLLM rows say
why they skip, the IPC rows send host tensors, the rank rows run on gloo): a rehearsal of the
script itself, not of the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.cuda_ipc import QUICK_SIZES_KIB, SIZES_KIB, THRESHOLD_ROW, ipc_rows, row_name
from bench.gpu_rows import (
    GAP_MEAN_LIMIT,
    RANK_ROWS,
    VLLM_ROWS,
    close_engine,
    rank_rows,
    update_verdict,
    vllm_sleep_rows,
)

TOLERANCE = 2e-2
"""max |vLLM - HF| logprob of the same tokens. Both run float32 (the rows ask the engine for
it), but vLLM's kernels are not transformers'; wrong names or stale weights differ by whole
nats."""
AGREEMENT = 0.95
"""The share of greedy tokens vLLM and HF must agree on after the update."""
MODELS = ("qwen2_vl", "qwen2")
CHECKS = ("HF rollout", "vLLM rollout", "vLLM vs HF logprobs", "weight update into vLLM")
# (graph, rollout, flags, the saved model as --policy (None: the graph's own), in --quick)
CLI_RUNS: tuple[tuple[str, str, tuple[str, ...], str | None, bool], ...] = (
    ("graphs/mm_grpo.py", "vllm", (), "qwen2_vl", True),
    ("graphs/text_grpo.py", "vllm", (), "qwen2", True),
    ("graphs/mm_grpo.py", "hf", (), None, False),
    ("graphs/text_grpo.py", "hf", (), "qwen2", False),
    # two controllers time-sharing the one GPU (colocated, on-policy): devices per controller,
    # tensors between them by CUDA IPC (the row fails when none went so), and each role's
    # state offloaded when its turn ends
    ("graphs/mm_grpo.py", "hf", ("--controllers", "2", "--offload", "auto"), None, True),
)
OFFLOAD_ROW = "offload + reload of text_grpo's policy, optimizer, reference"
TOTAL_ROW = "the whole check"
N = 32  # prompts per rollout
QUICK_BUDGET_S = 480.0
"""--quick's promise: the whole check within 8 minutes on one H100."""
QUICK_STEPS = 3

ROWS: list[tuple[str, str, str, float]] = []
_LAST = [time.perf_counter()]


def row(check: str, result: str, figure: str = "") -> None:
    """One row of the table; its seconds are the time since the row before."""
    now = time.perf_counter()
    ROWS.append((check, result, figure, now - _LAST[0]))
    _LAST[0] = now
    print(f"  {check}: {result} {figure}", flush=True)


DEVICE = "cuda"


def _cli_name(graph: str, rollout: str, flags: tuple[str, ...] = ()) -> str:
    vllm = " --rollout vllm" if rollout == "vllm" else ""
    return " ".join([f"{Path(graph).stem} --device {DEVICE}{vllm}", *flags])


def _cli_runs_of(quick: bool) -> list[tuple[str, str, tuple[str, ...], str | None]]:
    return [(g, r, f, p) for g, r, f, p, in_quick in CLI_RUNS if in_quick or not quick]


def _cli_row_names(quick: bool, steps: int) -> list[str]:
    return [f"{_cli_name(g, r, f)}, {steps} steps" for g, r, f, _ in _cli_runs_of(quick)]


def _metrics(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().strip().splitlines()]
    except (OSError, ValueError):
        return []


def cli_gap(last: dict[str, Any], rollout: str) -> tuple[str, str]:
    """(result, figure) from a CLI run's last metrics: its logprob gap (the update's
    ``logprob_gap_mean``). With vLLM the ready graphs recompute the logprobs, so a missing gap,
    or one over ``GAP_MEAN_LIMIT`` (the engine not serving the trained weights), fails."""
    gap = last.get("logprob_gap_mean")
    if not isinstance(gap, (int, float)):
        return ("FAILED (no logprob gap reported)" if rollout == "vllm" else "ok"), ""
    figure = f", logprob gap {gap:.2e}"
    if rollout == "vllm" and not gap <= GAP_MEAN_LIMIT:
        return f"FAILED (logprob gap over {GAP_MEAN_LIMIT})", figure
    return "ok", figure


def cli_ipc(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """(result, figure) of a run on several controllers sharing the GPU: the bytes its
    controllers opened by CUDA IPC (``sched/ipc_bytes`` over every step). The ready graphs'
    model nodes hand on their outputs on the GPU, so a run where none went by IPC fails."""
    total = sum(r.get("sched/ipc_bytes", 0.0) for r in rows)
    if not total > 0:
        return "FAILED (no tensor went between its controllers by CUDA IPC)", ", IPC 0 bytes"
    return "ok", f", IPC {total / 1e6:.1f} MB over {len(rows)} steps"


def _switch_figure(last: dict[str, Any]) -> str:
    """The last step's offload/reload time and bytes (``sched/*``), if the run switched."""
    if not last:
        return ""
    if "sched/switch_s" not in last:
        return ", no switches"
    gb = (last.get("sched/offload_bytes", 0.0) + last.get("sched/reload_bytes", 0.0)) / 1e9
    return f", switch {1000 * last['sched/switch_s']:.1f} ms/step ({gb:.3f} GB moved)"


def _save_policies(tmp: Path) -> dict[str, Path]:
    from nodes.data import task_vocabulary
    from nodes.models.policy import build_policy, tiny_qwen2_vl

    tiny_qwen2_vl(seed=0).save_pretrained(tmp / "qwen2_vl")
    text = build_policy({"name": "tiny-qwen2", "seed": 0, "words": task_vocabulary()})
    text.save_pretrained(tmp / "qwen2")
    return {"qwen2_vl": tmp / "qwen2_vl", "qwen2": tmp / "qwen2"}


def _timed(node: Any, ports: dict[str, Any]) -> tuple[dict[str, Any], float]:
    node.setup()  # building (and starting an engine) is not sampling
    start = time.perf_counter()
    out = node.run(**ports)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return out, N / (time.perf_counter() - start)


def _model_checks(name: str, path: Path, eager: bool) -> None:
    from PIL import Image

    from nodes.rollout import Rollout, vllm_unavailable_reason
    from nodes.sync import WeightUpdate

    # 36 tokens of text: whole blocks of vLLM's prefix cache (16 tokens), which a weight update
    # must reset, as it must the image's entries in the multimodal and encoder caches
    prompts = [" ".join(["what color is the shape ?"] * 6)] * N
    images = [Image.new("RGB", (32, 32), (200, 10, 10))] * N if name == "qwen2_vl" else None
    ports: dict[str, Any] = {"prompts": prompts}
    if images is not None:
        ports["images"] = images
    common = {"policy": str(path), "max_new_tokens": 16, "seed": 0, "device": DEVICE}
    _, rate = _timed(Rollout(**common), ports)
    row(f"{name}: HF rollout", "ok", f"{rate:.1f} samples/s")
    why = vllm_unavailable_reason()
    if why:
        for check in CHECKS[1:]:
            row(f"{name}: {check}", f"skipped: {why}")
        return
    # float32: these rows check names and weights, which precision would blur (the ready
    # graphs serve bfloat16 and correct the gap: bench.gpu_rows measures it). Greedy, so that
    # the generations after the update can be compared with HF's; one engine for all rows.
    engine = {"gpu_memory_utilization": 0.15, "dtype": "float32", "enforce_eager": eager}
    node = Rollout(**{**common, "temperature": 0.0}, backend="vllm", vllm_options=engine)
    try:
        _vllm_rows(name, node, ports, images, WeightUpdate)
    finally:
        close_engine(node)


def _vllm_rows(name: str, node: Any, ports: dict[str, Any], images: Any, update_type: Any) -> None:
    out, rate = _timed(node, ports)
    row(f"{name}: vLLM rollout", "ok", f"{rate:.1f} samples/s")
    with torch.no_grad():
        batch = node.policy.prepare(out["prompt_ids"], out["prompt_mask"], images=images)
        ref = node.policy.response_logprobs(
            batch.to(DEVICE), out["response_ids"].to(DEVICE), out["response_mask"].to(DEVICE)
        )
    diff = float((out["logprobs"].to(DEVICE) - ref).abs().max())
    ok = diff <= TOLERANCE
    row(
        f"{name}: vLLM vs HF logprobs",
        "ok" if ok else "FAILED",
        f"max abs diff {diff:.2e} (tolerance {TOLERANCE:g})",
    )
    # the update: through the weights port, into the running engine, then the same prompts
    # again (their prefix blocks, and the image's encoder output, are in the engine's caches)
    short = {k: v[:4] for k, v in ports.items()}
    before = node.run(**short)["response_ids"]
    gen = torch.Generator().manual_seed(0)
    update = {
        k: v + 0.5 * v.float().std().nan_to_num() * torch.randn(v.shape, generator=gen).to(v)
        for k, v in node.policy.state_dict().items()
        if v.is_floating_point()
    }
    start = time.perf_counter()
    after = node.run(**short, weights=update_type(update, version=1, complete=False))
    seconds = time.perf_counter() - start  # the update (policy and engine) and a generation
    batch = node.policy.encode_prompts(short["prompts"], images=short.get("images")).to(DEVICE)
    hf = node.policy.generate(batch, max_new_tokens=16, temperature=0.0)
    agree = _agreement(after["response_ids"], after["response_mask"], hf)
    changed = before.shape != after["response_ids"].shape or not torch.equal(
        before, after["response_ids"]
    )
    result, path = update_verdict(agree >= AGREEMENT, changed, after["weight_sync"], DEVICE)
    figure = f"{agree:.0%} of greedy tokens agree with HF (need {AGREEMENT:.0%}); {path}"
    ms = seconds * 1e3
    row(f"{name}: weight update into vLLM", result, f"{figure}; update + generation {ms:.0f} ms")


def _agreement(ids: torch.Tensor, mask: torch.Tensor, hf: Any) -> float:
    """The share of vLLM's response tokens that HF's greedy response has at the same place."""
    R = min(ids.shape[1], hf.response_ids.shape[1])
    real = mask[:, :R].bool().cpu()
    same = ids[:, :R].cpu() == hf.response_ids[:, :R].cpu()
    return float(same[real].float().mean()) if real.any() else 0.0


def _run(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess | None:
    """``cmd`` in a session of its own; past ``timeout_s`` the whole session is killed (its
    controllers and vLLM's engine process would otherwise keep their GPU memory) and None is
    returned."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _cli_runs(steps: int, out: Path, policies: dict[str, Path], quick: bool) -> None:
    from nodes.rollout import vllm_unavailable_reason

    yatt = str(Path(sys.executable).parent / "yatt-graph")
    timeout_s = 240 if quick else 600
    for graph, rollout, flags, policy in _cli_runs_of(quick):
        name = f"{_cli_name(graph, rollout, flags)}, {steps} steps"
        why = vllm_unavailable_reason() if rollout == "vllm" else None
        if why:
            row(name, f"skipped: {why}")
            continue
        folder = out / "-".join([Path(graph).stem, rollout, *(f.strip("-") for f in flags)])
        cmd = [yatt, "run", graph, "--steps", str(steps), "--device", DEVICE]
        cmd += ["--out", str(folder), "--overwrite", "--quiet", "--rollout", rollout, *flags]
        if policy is not None:
            cmd += ["--policy", str(policies[policy])]
        start = time.perf_counter()
        done = _run(cmd, timeout_s)
        if done is None:
            row(name, f"FAILED (not done after {timeout_s} s)")
            continue
        seconds = time.perf_counter() - start
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        if done.returncode == 2 and "unrecognized arguments" in done.stderr:
            row(name, f"skipped: the CLI refuses the flags ({last})")
            continue
        if done.returncode != 0:
            row(name, f"FAILED (exit {done.returncode}: {last})")
            continue
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        first, final = summary.get("reward_first"), summary.get("reward_last")
        reward = f"reward {first:.3f} -> {final:.3f}" if first is not None else "no reward"
        rows = _metrics(folder / "metrics.jsonl")
        metrics = rows[-1] if rows else {}
        switches = _switch_figure(metrics) if flags else ""
        result, gap = cli_gap(metrics, rollout)
        ipc = ""
        if "--controllers" in flags:
            ipc_result, ipc = cli_ipc(rows)
            result = result if result != "ok" else ipc_result
        row(name, result, f"{seconds:.0f} s, {reward}{gap}{switches}{ipc}")


def _offload_check(policy: Path) -> None:
    """text_grpo's model state (policy, optimizer, reference) off the GPU and back,
    timed, with the memory it frees on the device (``torch.cuda.mem_get_info()``, what another
    process could take: at least 90% of the bytes moved) and the weights equal after. On
    ``--device cpu`` the moves are CPU copies (``ALWAYS_COPY``): no memory figure."""
    import nodes.models.offload as off
    from runtime.engine.engine import LocalExecutor
    from runtime.engine.switch import has_device_state
    from yatt_graph.refs import load_graph

    graph = load_graph("graphs.text_grpo", policy=str(policy), device=DEVICE, batch_size=8)
    ex = LocalExecutor(graph)
    ex.step()  # the optimizer has its state
    models = [n for n in graph.nodes.values() if has_device_state(n)]
    weights = {k: v.clone() for k, v in graph.nodes["grpo"].policy.state_dict().items()}
    cuda = DEVICE == "cuda"
    off.ALWAYS_COPY = not cuda
    try:
        if cuda:  # the step's cached blocks back first: the figure is the offload's alone
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info()[0] if cuda else 0
        t0 = time.perf_counter()
        moved = sum(n.offload() for n in models)
        away = time.perf_counter() - t0
        free_after = torch.cuda.mem_get_info()[0] if cuda else 0
        t0 = time.perf_counter()
        back = sum(n.reload() for n in models)
        again = time.perf_counter() - t0
    finally:
        off.ALWAYS_COPY = False
    policy_now = graph.nodes["grpo"].policy.state_dict()
    same = all(torch.equal(v.cpu(), policy_now[k].cpu()) for k, v in weights.items())
    freed = free_after - free_before
    mib = 1 << 20
    figure = (
        f"{moved / mib:.0f} MiB off in {away * 1e3:.0f} ms ({moved / max(away, 1e-9) / 1e9:.1f}"
        f" GB/s), back in {again * 1e3:.0f} ms"
    )
    if cuda:
        figure += f"; GPU free {free_before / mib:.0f} -> {free_after / mib:.0f} MiB"
    ok = same and back == moved and moved > 0 and (not cuda or freed >= 0.9 * moved)
    why = "" if ok else f" (weights equal: {same}, moved {moved} back {back}, freed {freed})"
    row(OFFLOAD_ROW, "ok" if ok else f"FAILED{why}", figure)
    ex.step()  # and the run goes on


def _cuda_versions() -> str:
    """torch's CUDA build and the driver's version, for a machine where CUDA does not come up
    (a driver older than the build needs is the usual cause)."""
    driver = "no nvidia-smi"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        driver = out.stdout.strip() or out.stderr.strip() or f"nvidia-smi exit {out.returncode}"
    except (OSError, subprocess.TimeoutExpired) as err:
        driver = f"nvidia-smi: {err}"
    return f"torch {torch.__version__} built for CUDA {torch.version.cuda}; driver: {driver}"


def all_row_names(quick: bool, steps: int) -> list[str]:
    """Every row a run on CUDA prints after the device row, in order (the no-CUDA answer
    lists them as skipped)."""
    return [
        *(f"{m}: {c}" for m in MODELS for c in CHECKS),
        *VLLM_ROWS,
        OFFLOAD_ROW,
        *(row_name(DEVICE, ipc) for ipc in (True, False)),
        THRESHOLD_ROW,
        *_cli_row_names(quick, steps),
        *RANK_ROWS,
    ]


def _checks(args: argparse.Namespace) -> None:
    eager = args.quick  # CUDA graphs take longer to capture than these rows take to run
    with tempfile.TemporaryDirectory() as tmp:
        policies = _save_policies(Path(tmp))
        for name in MODELS:
            try:
                _model_checks(name, policies[name], eager)
            except Exception as err:  # one model's failure must not hide the other's rows
                row(f"{name}: checks", f"FAILED ({type(err).__name__}: {err})")
        vllm_sleep_rows(row, policies["qwen2"], DEVICE, eager)
        try:
            _offload_check(policies["qwen2"])
        except Exception as err:
            row(OFFLOAD_ROW, f"FAILED ({type(err).__name__}: {err})")
        sizes = QUICK_SIZES_KIB if args.quick else SIZES_KIB
        ipc_rows(row, sizes, reps=3 if args.quick else 5, device=DEVICE)
        if args.skip_cli:
            for name in _cli_row_names(args.quick, args.steps):
                row(name, "skipped: --skip-cli")
        else:
            _cli_runs(args.steps, Path(args.out or tmp), policies, args.quick)
        rank_rows(row, DEVICE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"every kind of row, small and few: within {QUICK_BUDGET_S / 60:.0f} "
                   "minutes on one H100, or the last row fails")  # fmt: skip
    p.add_argument("--steps", type=int, default=None,
                   help=f"CLI steps a run (default 20; {QUICK_STEPS} with --quick)")  # fmt: skip
    p.add_argument("--out", default=None, help="run folders (default: a temporary folder)")
    p.add_argument("--skip-cli", action="store_true", help="no CLI runs")
    p.add_argument("--device", default="cuda", help="cpu: rehearse the script without a GPU")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = QUICK_STEPS if args.quick else 20
    global DEVICE
    DEVICE = args.device
    ROWS.clear()
    start = _LAST[0] = time.perf_counter()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        # asked to check the GPU and none is usable: that is a failure, not a pass
        row("device", f"FAILED (no CUDA: {_cuda_versions()})")
        for check in all_row_names(args.quick, args.steps):
            row(check, "skipped: no CUDA")
    else:
        gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE
        gpus = f", {torch.cuda.device_count()} GPUs" if DEVICE == "cuda" else ""
        row("device", gpu, f"torch {torch.__version__}{gpus}")
        _checks(args)
    row(TOTAL_ROW, *total_verdict(time.perf_counter() - start, args.quick, DEVICE, ROWS))
    print_table()
    return 1 if any(r.startswith("FAILED") for _, r, _, _ in ROWS) else 0


EXPECTED_SKIPS = ("skipped: --skip-cli", "skipped: needs 2 GPUs", "skipped: no CUDA")
"""Skips a run on CUDA may pass with: asked for, or the machine has one GPU (with no CUDA the
device row has failed already)."""


def total_verdict(
    seconds: float, quick: bool, device: str, rows: list[tuple[str, str, str, float]] = ()
) -> tuple[str, str]:
    """(result, figure) of the last row. On CUDA it fails when ``--quick`` ran over its budget,
    or when a row was skipped for another reason than :data:`EXPECTED_SKIPS` (vllm missing on
    a GPU machine: those rows checked nothing)."""
    budget = f" (--quick: within {QUICK_BUDGET_S:.0f} s)" if quick else ""
    figure = f"{seconds:.0f} s{budget}"
    if device != "cuda":
        return "ok", figure
    if quick and seconds > QUICK_BUDGET_S:
        return f"FAILED (over {QUICK_BUDGET_S:.0f} s)", figure
    skipped = [c for c, r, _, _ in rows if r.startswith("skipped") and not r.startswith(EXPECTED_SKIPS)]  # fmt: skip
    if skipped:
        return f"FAILED ({len(skipped)} rows skipped on CUDA, e.g. {skipped[0]!r})", figure
    return "ok", figure


def print_table() -> None:
    width = max(len(c) for c, _, _, _ in ROWS)
    print("\n| check | result | figure | s |\n|---|---|---|---|")
    for check, result, figure, seconds in ROWS:
        print(f"| {check.ljust(width)} | {result} | {figure} | {seconds:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
