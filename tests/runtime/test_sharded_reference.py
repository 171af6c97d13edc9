"""A reference sharded over a rank group (nodes/models/ranked.py, runtime/ranks/): alone or
beside the update whose ranks it joins, it scores as one whole copy does; a critic beside its
PPO update scores with the value model the update trains on those ranks; the plan puts them on
the update's controller, and the memory plan counts 1/K of the reference a rank and none of
the critic's weights. A run that sets
``shard_reference`` on the real model is in tests/test_real_model.py.

Tolerances: a part scored by one rank is the same forward as in one process (same rows, same
padding), so with a token budget the logprobs are equal bitwise; with the whole batch in one
forward (budget 0) each rank's share is a smaller batch, whose padding differs, and the
logprobs were observed within 5e-7 of the whole batch's. The tests allow 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch
from cli_helpers import yatt, yatt_here
from policy_helpers import sampled_batch

from nodes.memory import Load
from nodes.memory_plan import plan_memory
from nodes.reference import ReferenceLogprobs
from nodes.update import GRPOUpdate
from runtime.engine.calls import node_op
from runtime.ranks.group import start_groups
from runtime.train.metrics import read_metrics
from yatt_graph.refs import load_graph

PROMPTS = ["hi", "what colour is it?", "x", "name the shape", "a b c"]
TOL = 1e-5
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def batch():
    """20 responses (5 prompts x 4), image embeddings one row per prompt: 5 units on 2 ranks."""
    out, ports, embeds, adv = sampled_batch(PROMPTS)
    train = {**ports, "logprobs": out["logprobs"], "advantages": adv, "image_embeds": embeds}
    return {"ref": {**ports, "image_embeds": embeds}, "train": train}


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("budget", [0, 40])
def test_a_reference_sharded_over_two_ranks_scores_as_one_copy(batch, budget):
    """Alone (a group of its own). With a budget of 40 tokens the 5 units make parts that
    the ranks hold unevenly, so one rank runs filler forwards."""
    want = ReferenceLogprobs(micro_batch_tokens=budget).run(batch["ref"])["ref_logprobs"]
    many = ReferenceLogprobs(micro_batch_tokens=budget, ranks=2)
    start_groups({many.name: many})
    try:
        many.setup()
        got = node_op(many, "run", batch["ref"])["ref_logprobs"]
        again = node_op(many, "run", batch["ref"])["ref_logprobs"]
    finally:
        many.rank_group.close()
    assert got.shape == want.shape
    assert _diff(got, want) <= TOL
    if budget:
        assert torch.equal(got, want)  # the same parts' forwards
    assert torch.equal(got, again)
    assert [p.returncode for p in many.rank_group.procs] == [0]


def test_a_reference_beside_its_update_shares_the_updates_ranks(batch, monkeypatch):
    """One group for both nodes: one rank process, holding a shard of each model; calls of
    the two interleave, and the reference stays the initial policy while the update trains."""
    import nodes.models.offload as off

    monkeypatch.setattr(off, "ALWAYS_COPY", True)  # every move a copy: the bytes tell
    update = GRPOUpdate(lr=1e-3, epochs=1, ranks=2)
    reference = ReferenceLogprobs(micro_batch_tokens=40, ranks=2, rank_with=update.name)
    want = ReferenceLogprobs(micro_batch_tokens=40).run(batch["ref"])["ref_logprobs"]
    lone = GRPOUpdate(lr=1e-3, epochs=1)
    start_groups({reference.name: reference, update.name: update})
    try:
        assert reference.rank_group is update.rank_group
        assert len(update.rank_group.procs) == 1  # one process for rank 1 of both
        reference.setup()
        update.setup()
        for _ in range(2):
            got = node_op(reference, "run", batch["ref"])["ref_logprobs"]
            assert torch.equal(got, want)
            out, out1 = node_op(update, "run", batch["train"]), lone.run(batch["train"])
            weights, weights1 = out["weights"].weights, out1["weights"].weights
            assert max(_diff(weights[k], weights1[k]) for k in weights1) <= TOL
            moved = node_op(reference, "offload")
            shard = sum(p.to_local().nbytes for p in reference.policy.parameters())
            assert moved >= shard > 0  # this rank's shard of the reference, not a whole copy
            assert node_op(reference, "reload") == moved
        assert shard < sum(p.nbytes for p in lone.policy.parameters())
    finally:
        update.close()
    assert [p.returncode for p in update.rank_group.procs] == [0]  # both closed cleanly


def test_a_critic_beside_its_update_scores_with_the_value_model_it_trains(batch):
    """A PPO update's rank group holds the critic too: it reads the value model the update
    trains on every rank (no copy, no weights sent: the update publishes only a version), and
    after a step scores as a whole critic loaded with the 1-rank update's weights."""
    from nodes.reference import Critic
    from nodes.update import PPOUpdate

    ports = dict(batch["ref"])
    values0 = Critic().run(ports)["values"]
    train = {**batch["train"], "returns": batch["train"]["advantages"], "values": values0}
    update = PPOUpdate(lr=1e-3, epochs=1, ranks=2)
    critic = Critic(ranks=2, rank_with=update.name, micro_batch_tokens=40)
    lone, whole = PPOUpdate(lr=1e-3, epochs=1), Critic()
    start_groups({critic.name: critic, update.name: update})
    try:
        critic.setup()
        update.setup()
        assert _diff(node_op(critic, "run", ports)["values"], values0) <= TOL
        published = node_op(update, "run", train)["critic_weights"]
        assert (published.weights, published.complete) == ({}, False)  # a version only
        whole.run({**ports, "weights": lone.run(train)["critic_weights"]})
        want = whole.run(ports)["values"]
        got = node_op(critic, "run", {**ports, "weights": published})["values"]
        assert _diff(got, want) <= TOL < _diff(want, values0)  # it moved, as the update's did
        assert critic.weights_version == 1
        assert node_op(critic, "state_dict") == {} and node_op(critic, "offload") == 0
    finally:
        update.close()
    assert [p.returncode for p in update.rank_group.procs] == [0]  # both closed cleanly


def test_bad_rank_options_of_a_reference_are_refused():
    with pytest.raises(ValueError, match=r"ranks=0; give an int >= 1"):
        ReferenceLogprobs(ranks=0)
    with pytest.raises(ValueError, match=r"ddp would hold a whole copy"):
        ReferenceLogprobs(ranks=2, train_backend="ddp")
    with pytest.raises(ValueError, match=r"rank_with='grpo' .* needs ranks > 1"):
        ReferenceLogprobs(rank_with="grpo")
    from nodes.reference import Critic

    with pytest.raises(ValueError, match=r"a critic runs as ranks only beside the update"):
        Critic(ranks=2)
    a, b = GRPOUpdate(ranks=2), ReferenceLogprobs(ranks=3, rank_with="grpo")
    with pytest.raises(ValueError, match=r"run in one process, which holds one rank group"):
        start_groups({a.name: a, b.name: b})


def test_the_plan_puts_the_reference_on_its_updates_controller():
    graph = load_graph("graphs.text_grpo", train_ranks=2, shard_reference=True, device="cpu")
    reference = graph.nodes["reference"]
    assert (reference.ranks, reference.rank_with) == (2, "grpo")
    assert reference.config()["ranks"] == 2  # the ranks rebuild it so
    for controllers in (2, 3, 4):
        plan = graph.plan(controllers)
        assert plan.assignment["reference"] == plan.assignment["grpo"], plan.assignment
    pinned = graph.plan(3, placement={"reference": 0, "grpo": 2})
    assert pinned.assignment["reference"] == 2
    plain = load_graph("graphs.text_grpo", train_ranks=2, device="cpu").nodes["reference"]
    assert (plain.ranks, plain.rank_with) == (1, None)
    ppo = load_graph("graphs.text_ppo", train_ranks=2, shard_critic=True, device="cpu")
    assert (ppo.nodes["critic"].ranks, ppo.nodes["critic"].rank_with) == (2, "ppo")
    plan = ppo.plan(4)
    assert plan.assignment["critic"] == plan.assignment["ppo"], plan.assignment


def test_the_memory_plan_counts_a_shard_of_the_reference_a_rank():
    options = {"policy": "tiny-gpt2", "device": "cpu", "train_ranks": 2}
    load = Load(prompts=8, responses=32, prompt_tokens=16, response_tokens=16)
    whole = plan_memory(load_graph("graphs.text_grpo", **options), load)
    sharded = plan_memory(load_graph("graphs.text_grpo", shard_reference=True, **options), load)
    rows = {name: parts for name, _, _, parts in sharded.rows}
    one = {name: parts for name, _, _, parts in whole.rows}["reference"]["weights"]
    assert rows["reference"]["weights"] == rows["reference rank 1"]["weights"] == -(-one // 2)
    assert sharded.processes == whole.processes  # rank 1 of both is the update's process
    ppo = {"policy": "tiny-gpt2", "device": "cpu", "train_ranks": 2}
    beside = plan_memory(load_graph("graphs.text_ppo", shard_critic=True, **ppo), load)
    rows = {name: parts for name, _, _, parts in beside.rows}
    assert set(rows["critic rank 1"]) == {"activations"}  # the update's model: no weights


@pytest.mark.timeout(300)
def test_a_ppo_run_scoring_on_the_updates_ranks_trains_as_the_unsharded_run(tmp_path):
    """``--set shard_critic=true shard_reference=true`` as a user types it, from a folder
    outside the repository, against the same run without them (run here): the critic's
    values and the reference's logprobs reach the losses alike (2 steps: the second critic
    reads the value model one update trained). Observed equal within 1e-6; allowed 1e-4."""
    argv = ["run", "text_ppo", "--steps", "2", "--train-ranks", "2", "--set", "batch_size=4",
            "--quiet", "--threads", "1"]  # fmt: skip
    sharded = [*argv, "--set", "shard_critic=true", "--set", "shard_reference=true"]
    done = yatt(tmp_path, *sharded, "--out", "sharded", timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert yatt_here(tmp_path, *argv, "--out", "whole").returncode == 0
    got, want = read_metrics(tmp_path / "sharded"), read_metrics(tmp_path / "whole")
    assert len(got) == len(want) == 2
    for a, b in zip(got, want, strict=True):
        for key in ("loss", "vf_loss", "advantage/kl", "advantage/return_mean", "critic_grad_norm"):
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (key, a, b)


def test_show_memory_lists_the_references_rank(tmp_path):
    """As a user types it (the run itself, on the real model: tests/test_real_model.py)."""
    shown = yatt_here(tmp_path, "show", "text_grpo", "--train-ranks", "2", "--memory",
                      "--set", "shard_reference=true")  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "reference rank 1" in shown.stdout
