"""The prepared GPU check (bench/gpu_check.py, bench/gpu_rows.py, bench/cuda_ipc.py) where no GPU
is: asked for CUDA it fails and says why, rather than passing with every row skipped; each
row's verdict fails on the figures that should fail it; the vLLM rows run against the stand-in
vllm, and the IPC and rank rows in the CPU rehearsal (host tensors, gloo)."""

import math
import re
import time
from pathlib import Path

import pytest
import torch
from vllm_stand_in import install

from bench import gpu_check
from bench.cuda_ipc import THRESHOLD_ROW, Sweep, threshold_figure, transfer_verdict
from bench.gpu_rows import (
    GAP_ROW,
    HANDOFF_ROW,
    KILL_ROW,
    RANK_ROWS,
    SLEEP_ROW,
    VLLM_ROWS,
    gap_verdict,
    rank_fault_verdict,
    rank_rows,
    sleep_verdict,
    update_verdict,
    vllm_sleep_rows,
)
from runtime.ranks.group import RankError

GiB = 1 << 30
no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="this is the answer of a machine without CUDA"
)


@no_cuda
@pytest.mark.parametrize("quick", [False, True])
def test_the_gpu_check_fails_where_it_checked_nothing(capsys, quick):
    assert gpu_check.main(["--skip-cli", *(["--quick"] if quick else [])]) == 1
    out = capsys.readouterr().out
    assert re.search(r"\| device +\| FAILED \(no CUDA: torch \S+ built for CUDA", out), out
    assert "driver:" in out
    names = gpu_check.all_row_names(quick, 3 if quick else 20)
    for name in names:  # every row it would have run says it did not
        assert re.search(rf"\| {re.escape(name)} +\| skipped: no CUDA \|", out), name
    for row in (*VLLM_ROWS, KILL_ROW, "mm_grpo --device cuda --rollout vllm"):
        assert any(n.startswith(row) for n in names), row
    # --quick leaves out the HF runs but the one on two controllers (IPC between them)
    assert "--rollout" not in " ".join(n for n in names if "--controllers" in n)
    assert any("--controllers 2" in n for n in names)
    assert ("text_grpo --device cuda," in " ".join(names)) is not quick


def test_the_quick_mode_fails_over_its_budget_on_cuda_only():
    assert gpu_check.total_verdict(100, quick=True, device="cuda")[0] == "ok"
    assert gpu_check.total_verdict(481, quick=True, device="cuda")[0].startswith("FAILED")
    assert gpu_check.total_verdict(481, quick=False, device="cuda")[0] == "ok"
    assert gpu_check.total_verdict(481, quick=True, device="cpu")[0] == "ok"


def test_a_row_skipped_on_cuda_fails_the_check_unless_asked_for_or_for_want_of_a_gpu():
    rows = [
        ("text_grpo --rollout vllm, 3 steps", "skipped: --skip-cli", "", 0.0),
        ("2 ranks: a killed rank named", "skipped: needs 2 GPUs, this machine has 1", "", 0.0),
    ]
    assert gpu_check.total_verdict(100, True, "cuda", rows)[0] == "ok"
    rows.append(("qwen2: vLLM rollout", "skipped: vllm is not installed", "", 0.0))
    result = gpu_check.total_verdict(100, True, "cuda", rows)[0]
    assert result == "FAILED (1 rows skipped on CUDA, e.g. 'qwen2: vLLM rollout')"
    assert gpu_check.total_verdict(100, True, "cpu", rows)[0] == "ok"  # the rehearsal skips them


def test_a_cli_run_past_its_time_is_ended_with_the_processes_it_started(tmp_path):
    pid_file = tmp_path / "grandchild"
    script = f"sleep 60 & echo $! > {pid_file}; wait"
    assert gpu_check._run(["bash", "-c", script], timeout_s=2) is None
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    for _ in range(50):  # killed: gone, or a zombie until whoever adopted it reaps it
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the run's child outlived it")
    done = gpu_check._run(["bash", "-c", "echo out; echo err >&2; exit 3"], timeout_s=30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


# --- verdicts -----------------------------------------------------------------------------------
def test_sleep_fails_unless_level_2_returns_most_of_the_engines_memory():
    base = 80 * GiB
    result, figure = sleep_verdict(base, awake=base - 20 * GiB, asleep=base - 1 * GiB)
    assert result == "ok" and "awake holds 20.00 GiB, asleep 1.00 GiB (95% freed)" in figure
    assert sleep_verdict(base, base - 20 * GiB, base - 10 * GiB)[0].startswith("FAILED (level 2")
    assert "saw nothing" in sleep_verdict(base, base, base)[0]


def test_the_gap_fails_when_large_not_finite_absent_or_exactly_zero():
    assert gap_verdict(torch.tensor([0.01, 0.03, 0.0]))[0] == "ok"
    assert (
        "mean 1.33e-02, max 3.00e-02 nats a token over 3 tokens"
        in gap_verdict(torch.tensor([0.01, 0.03, 0.0]))[1]
    )
    assert "not the trainer's" in gap_verdict(torch.tensor([2.0, 1.5]))[0]
    assert "not finite" in gap_verdict(torch.tensor([0.01, math.nan]))[0]
    assert "recomputed nothing" in gap_verdict(torch.zeros(5))[0]
    assert "no response tokens" in gap_verdict(torch.zeros(0))[0]


def test_a_weight_update_into_vllm_must_go_by_cuda_ipc_on_cuda():
    ipc = {"ipc": 1.0, "engine_bytes": 3 * 2**20, "engine_seconds": 0.0042}
    assert update_verdict(True, True, ipc, "cuda") == ("ok", "by ipc: 3.00 MiB into vLLM in 4.2 ms")
    by_bytes = {**ipc, "ipc": 0.0}
    result, figure = update_verdict(True, True, by_bytes, "cuda")
    assert result == "FAILED (changed: True, by bytes, not CUDA IPC)" and figure.startswith(
        "by bytes"
    )
    assert update_verdict(True, True, by_bytes, "cpu")[0] == "ok"  # the stand-in's rehearsal
    assert update_verdict(True, False, ipc, "cuda")[0] == "FAILED (changed: False)"
    assert update_verdict(False, True, ipc, "cuda")[0] == "FAILED (changed: True)"


def test_a_killed_rank_must_be_a_rank_error_naming_it_in_seconds():
    named = RankError("node 'grpo_update': rank 1 (pid 7) was killed by SIGKILL (9)")
    assert rank_fault_verdict(named, 0.5) == "ok"
    assert "returned" in rank_fault_verdict(None, 0.5)
    assert "not a RankError" in rank_fault_verdict(RuntimeError("NCCL timeout"), 0.5)
    assert "does not name rank 1" in rank_fault_verdict(RankError("rank 0 died"), 0.5)
    assert "over 10 s" in rank_fault_verdict(named, 300.0)


def test_a_cli_run_with_vllm_fails_without_a_small_logprob_gap():
    assert gpu_check.cli_gap({"logprob_gap_mean": 0.01}, "vllm") == ("ok", ", logprob gap 1.00e-02")
    assert gpu_check.cli_gap({"logprob_gap_mean": 0.9}, "vllm")[0].startswith("FAILED (logprob gap over")  # fmt: skip
    assert gpu_check.cli_gap({"logprob_gap_mean": math.nan}, "vllm")[0].startswith("FAILED")
    assert gpu_check.cli_gap({}, "vllm")[0] == "FAILED (no logprob gap reported)"
    assert gpu_check.cli_gap({}, "hf") == ("ok", "")  # the HF rollout's logprobs are the trainer's


def test_a_cli_run_on_two_controllers_fails_unless_tensors_went_by_cuda_ipc():
    assert gpu_check.cli_ipc([{"sched/ipc_bytes": 0.0}] * 3)[0].startswith("FAILED (no tensor")
    assert gpu_check.cli_ipc([])[0].startswith("FAILED")
    rows = [{"sched/ipc_bytes": 2e6}, {"sched/ipc_bytes": 1e6}]
    assert gpu_check.cli_ipc(rows) == ("ok", ", IPC 3.0 MB over 2 steps")


def _sweep(times: dict[int, float], ipc_bytes: int = 0, equal: bool = True) -> Sweep:
    sweep = Sweep({k: (t, ipc_bytes) for k, t in times.items()})
    sweep.equal = equal
    return sweep


def test_the_ipc_rows_fail_on_cuda_unless_the_bytes_went_the_way_asked():
    assert transfer_verdict(_sweep({64: 1e-3}, ipc_bytes=65536), ipc=True, device="cuda") == "ok"
    assert "no byte went by CUDA IPC" in transfer_verdict(_sweep({64: 1e-3}), True, "cuda")
    assert transfer_verdict(_sweep({64: 1e-3}), ipc=False, device="cuda") == "ok"
    assert "with it turned off" in transfer_verdict(_sweep({64: 1e-3}, 65536), False, "cuda")
    assert transfer_verdict(_sweep({64: 1e-3}), ipc=True, device="cpu") == "ok"  # rehearsal
    assert "values differ" in transfer_verdict(_sweep({64: 1e-3}, 65536, False), True, "cuda")


def test_the_threshold_row_names_the_size_from_which_ipc_wins():
    ipc = _sweep({16: 3e-4, 64: 2e-4, 1024: 2e-4, 65536: 1e-3})
    host = _sweep({16: 2e-4, 64: 3e-4, 1024: 5e-4, 65536: 9e-3})
    assert threshold_figure(ipc, host).startswith("IPC faster from 64 KiB on; MIN_BYTES is 64 KiB")
    assert threshold_figure(host, ipc).startswith("the host copy is as fast or faster")


# --- rows run on the CPU --------------------------------------------------------------------
@pytest.fixture
def text_policy(tmp_path):
    from nodes.data import task_vocabulary
    from nodes.models.policy import build_policy

    build_policy({"name": "tiny-qwen2", "seed": 0, "words": task_vocabulary()}).save_pretrained(
        tmp_path
    )
    return tmp_path


def _collect():
    rows = []
    return rows, lambda check, result, figure="": rows.append((check, result, figure))


def test_the_vllm_rows_skip_saying_why_without_vllm(monkeypatch, text_policy):
    monkeypatch.setattr("nodes.rollout.vllm_unavailable_reason", lambda: "no vllm here")
    rows, row = _collect()
    vllm_sleep_rows(row, text_policy, "cpu", eager=True)
    assert rows == [(name, "skipped: no vllm here", "") for name in VLLM_ROWS]


def test_the_vllm_rows_sleep_wake_and_train_against_the_stand_in(monkeypatch, text_policy):
    """The stand-in samples fixed tokens with made-up logprobs: the rows run through sleep,
    wake-up, a trainer's step and an update, and the gap rows fail on its logprobs, as they
    would on an engine whose weights are not the trainer's."""
    vllm = install(monkeypatch)
    engines = []
    real = vllm.LLM

    def llm(*args, **kwargs):
        engines.append(real(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(vllm, "LLM", llm)
    rows, row = _collect()
    vllm_sleep_rows(row, text_policy, "cpu", eager=True)
    assert [r[0] for r in rows] == [SLEEP_ROW, GAP_ROW, HANDOFF_ROW]
    assert rows[0][1] == "ok" and "wake + weights + generation" in rows[0][2]
    assert rows[1][1].startswith("FAILED (mean over 0.1") and "nats a token" in rows[1][2]
    assert rows[2][1].startswith("FAILED (mean over 0.1") and "vLLM woke with the update" in rows[2][2]  # fmt: skip
    (engine,) = engines
    assert engine.kwargs["enable_sleep_mode"] and engine.kwargs["enforce_eager"]
    assert engine.kwargs["dtype"] == "bfloat16"
    calls = engine.calls
    assert calls[:2] == ["sleep 2", "wake kv_cache,weights"]  # built asleep, then woken by hand
    assert calls.count("generate") == 2 and calls[-1] == "sleep 2"  # asleep after each call


def test_the_model_rows_fail_when_the_engine_answers_the_same_after_an_update(
    monkeypatch, text_policy
):
    """The stand-in returns the same tokens whatever its weights, as an engine would from caches
    that outlived an update: the update row fails, and so does the logprob row on its made-up
    logprobs. One engine serves the rollout, logprob and update rows."""
    vllm = install(monkeypatch)
    engines = []
    real = vllm.LLM
    monkeypatch.setattr(vllm, "LLM", lambda *a, **kw: engines.append(real(*a, **kw)) or engines[-1])
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_check, "ROWS", [])
    gpu_check._model_checks("qwen2", text_policy, eager=True)
    rows = {check: (result, figure) for check, result, figure, _ in gpu_check.ROWS}
    assert list(rows) == [f"qwen2: {c}" for c in gpu_check.CHECKS]
    assert rows["qwen2: vLLM rollout"][0] == "ok"
    assert rows["qwen2: vLLM vs HF logprobs"][0] == "FAILED"
    assert rows["qwen2: weight update into vLLM"][0] == "FAILED (changed: False)"
    assert "by bytes: " in rows["qwen2: weight update into vLLM"][1]  # (no CUDA: no IPC here)
    (engine,) = engines
    assert engine.kwargs["dtype"] == "float32" and engine.kwargs["enforce_eager"]
    assert engine.calls.count("reset prefix") == 1  # the update reset the engine's caches


def test_a_failure_part_way_fails_every_row_not_reached(monkeypatch, text_policy):
    install(monkeypatch)

    def broken(self):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr("nodes.models.vllm_engine.VLLMEngine.wake_up", broken)
    rows, row = _collect()
    vllm_sleep_rows(row, text_policy, "cpu", eager=True)
    assert [r[0] for r in rows] == list(VLLM_ROWS)
    assert all(r[1] == "FAILED (RuntimeError: CUDA error: out of memory)" for r in rows)


@pytest.mark.slow
def test_the_quick_rehearsal_runs_every_row_it_lists(capsys, monkeypatch):
    """``--device cpu --quick``: HF, offload, IPC (host tensors) and rank (gloo) rows run and
    pass, the vLLM rows skip saying why, and the rows are the ones the no-CUDA answer lists."""
    monkeypatch.setattr("nodes.rollout.vllm_unavailable_reason", lambda: "vllm: not here")
    assert gpu_check.main(["--device", "cpu", "--quick", "--skip-cli"]) == 0
    names = [check for check, _, _, _ in gpu_check.ROWS]
    assert names == ["device", *gpu_check.all_row_names(True, 3), gpu_check.TOTAL_ROW]
    results = {check: result for check, result, _, _ in gpu_check.ROWS}
    for name in ("qwen2_vl: HF rollout", gpu_check.OFFLOAD_ROW, *RANK_ROWS, THRESHOLD_ROW):
        assert results[name] == "ok", (name, results[name])
    assert all(results[n] == "ok" for n in names if n.startswith("cpu tensors")), results
    assert all(results[n].startswith("skipped: vllm") for n in VLLM_ROWS), results
    out = capsys.readouterr().out
    assert re.search(
        r"\| 2 ranks: a killed rank named +\| ok \| gloo: [\d.]+ s: node .*rank 1", out
    )
    assert re.search(r"0\.0 MiB by CUDA IPC, on cpu \| [\d.]+ \|", out)


def test_the_rank_rows_skip_without_two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    rows, row = _collect()
    rank_rows(row, "cuda")
    assert [r[1] for r in rows] == ["skipped: needs 2 GPUs, this machine has 1"] * 2
