"""The memory plan: model sizes read without loading, what each model node says it holds, one
count per shared module, the token budget bounding an update, and the plan through the CLI.
How close the formulas come to measured peaks is a benchmark (bench/memory_plan.py)."""

from __future__ import annotations

import json
import re

import pytest

from nodes.memory import Load, model_size, prompt_tokens
from nodes.memory_plan import MemoryPlan, plan_memory
from nodes.models.hf_causal import tiny_causal_lm
from nodes.models.policy import build_policy
from nodes.update import GRPOUpdate, PPOUpdate
from runtime.cli import main
from yatt_graph.refs import load_graph

LOAD = Load(prompts=16, responses=64, prompt_tokens=24, response_tokens=32)


@pytest.fixture(scope="module")
def saved_lm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm")
    tiny_causal_lm().save_pretrained(folder)
    return folder


def test_a_checkpoints_size_is_read_from_its_headers_and_config(saved_lm):
    policy = build_policy({"path": str(saved_lm)})
    config = json.loads((saved_lm / "config.json").read_text())
    size = model_size({"path": str(saved_lm)})
    assert size.params == sum(p.numel() for p in policy.parameters())
    layers = config.get("num_hidden_layers", config.get("n_layer"))  # Llama's name, GPT-2's
    assert (size.layers, size.vocab) == (layers, config["vocab_size"]) and layers > 0
    assert size.trainable == size.params and size.bytes_per_param == 4
    assert model_size({"path": str(saved_lm), "dtype": "bfloat16"}).bytes_per_param == 2
    lora = model_size({"path": str(saved_lm), "lora": {"r": 4}})
    assert 0 < lora.trainable < lora.params
    built = model_size("tiny-qwen2")  # a tiny model is built and counted
    assert built.params == sum(p.numel() for p in build_policy("tiny-qwen2").parameters())


def test_a_saved_models_prompts_are_as_long_as_its_policy_encodes_them(saved_lm):
    prompts = ["what color is the square", "how many"]
    policy = build_policy({"path": str(saved_lm)})
    expected = policy.encode_prompts(prompts).prompt_ids.shape[1]
    assert prompt_tokens({"path": str(saved_lm)}, prompts) == expected


def test_a_token_budget_bounds_the_updates_activations(saved_lm):
    spec = {"path": str(saved_lm)}
    big = Load(prompts=64, responses=256, prompt_tokens=24, response_tokens=32)
    budget = [GRPOUpdate(policy=spec, micro_batch_tokens=1024).memory(x) for x in (LOAD, big)]
    assert budget[0] == budget[1]  # the same micro-batch whatever the batch
    whole = [GRPOUpdate(policy=spec).memory(x)["activations"] for x in (LOAD, big)]
    assert whole[1] == 4 * whole[0] > 4 * budget[0]["activations"]
    minis = GRPOUpdate(policy=spec, mini_batches=4).memory(big)["activations"]
    assert minis == whole[0]  # a quarter of the batch a step
    held = budget[0]
    size = model_size(spec)
    assert held["optimizer"] == 8 * size.params and held["gradients"] == 4 * size.params
    # published as a snapshot; with a share key consumers read the live tensors
    assert held["snapshots"] == 8 * size.params
    assert GRPOUpdate(policy=spec, share="policy").memory(LOAD)["snapshots"] == 4 * size.params
    ppo = PPOUpdate(policy=spec, critic=spec, critic_share="critic").memory(LOAD)
    assert ppo["optimizer"] == 2 * held["optimizer"]  # two models trained
    assert ppo["weights@critic"] == 4 * size.params


def test_one_module_of_a_share_key_counts_once_and_a_plan_says_what_will_not_fit():
    graph = load_graph("graphs.text_grpo", batch_size=4)
    plan = plan_memory(graph, LOAD)
    rows = {name: parts for name, _, _, parts in plan.rows}
    size = model_size(graph.nodes["rollout"].policy_spec).params * 4
    assert rows["rollout"]["weights"] == size  # the policy, counted at its first node
    assert rows["reference"]["weights"] == size  # a frozen copy of its own
    assert "weights" not in rows["grpo"]  # the rollout's module, trained in place
    assert rows["rollout"]["kv_cache"] > 0 and rows["grpo"]["optimizer"] > 0
    assert "reward" not in rows and plan.fits()
    ((held, work, who),) = plan.peaks().values()
    assert plan.device_totals()["cpu"] == plan.runtime + held + work
    assert who == max(rows, key=lambda n: sum(v for k, v in rows[n].items() if k not in
                                              ("weights", "optimizer", "snapshots")))  # fmt: skip
    small = MemoryPlan(plan.load, plan.rows, runtime=plan.runtime, room={"cpu": plan.runtime})
    assert not small.fits()
    assert any("WILL NOT FIT" in line for line in small.lines())  # (a config says what to do)
    # two controllers: a module per process, and each process has its runtime
    split = plan_memory(graph, LOAD, {"rollout": "0", "reference": "1", "grpo": "1"})
    rows = {name: parts for name, _, _, parts in split.rows}
    assert rows["grpo"]["weights"] == size and split.processes == 3


@pytest.mark.timeout(300)
def test_show_memory_prints_the_plan_and_a_run_prints_its_device_lines(tmp_path, capsys):
    assert main(["show", "mm_ppo", "--memory", "--set", "batch_size=4"]) == 0
    out = capsys.readouterr().out
    assert "memory plan (estimates) for a step of 4 responses" in out
    for node in ("vision", "rollout", "reference", "critic", "ppo"):
        assert f"\n  {node} " in out
    assert "cpu: " in out and "fits in" in out
    assert main(["show", "graphs.toy", "--memory"]) == 2
    assert "does not plan its memory" in capsys.readouterr().err
    argv = ["run", "text_grpo", "--steps", "1", "--quiet", "--out", str(tmp_path / "run")]
    assert main([*argv, "--set", "batch_size=2"]) == 0
    assert "yatt-graph run: memory plan: cpu: " in capsys.readouterr().err


def test_a_reward_model_and_a_judge_say_what_they_hold():
    from nodes.rewards.judge import JudgeReward
    from nodes.rewards.models import RewardModel

    config = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32}
    small, large = (RewardModel(config=config, micro_batch_size=n) for n in (4, 16))
    held = small.memory(LOAD)
    assert held["weights@"] == 4 * sum(p.numel() for p in small.model.parameters())
    assert 0 < held["activations"] < large.memory(LOAD)["activations"]  # rows at a time
    judge = JudgeReward("tiny", max_batch=8)
    assert judge.memory(LOAD)["weights@"] == 4 * sum(p.numel() for p in judge.model.parameters())
    graph = load_graph("graphs.text_grpo", batch_size=2, reward="judge:tiny")
    assert "reward" in {name for name, _, _, _ in plan_memory(graph, LOAD).rows}


def test_a_rank_group_is_planned_as_its_processes_each_with_a_shard(saved_lm):
    spec = {"path": str(saved_lm)}
    alone = GRPOUpdate(policy=spec, share="policy").memory(LOAD)
    group = GRPOUpdate(policy=spec, share="policy", ranks=2).memory(LOAD)
    size = model_size(spec).params * 4
    assert "weights" in alone and "weights@" not in alone  # the rollout's module, shared
    assert group["weights@"] == size // 2 and group["optimizer"] == alone["optimizer"] // 2
    assert group["snapshots"] > alone["snapshots"]  # rank 0 gathers what it publishes

    class Graph:
        nodes = {"grpo": GRPOUpdate(policy=spec, ranks=2)}  # noqa: RUF012

    plan = plan_memory(Graph(), LOAD)
    assert [row[0] for row in plan.rows] == ["grpo", "grpo rank 1"] and plan.processes == 2


def test_replicas_and_copies_on_other_hosts_are_planned_where_they_run():
    """Each replica holds the node's weights and its share of the step; a copy on another
    host counts on that host's device, and each host's processes on its own memory."""
    from nodes.memory_plan import Copy

    graph = load_graph("graphs.text_grpo", batch_size=4, train_ranks=2)
    processes = {"data": "0", "rollout": "0", "reward": "0", "reference": "1",
                 "group_advantage": "1", "grpo": "1", "sample_stats": "1"}  # fmt: skip
    copies = {"rollout": [Copy("host 0", 0), Copy("host 1", 0)],
              "grpo": [Copy("host 1", 0), Copy("host 0", 0)]}  # fmt: skip
    hosts = {"0": "host 0", "1": "host 1"}
    plan = plan_memory(graph, LOAD, processes, copies=copies, hosts=hosts)
    rows = {name: (process, device, parts) for name, process, device, parts in plan.rows}
    whole = plan_memory(graph, LOAD, processes)
    alone = {name: parts for name, _, _, parts in whole.rows}["rollout"]
    assert rows["rollout"][:2] == ("0", "host 0 cpu")
    assert rows["rollout replica 1"][:2] == ("0/r1", "host 1 cpu")
    assert rows["rollout replica 1"][2]["weights"] == alone["weights"]  # a whole copy each
    assert 0 < rows["rollout"][2]["kv_cache"] < alone["kv_cache"]  # of half the step
    assert rows["grpo rank 1"][:2] == ("1/1", "host 0 cpu")
    # host 0: controller 0, the driver and rank 1; host 1: controller 1 and the replica
    assert plan.per_host == {"host 0": 3, "host 1": 2} and plan.processes == 5
    totals = plan.device_totals()
    assert set(totals) == {"host 0 cpu", "host 1 cpu"}
    lines = "\n".join(plan.device_lines())
    assert "host 0 cpu: " in lines and " each of 3 processes" in lines


def test_show_memory_takes_the_runs_layout_flags_and_refuses_them_alone(tmp_path):
    from cli_helpers import yatt_here

    argv = ["show", "text_grpo", "--set", "batch_size=4"]
    shown = yatt_here(tmp_path, *argv, "--memory", "--controllers", "2", "--nnodes", "2",
                      "--replicas", "rollout=2", "--replicas-per-host", "1")  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    # the rollout on controller 1, on host 1; its other copy on the next host
    assert re.search(r"\n  rollout +1 +host 1 cpu", shown.stdout), shown.stdout
    assert re.search(r"\n  rollout replica 1 +1/r1 +host 0 cpu", shown.stdout), shown.stdout
    for flags, said in [
        (["--replicas", "rollout=2"], "--replicas place the copies of the memory plan; add --memory"),
        (["--memory", "--ranks-per-host", "2"], "--ranks-per-host 2 spreads the ranks of --train-ranks over the hosts of a run across hosts"),
        (["--memory", "--replicas", "nothing=2"], "--replicas: no node 'nothing' in the graph"),
        (["--memory", "--nnodes", "3"], "--controllers 1 on 3 nodes leaves node(s) [1, 2]"),
    ]:  # fmt: skip
        done = yatt_here(tmp_path, *argv, *flags)
        assert done.returncode == 2 and said in done.stderr, (flags, done.stderr)


def test_hybrid_sharding_over_hosts_holds_a_hosts_share_a_rank():
    """hsdp shards within each host: 2 hosts x 2 ranks hold 1/2 of the state a rank, fsdp
    1/4; on one host the two are alike."""
    group = [("host 0", 0), ("host 0", 1), ("host 1", 0), ("host 1", 1)]
    spots = {"grpo": group, "reference": group}  # the reference on the update's ranks
    hosts = {"0": "host 0", "1": "host 1"}
    processes = dict.fromkeys(("data", "rollout", "reward", "reference", "group_advantage"), "0")
    processes |= {"grpo": "1", "sample_stats": "1"}

    def rank_parts(backend, copies=spots):
        graph = load_graph("graphs.text_grpo", batch_size=4, train_ranks=4,
                           train_backend=backend, shard_reference=True)  # fmt: skip
        plan = plan_memory(graph, LOAD, processes, copies=copies, hosts=hosts)
        rows = {name: parts for name, _, _, parts in plan.rows}
        return rows["grpo rank 3"], rows["reference rank 3"]

    (fsdp, ref_fsdp), (hsdp, ref_hsdp) = rank_parts("fsdp"), rank_parts("hsdp")
    for part in ("weights", "optimizer", "gradients"):
        assert hsdp[part] == pytest.approx(2 * fsdp[part], rel=0.01), part
    assert ref_hsdp["weights"] == pytest.approx(2 * ref_fsdp["weights"], rel=0.01)
    here = dict.fromkeys(("grpo", "reference"), [("host 0", r) for r in range(4)])
    assert rank_parts("hsdp", here) == rank_parts("fsdp", here)
