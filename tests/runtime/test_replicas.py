"""Replicas: a node's calls cut across copies (runtime/sched/fanout.py), replica processes
(runtime/zmq/replicas.py), and the rollout's pieces (nodes/rollout.py begin_piece).

What is exact and why: the cut changes only which rows a call holds, so nodes with no
randomness give the whole call's values (here bitwise: one torch thread, tiny models). The
rollout seeds each piece from the step and its first row, so its *sampled* tokens differ from
a one-copy run, but a piece samples the same tokens on any replica (checked bitwise), and its
greedy tokens equal the one-copy run's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading

import pytest
import torch

from nodes.rollout import Rollout
from nodes.sync import WeightUpdate
from runtime.sched.fanout import Crew, Fanout, NodeThread, replica_counts
from runtime.zmq.replicas import ReplicaDied, spawn_replica
from yatt_graph import BatchPolicy, Node, Tensor

PROMPTS = [f"prompt {'x' * (i % 5)} {i}" for i in range(10)]


class Twice(Node):
    """Two output rows per input row (like a rollout with n=2), ``rows`` tagged by input."""

    inputs = {"x": Tensor("float32", "N")}  # noqa: RUF012
    outputs = {"y": Tensor("float32", "B"), "tag": Tensor("int64", "B")}  # noqa: RUF012
    batch_policy = BatchPolicy(max_batch_size=64)

    def forward(self, x):
        y = torch.stack([x, x + 0.5], 1).reshape(-1)
        return {"y": y, "tag": torch.arange(len(y)) // 2}


class Taking:
    """An in-process replica over its own copy of a node. The copies take turns (one lock):
    HF sampling draws from the process's global generator, which is why a process holds one
    local replica and the others are processes. Which copy takes which piece still varies."""

    lock = threading.Lock()

    def __init__(self, node, label):
        self.node, self.inner, self.label = node, NodeThread(label), label

    def call(self, _node, inputs, context, rows):
        with self.lock:
            return self.inner.call(self.node, inputs, context, rows)

    def close(self):
        pass


def replica_set(node, workers, per):
    """The fan-out a run makes for a node with replicas, over the given workers."""
    return Fanout(node, Crew(workers), "replicas", per)


@pytest.mark.parametrize("seed", range(8))
def test_every_sample_comes_back_once_in_order(seed):
    rng = random.Random(seed)
    size, copies, per = rng.randint(1, 40), rng.randint(1, 4), rng.randint(1, 3)
    node = Twice()
    x = torch.tensor([rng.random() for _ in range(size)])
    rs = replica_set(node, [Taking(node, f"r{i}") for i in range(copies)], per)
    try:
        out = rs.call({"x": x})
    finally:
        rs.crew.close()
    whole = node.run({"x": x})
    assert torch.equal(out["y"], whole["y"])  # every row once, in the batch's order
    pieces = sum(r["pieces"] for r in rs.crew.stats.values())
    assert pieces == min(size, copies * per)
    assert sum(r["samples"] for r in rs.crew.stats.values()) == size


def _rollout(**kw):
    return Rollout(policy="tiny-prefix-vlm", n=2, max_new_tokens=6, seed=3, **kw)


def _embeds(n=10):
    return torch.randn(n, 32, generator=torch.Generator().manual_seed(1))


def _call(rs, embeds):
    return rs.call({"prompts": PROMPTS, "image_embeds": embeds, "weights": None})


def test_greedy_pieces_equal_the_whole_call_and_groups_are_the_steps():
    embeds = _embeds()
    whole = _rollout(temperature=0.0).run({"prompts": PROMPTS, "image_embeds": embeds})
    node = _rollout(temperature=0.0)
    rs = replica_set(node, [Taking(node, "a"), Taking(_rollout(temperature=0.0), "b")], 2)
    try:
        out = _call(rs, embeds)
        second = _call(rs, embeds)
    finally:
        rs.crew.close()
    m = whole["response_mask"].bool()
    assert torch.equal(out["response_mask"][:, : m.shape[1]].bool(), m)
    assert torch.equal(out["response_ids"][:, : m.shape[1]][m], whole["response_ids"][m])
    assert out["texts"] == whole["texts"]
    assert torch.equal(out["group_ids"], whole["group_ids"])
    # the node's counters moved once per step: the next step's groups follow on
    assert torch.equal(second["group_ids"], whole["group_ids"] + len(PROMPTS))
    assert node.step == 2 and node.next_group == 2 * len(PROMPTS)


def test_a_sampled_piece_gives_the_same_tokens_on_any_replica():
    embeds = _embeds()
    outs = []
    for order in (0, 1):
        a, b = _rollout(), _rollout()
        copies = [Taking(a, "a"), Taking(b, "b")]
        rs = replica_set(a, copies if order == 0 else copies[::-1], 3)
        try:
            outs.append(_call(rs, embeds))
        finally:
            rs.crew.close()
    for port in ("response_ids", "logprobs", "group_ids", "prompt_ids"):
        assert torch.equal(outs[0][port], outs[1][port]), port


def test_replica_counts_refuse_what_cannot_be_copied():
    from nodes.update import GRPOUpdate

    nodes = {"rollout": _rollout(), "grpo": GRPOUpdate(policy="tiny-prefix-vlm")}
    assert replica_counts(nodes, {"rollout": 2}) == {"rollout": 2}
    with pytest.raises(ValueError, match="'grpo' cannot have 2 replicas"):
        replica_counts(nodes, {"grpo": 2})
    with pytest.raises(ValueError, match="no node 'nope' in the graph"):
        replica_counts(nodes, {"nope": 2})
    streamed = {"rollout": _rollout(stream=True)}
    with pytest.raises(ValueError, match="streams"):
        replica_counts(streamed, {"rollout": 2})


@pytest.mark.timeout(300)
def test_a_replica_process_samples_what_a_local_replica_samples():
    embeds = _embeds()
    local_node = _rollout()
    rs_local = replica_set(local_node, [NodeThread("local", threads=1)], 2)  # the same 2 pieces
    node = _rollout()
    proc = spawn_replica(node, 1, 2)
    rs = replica_set(node, [NodeThread("local", threads=1), proc], 1)
    try:
        expected = _call(rs_local, embeds)
        got = _call(rs, embeds)
        assert rs.crew.stats[proc.label]["pieces"] == 1  # the process ran one of the two pieces
    finally:
        rs.crew.close()
        rs_local.crew.close()
    for port in ("response_ids", "response_mask", "logprobs", "group_ids"):
        assert torch.equal(got[port], expected[port]), port


@pytest.mark.timeout(300)
def test_weights_reach_a_replica_process_once_per_version():
    node = _rollout()
    proc = spawn_replica(node, 1, 2)
    try:
        weights = {k: v + 0.01 for k, v in node.policy.state_dict().items()}
        update = WeightUpdate(weights, version=1)
        assert proc._once_per_version({"weights": update})["weights"] is update
        assert proc._once_per_version({"weights": update})["weights"] is None
        again = WeightUpdate(weights, version=1)
        assert proc._once_per_version({"weights": again})["weights"] is None
        newer = WeightUpdate(weights, version=2)
        assert proc._once_per_version({"weights": newer})["weights"] is newer
    finally:
        proc.close()


@pytest.mark.timeout(300)
def test_a_dead_replica_process_is_named():
    node = _rollout()
    proc = spawn_replica(node, 1, 2)
    rs = replica_set(node, [proc], 1)  # the process alone, so the call must wait on it
    try:
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(
            ReplicaDied,
            match=rf"replica 1 of node 'rollout' \(pid {proc.pid}\) was killed by SIGKILL",
        ):
            _call(rs, _embeds())
    finally:
        rs.crew.close()


class Lost:
    """A worker whose process is lost at its ``at``-th piece."""

    def __init__(self, label, at):
        self.label, self.at, self.calls = label, at, 0

    def call(self, node, inputs, context, rows):
        self.calls += 1
        if self.calls >= self.at:
            raise ReplicaDied(f"{self.label} exited with code 17")
        return node.run(inputs)

    def close(self):
        pass


def test_a_lost_replica_leaves_and_its_pieces_go_to_the_other_copies(capsys):
    node = Twice()
    x = torch.arange(12, dtype=torch.float32)
    want = node.run({"x": x})
    lost = Lost("process 1 (pid 7)", at=2)
    fanout = replica_set(node, [NodeThread("local"), lost], 3)  # 6 pieces
    for _ in range(3):  # the loss in the first or second call; the later calls go on
        assert torch.equal(fanout.call({"x": x})["y"], want["y"])
    assert fanout.summary()["lost"] == {lost.label: f"{lost.label} exited with code 17"}
    assert fanout.crew.stats[lost.label]["pieces"] == 1  # one piece, then it left
    err = capsys.readouterr().err
    assert err.count("exited with code 17") == 1 and "the node's 1 other copy" in err
    fanout.crew.close()


def test_when_every_copy_is_lost_the_call_fails_with_the_loss_and_nothing_hangs():
    node = Twice()
    fanout = replica_set(node, [Lost("process 1 (pid 7)", 1), Lost("process 2 (pid 8)", 1)], 4)
    with pytest.raises(ReplicaDied, match=r"process \d \(pid \d\) exited with code 17"):
        fanout.call({"x": torch.arange(8, dtype=torch.float32)})
    with pytest.raises(ReplicaDied):  # a later call fails at once
        fanout.call({"x": torch.arange(8, dtype=torch.float32)})
    fanout.crew.close()


def test_a_process_fault_of_the_nodes_own_copy_is_the_calls_error():
    """A fault the node itself raises (not its worker's process) fails the call."""

    class Faulty(Twice):
        def forward(self, x):
            raise ReplicaDied("a child process of the node died")

    fanout = replica_set(Faulty(), [NodeThread("local")], 2)
    with pytest.raises(ReplicaDied, match="a child process of the node died"):
        fanout.call({"x": torch.arange(4, dtype=torch.float32)})
    assert not fanout.crew.lost
    fanout.crew.close()


# --- through `yatt-graph run` -------------------------------------------------------------------
GRPO = ["run", "graphs/mm_grpo.py", "--set", "batch_size=4", "--seed", "0", "--quiet"]


def _scores(out):
    return [json.loads(line)["scores/mean"] for line in (out / "metrics.jsonl").open()]


@pytest.mark.timeout(600)
def test_a_run_with_rollout_replicas_is_the_same_in_process_and_on_controllers(
    tmp_path, monkeypatch, capsys
):
    """The in-process run loses its replica process at its first piece: the replica is named,
    its pieces go to the node's own copy, and the run goes on to the same scores, bitwise, as
    the run on controllers that lost nothing (a piece samples alike on any copy)."""
    from runtime.cli import main
    from runtime.zmq.replica_main import FAULT_ENV

    local, zmq_run = tmp_path / "local", tmp_path / "zmq"
    # The same thread count on both sides: colocated on-policy controllers compute on every
    # core, one thread each (thread counts change the last bits; adaptive is off so that no
    # re-balance changes them part-way).
    threads = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    # The replica exits at its first piece (once: the file says it happened). Which pieces it
    # takes depends on timing, but in the first step both copies wait for one of two pieces.
    monkeypatch.setenv(FAULT_ENV, f"{tmp_path / 'died'}:1")
    flags = ["--replicas", "rollout=2", "--restart", "on-failure", "--checkpoint-every", "2"]
    try:
        assert main([*GRPO, "--steps", "4", *flags, "--out", str(local)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / "died").exists()
    err = capsys.readouterr().err
    assert "replica 1 of node 'rollout'" in err and "exited with code 17" in err, err[-3000:]
    assert "its pieces go to the node's 1 other copy" in err
    assert "restarting the run" not in err
    steps = [json.loads(line)["step"] for line in (local / "metrics.jsonl").open()]
    assert steps == list(range(4))
    flags = ["--controllers", "2", "--no-adaptive", "--replicas", "rollout=2"]
    assert main([*GRPO, "--steps", "4", *flags, "--out", str(zmq_run)]) == 0
    assert _scores(local) == _scores(zmq_run)  # the same pieces, seeds and weights: bitwise
