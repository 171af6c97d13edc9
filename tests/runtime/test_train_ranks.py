"""Update nodes as SPMD groups of K ranks (runtime/ranks/, nodes/update/trainer.py):
a 2-rank group trains as the 1-rank node does, its checkpoints resume with K=2 or K=1, a
dead rank is named, and the ranks end with their parent.

Tolerances: after 3 calls of 2 AdamW steps each at lr 1e-3, the 2-rank weights were observed
within 1.2e-5 (max abs) of the 1-rank ones over 5 batches on an Intel Xeon (the PPO critic the
widest; GRPO within 7.2e-6), 4.5e-6 on an AMD EPYC: the gradients agree to float rounding (the
group sums them in another order), and Adam's normalization turns that into weight differences
that depend on the CPU. A rank whose share was lost (the 1-rank node trained on half the batch)
is 1e-2 away. The tests allow 1e-4. Metrics are sums of the same terms in another order:
relative 1e-5.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from policy_helpers import sampled_batch

from nodes.reference import Critic
from nodes.rl.advantages import broadcast_to_tokens
from nodes.rollout import Rollout
from nodes.update import GRPOUpdate, PPOUpdate
from nodes.update.trainer import View, plan_micro_batches
from runtime.engine.calls import node_op
from runtime.ranks.group import RankError, start_groups
from yatt_graph.partition import lpt

PROMPTS = ["hi", "what colour is it?", "x", "name the shape"]
WEIGHT_TOL = 1e-4
METRIC_RTOL = 1e-5
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def batch():
    """16 responses (4 prompts x 4), +1 / -1 scores, image embeddings one row per prompt."""
    out, ports, embeds, adv = sampled_batch(PROMPTS)
    values = Critic().run(ports, image_embeds=embeds)["values"]
    grpo = {**ports, "logprobs": out["logprobs"], "advantages": adv, "image_embeds": embeds}
    return {"grpo": grpo, "ppo": {**grpo, "returns": adv, "values": values}}


def _rows(inputs, prompts):
    """The first ``prompts`` prompts' rows (4 responses each) of a batch."""
    return {k: v[:prompts] if k == "image_embeds" else v[: 4 * prompts] for k, v in inputs.items()}


def _max_diff(a, b):
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _assert_same_metrics(one, many):
    assert set(many) == set(one) | {"time/weight_gather"}
    assert many["time/weight_gather"] > 0
    for k, v in one.items():
        assert math.isclose(v, many[k], rel_tol=METRIC_RTOL, abs_tol=1e-7), (k, v, many[k])


def _trains_alike(one, many, inputs, calls, ports=("weights",)):
    """``calls`` calls of a 1-rank node and of a rank group on ``inputs`` give weights within
    WEIGHT_TOL and the same metrics; the group is closed after."""
    try:
        for _ in range(calls):
            out1, out2 = one.run(inputs), node_op(many, "run", inputs)
        for port in ports:
            assert _max_diff(out1[port].weights, out2[port].weights) <= WEIGHT_TOL
        _assert_same_metrics(out1["metrics"], out2["metrics"])
    finally:
        many.close()


@pytest.fixture(scope="class")
def grpo_fsdp():
    """One FSDP group for the tests of a class (a process holds one group at a time)."""
    node = _grouped(GRPOUpdate(lr=1e-3, epochs=2, ranks=2, train_backend="fsdp"))
    node.setup()
    yield node
    node.close()


def _fresh_grpo(**kw):
    return _grouped(GRPOUpdate(lr=1e-3, epochs=2, **kw))


def _grouped(node):
    """The node with its rank group started, as an executor starts it before setup()."""
    start_groups({node.name: node})
    return node


# --- pure parts -------------------------------------------------------------------------------


def test_split_by_cost_balances_whole_units():
    costs = [9, 1, 8, 2, 7, 3, 3, 0]
    shares = lpt(costs, 3)
    assert sorted(i for s in shares for i in s) == list(range(len(costs)))
    loads = [sum(costs[i] for i in s) for s in shares]
    assert loads == [11, 11, 11]  # 33 over 3: balanced exactly
    assert lpt(costs, 3) == shares  # a pure function: every rank cuts alike
    assert lpt([5], 2) == [[0], []]


def test_micro_batches_pad_with_fillers():
    # 3 units of 2 rows (image rows one per prompt); unit 1 holds the most tokens
    real = torch.tensor([[1, 0], [1, 0], [1, 1], [1, 1], [1, 0], [0, 0]], dtype=torch.bool)
    full = View({"x": torch.arange(6)}, real, torch.arange(3.0)[:, None], None, 2)
    slices = lambda b: [slice(i, min(i + 2, b)) for i in range(0, b, 2)]  # noqa: E731
    cut = lambda v: [(v, s) for s in slices(len(v.real))]  # noqa: E731
    plans = [plan_micro_batches(full, cut, rank, 2) for rank in range(2)]
    assert [len(micros) for micros, _ in plans] == [2, 2]  # as many backward passes each
    (m0, filler), (m1, _) = plans
    assert m0[0].view.t["x"].tolist() == [2, 3] and m0[0].grad_scale == 2.0
    assert m1[0].view.t["x"].tolist() == [0, 1, 4, 5] and m1[0].view.image_embeds.tolist() == [
        [0.0],
        [2.0],
    ]
    assert m0[1] is filler and filler.grad_scale == 0.0 and filler.stat_scale == 0.0
    alone, none = plan_micro_batches(full, cut, 0, 1)
    assert none is None and [m.rows for m in alone] == slices(6)


def test_bad_rank_options_are_refused():
    with pytest.raises(ValueError, match=r"ranks=0; it must be an int >= 1"):
        GRPOUpdate(ranks=0)
    with pytest.raises(ValueError, match=r"train_backend='zero'; choose one of fsdp, hsdp, ddp"):
        PPOUpdate(train_backend="zero")


# --- a group trains as one rank does --------------------------------------------------------------


class TestOneFSDPGroup:
    """A GRPO group of 2 FSDP ranks: equal to one rank, and its checkpoints resume."""

    def test_grpo_fsdp_two_ranks_equal_one_rank(self, batch, grpo_fsdp):
        one = _fresh_grpo()
        node_op(grpo_fsdp, "load_state_dict", one.state_dict())  # start both from the built weights
        for _ in range(3):
            out1, out2 = one.run(batch["grpo"]), node_op(grpo_fsdp, "run", batch["grpo"])
        assert _max_diff(out1["weights"].weights, out2["weights"].weights) <= WEIGHT_TOL
        assert out1["weights"].version == out2["weights"].version == 3
        _assert_same_metrics(out1["metrics"], out2["metrics"])
        # sharded: rank 0 holds about half of each block's parameters (and so of its gradients and
        # Adam moments, which are shaped like them)
        local = sum(p.to_local().numel() for p in grpo_fsdp.policy.parameters())
        total = sum(p.numel() for p in one.policy.parameters())
        assert 0.45 * total <= local <= 0.55 * total

    def test_two_rank_checkpoint_resumes_with_two_or_one_rank(self, batch, grpo_fsdp):
        inputs = batch["grpo"]
        node_op(grpo_fsdp, "load_state_dict", _fresh_grpo().state_dict())
        for _ in range(2):
            node_op(grpo_fsdp, "run", inputs)
        saved = node_op(grpo_fsdp, "state_dict")
        assert saved["version"] == saved["updates"] == 2
        assert set(saved["optimizer"]["state"]) == set(
            range(len(list(grpo_fsdp.policy.parameters())))
        )
        uninterrupted = node_op(grpo_fsdp, "run", inputs)["weights"]
        node_op(grpo_fsdp, "load_state_dict", saved)  # K=2 again, after its weights moved on
        again = node_op(grpo_fsdp, "run", inputs)["weights"]
        assert again.version == uninterrupted.version == 3
        assert _max_diff(again.weights, uninterrupted.weights) <= WEIGHT_TOL
        alone = _fresh_grpo()
        alone.load_state_dict(saved)  # K=1
        resumed = alone.run(inputs)["weights"]
        assert resumed.version == 3
        assert _max_diff(resumed.weights, uninterrupted.weights) <= WEIGHT_TOL


def test_an_fsdp_group_offloads_every_ranks_shards_and_trains_alike_after(batch, monkeypatch):
    import nodes.models.offload as off

    monkeypatch.setattr(off, "ALWAYS_COPY", True)  # every move a copy, on every rank: ptrs tell
    inputs = _rows(batch["grpo"], 2)
    one = _fresh_grpo()
    many = _fresh_grpo(ranks=2, train_backend="fsdp")
    try:
        many.setup()
        params = list(many.policy.parameters())
        for _ in range(3):
            out1, out2 = one.run(inputs), node_op(many, "run", inputs)
            local = [p.to_local().data_ptr() for p in params]
            moved = node_op(many, "offload")
            adam = sum(
                v.to_local().nbytes
                for st in many.optimizer.state.values()
                for k, v in st.items()
                if k != "step"
            )
            assert moved >= adam > 0  # the shards and their Adam state, this rank's
            assert node_op(many, "offload") == 0  # idempotent
            assert [p.to_local().data_ptr() for p in many.policy.parameters()] != local
            assert node_op(many, "reload") == moved and node_op(many, "reload") == 0
            assert list(many.policy.parameters()) == params  # the optimizer still holds them
        assert _max_diff(out1["weights"].weights, out2["weights"].weights) <= WEIGHT_TOL
        _assert_same_metrics(out1["metrics"], out2["metrics"])
        node_op(many, "offload")  # a step straight after an offload brings the state back itself
        out1, out2 = one.run(inputs), node_op(many, "run", inputs)
        assert _max_diff(out1["weights"].weights, out2["weights"].weights) <= WEIGHT_TOL
    finally:
        many.close()
    assert [p.returncode for p in many.trainer.group.procs] == [0]  # rank 1 ran every move cleanly


def test_grpo_ddp_with_uneven_shares_equals_one_rank(batch):
    """3 prompts over 2 ranks in micro-batches of one prompt: rank 1 runs a filler."""
    inputs = _rows(batch["grpo"], 3)
    one = _fresh_grpo(micro_batch_size=4)
    many = _fresh_grpo(micro_batch_size=4, ranks=2, train_backend="ddp")
    _trains_alike(one, many, inputs, calls=3)
    assert [p.returncode for p in many.trainer.group.procs] == [0]  # closed cleanly, none left


def test_ppo_fsdp_two_ranks_equal_one_rank(batch):
    one = PPOUpdate(lr=1e-3, epochs=2)
    many = _grouped(PPOUpdate(lr=1e-3, epochs=2, ranks=2))
    _trains_alike(one, many, batch["ppo"], calls=3, ports=("weights", "critic_weights"))


def test_hf_vlm_with_images_on_two_ranks_equals_one_rank():
    """Images (one per prompt) reach the ranks as uint8 arrays plus their mode."""
    from PIL import Image

    images = [Image.new("RGB", (32, 32), (255, 0, 0)), Image.new("RGB", (24, 40), (0, 0, 255))]
    out = Rollout(policy="tiny-qwen2-vl", n=2, max_new_tokens=6, seed=0).run(
        prompts=PROMPTS[:2], images=images
    )
    ports = {k: out[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
    scores = torch.tensor([1.0, -1.0] * (out["response_ids"].shape[0] // 2))  # (B,)
    adv = broadcast_to_tokens(scores, out["response_mask"])  # (B, R)
    inputs = {**ports, "logprobs": out["logprobs"], "advantages": adv, "images": images}
    one = GRPOUpdate(policy="tiny-qwen2-vl", lr=1e-3)
    many = _grouped(GRPOUpdate(policy="tiny-qwen2-vl", lr=1e-3, ranks=2))
    _trains_alike(one, many, inputs, calls=2)


# --- supervision ------------------------------------------------------------------------------


def test_a_killed_rank_is_named_not_a_hang(batch):
    node = _fresh_grpo(ranks=2)
    node.setup()
    proc = node.trainer.group.procs[0]
    try:
        os.kill(proc.pid, signal.SIGKILL)  # no wait: found by the poll or by the collective
        pattern = rf"node 'grpo_update': rank 1 \(pid {proc.pid}\) was killed by SIGKILL \(9\)"
        with pytest.raises(RankError, match=pattern):
            node_op(node, "run", batch["grpo"])
        with pytest.raises(RankError, match=pattern):  # broken from then on, at once
            node_op(node, "run", batch["grpo"])
        assert _rank_processes() == []  # the group was ended with the error
        with pytest.raises(RankError, match=pattern):
            node_op(node, "state_dict")
    finally:
        node.close()


HUNG_TIMEOUT_S = 30.0


@pytest.mark.parametrize("after_abort", ["raises", "returns"])
def test_a_rank_that_dies_under_a_hung_collective_is_named_within_seconds(after_abort, monkeypatch):
    """NCCL on the CPU: a collective whose peer died neither fails nor returns until the group
    is aborted (its kernel then ends, with an error or with garbage in the tensor) or the
    collective timeout passes. The supervisor aborts the group when the rank dies, so the
    call ends in seconds as a RankError naming the rank, and the group is aborted, never
    destroyed (destroy_process_group() can wait on the dead peer too)."""
    import torch.distributed as dist

    from runtime.ranks import group as ranks

    aborted = threading.Event()
    real_abort = getattr(ranks, "_abort_collectives", lambda: None)

    def abort():
        real_abort()
        aborted.set()

    def all_reduce_like_nccl(tensor, *args, **kwargs):
        if not aborted.wait(HUNG_TIMEOUT_S):
            raise RuntimeError("Watchdog caught collective operation timeout")
        if after_abort == "raises":
            raise RuntimeError("NCCL communicator was aborted")

    destroyed = []
    node = _fresh_grpo(ranks=2, rank_timeout_s=HUNG_TIMEOUT_S)
    node.setup()
    group, proc = node.trainer.group, node.trainer.group.procs[0]
    monkeypatch.setattr(ranks, "_abort_collectives", abort, raising=False)
    monkeypatch.setattr(dist, "all_reduce", all_reduce_like_nccl)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: destroyed.append(a))
    try:
        start = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        pattern = rf"node 'grpo_update': rank 1 \(pid {proc.pid}\) was killed by SIGKILL \(9\)"
        with pytest.raises(RankError, match=pattern), group.guard("update 1"):
            group.all_sum([1.0])
        assert time.monotonic() - start < 10, "the call waited for the collective timeout"
        assert aborted.is_set()
        assert destroyed == [] and not dist.is_initialized()  # aborted: a new group may form
        assert _rank_processes() == []
    finally:
        node.close()


def test_a_group_on_cuda_forms_bound_to_its_gpu(monkeypatch):
    """init_process_group(device_id=...) on CUDA: NCCL makes its communicator on the rank's
    GPU when the group forms; gloo on the CPU takes none."""
    import torch.distributed as dist

    from runtime.ranks.group import Ranks

    seen = []
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend, **kw: seen.append((backend, kw))
    )
    for device in (torch.device("cuda", 1), torch.device("cpu")):
        link = Ranks("rank 1", 2, device, 5.0)
        link.rank, link.store = 1, dist.HashStore()
        link._init_group()
    (nccl, on_gpu), (gloo, on_cpu) = seen
    assert (nccl, on_gpu["device_id"]) == ("nccl", torch.device("cuda", 1))
    assert (gloo, on_cpu["device_id"]) == ("gloo", None)


def test_a_rank_leaving_after_a_fault_aborts_its_group(monkeypatch):
    """A rank that failed (or whose peer did) aborts its group instead of destroying it,
    which could wait on the peer; a clean close destroys it."""
    import torch.distributed as dist

    from runtime.ranks.group import leave_group

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(
        dist.distributed_c10d, "_abort_process_group", lambda: calls.append("abort")
    )
    leave_group(clean=False)
    leave_group(clean=True)
    assert calls == ["abort", "destroy"]


def _rank_processes() -> list[int]:
    """Pids of live rank processes started by this process."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        mine = f"--parent-pid\0{os.getpid()}".encode() in b"\0".join(cmd)
        if b"runtime.ranks.worker" in cmd and mine and _state_of(int(entry.name)) != "Z":
            pids.append(int(entry.name))
    return pids


def test_a_build_that_fails_leaves_no_rank_behind():
    from runtime.ranks import group as ranks

    node = _fresh_grpo(ranks=2, policy={"name": "tiny-prefix-vlm", "n_head": 5})
    with pytest.raises(ValueError, match="divisible by num_heads"):
        node.setup()
    assert not node.is_set_up and ranks._current == []
    assert _rank_processes() == []


def _state_of(pid: int) -> str | None:
    """The process's state letter (Z: exited, not yet reaped), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def test_ranks_exit_when_rank_zero_exits():
    script = textwrap.dedent(
        """
        import os, sys, torch
        torch.set_num_threads(1)
        from nodes.update import GRPOUpdate
        from runtime.ranks.group import start_groups
        node = GRPOUpdate(ranks=2)
        start_groups({"update": node})
        node.setup()
        print(node.trainer.group.procs[0].pid, flush=True)
        os._exit(0)  # as a controller exits: no close(), no atexit
        """
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=240
    )
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 60  # the watchdog looks every 0.2 s; generous on a busy box
    while _state_of(pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _state_of(pid) in (None, "Z"), f"rank 1 (pid {pid}) outlived rank 0"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_a_policy_trained_as_a_rank_group_exports_and_loads(backend, tmp_path):
    """The export saves a one-process copy loaded with the gathered state: with FSDP2 the
    policy's own save_pretrained would wait for a collective the other rank never joins."""
    from nodes.models.policy import load_policy
    from runtime.cli import main
    from runtime.train.checkpoint import load_checkpoint

    out, target = tmp_path / "run", tmp_path / "policy"
    assert main([
        "run", "graphs.mm_grpo", "--steps", "2", "--set", "batch_size=4", "--quiet",
        "--train-ranks", "2", "--set", f"train_backend={backend}", "--threads", "1",
        "--out", str(out), "--checkpoint-every", "2", "--export", str(target),
    ]) == 0  # fmt: skip
    _, state = load_checkpoint(out / "checkpoints" / "step_000002")
    trained = state["nodes"]["grpo"]["policy"]
    exported = load_policy(str(target)).state_dict()
    assert _max_diff(trained, exported) == 0.0
    assert _rank_processes() == []


@pytest.mark.timeout(300)
def test_a_run_on_controllers_with_a_rank_group_ends_cleanly(tmp_path):
    """The controller ends its node's ranks before it leaves: rank 1 read its commands from a
    store the controller owned, and printed a C++ stack dump when it vanished."""
    yatt = Path(sys.executable).with_name("yatt-graph")
    cmd = [
        str(yatt), "run", "graphs.mm_grpo", "--steps", "2", "--set", "batch_size=4", "--quiet",
        "--controllers", "2", "--train-ranks", "2", "--out", str(tmp_path / "run"),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    for noise in ("frame #", "Traceback", "Broken pipe", "Connection reset", "[W"):
        assert noise not in done.stderr, done.stderr
    assert _rank_processes() == []


def test_hsdp_shards_within_each_host_and_replicates_across_them(batch, monkeypatch):
    """Hybrid sharding on a 2 x 2 mesh: ranks 0-1 on one host and 2-3 on another (two loopback
    addresses), each host's pair sharding the state and the hosts holding replicas; it trains
    as one rank does, and each rank holds half of each block's parameters (not a quarter)."""
    import datetime

    import torch.distributed as dist

    from runtime.ranks.placement import HostPlacement

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore(
        "127.0.0.1", 0, 4, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    hosts = ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]
    placement = HostPlacement(f"127.0.0.1:{store.port}", [0] * 4, hosts, [0, 1, 0, 1], 120.0)
    inputs = _rows(batch["grpo"], 2)
    one = _fresh_grpo()
    many = GRPOUpdate(lr=1e-3, epochs=2, ranks=4, train_backend="hsdp", rank_timeout_s=120.0)
    start_groups({many.name: many}, {many.name: placement})
    many.setup()
    local = sum(p.to_local().numel() for p in many.policy.parameters())
    total = sum(p.numel() for p in one.policy.parameters())
    assert 0.45 * total <= local <= 0.55 * total
    _trains_alike(one, many, inputs, calls=2)


def test_hsdp_needs_as_many_ranks_on_every_host():
    from runtime.ranks.sharding import hybrid_shape

    assert hybrid_shape(["a", "a", "b", "b"]) == (2, 2)
    with pytest.raises(ValueError, match="every host needs as many ranks"):
        hybrid_shape(["a", "a", "a", "b"])


@pytest.mark.timeout(180)
def test_the_sharding_bench_measures_half_of_the_state_on_each_of_two_ranks():
    """``bench.train_ranks``' measuring process for one configuration (2 FSDP2 ranks, a
    1-block policy): it drives the group as the runtime does, and rank 0's parameters,
    gradients and Adam moments are each about half of the whole model's."""
    cmd = [sys.executable, "-m", "bench.train_ranks", "--child", "--layers", "1", "--calls", "1"]
    cmd += ["--batch", "8", "--ranks", "2", "--backend", "fsdp"]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    whole = got["params"] * 4  # float32
    assert 0.45 * whole <= got["param_bytes"] <= 0.55 * whole, got
    assert got["grad_bytes"] == got["param_bytes"] and got["adam_bytes"] == 2 * got["param_bytes"]
    assert got["publish_s"] > 0 and math.isfinite(got["loss"])
