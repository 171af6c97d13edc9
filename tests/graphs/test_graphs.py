"""The ready graphs build, validate, survive JSON, run a step, and take models and rewards by path."""

import pytest
import torch

from runtime import LocalExecutor
from yatt_graph import BatchPolicy, Graph
from yatt_graph.refs import load_graph

GRAPHS = [
    "graphs.mm_ppo",
    "graphs.mm_grpo",
    "graphs.text_ppo",
    "graphs.text_grpo",
    "graphs.text_agent",
    "graphs.mm_agent",
    "graphs.toy",
]


@pytest.mark.parametrize("name", GRAPHS)
def test_graph_builds_round_trips_and_runs_two_steps(name):
    graph = load_graph(name, batch_size=4)
    assert Graph.from_json(graph.to_json()) == graph
    results = LocalExecutor(graph).run(2)
    scores = results[-1].outputs["scores"]
    assert scores.dtype == torch.float32 and torch.isfinite(scores).all()


def test_mm_ppo_takes_a_local_policy_and_a_reward_file(tmp_path):
    from nodes.data import task_vocabulary
    from nodes.models.policy import tiny_prefix_vlm

    saved = tmp_path / "policy"
    tiny_prefix_vlm(seed=5, words=task_vocabulary()).save_pretrained(saved)
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text("def always_half(text, meta):\n    return 0.5\n")
    graph = load_graph(
        "graphs.mm_ppo", batch_size=4, policy=str(saved), reward=f"{rewards}:always_half"
    )
    assert graph.nodes["rollout"].config()["policy"] == {"path": str(saved)}
    result = LocalExecutor(graph).step()
    assert torch.equal(result.outputs["scores"], torch.full((4,), 0.5))


def test_bad_model_options_are_refused_clearly(tmp_path):
    with pytest.raises(
        ValueError,
        match="neither 'tiny', one of tiny-gpt2, tiny-llama, tiny-qwen2, nor a local model directory",
    ):
        load_graph("graphs.mm_ppo", policy=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="use 'tiny' or 'open_clip:NAME"):
        load_graph("graphs.mm_ppo", vision="clip-ish")


def test_on_bad_sample_skip_scores_bad_samples_zero_and_counts_them(tmp_path):
    rewards = tmp_path / "flaky.py"
    rewards.write_text(
        "def nan_for_odd(text, meta):\n    return float('nan') if meta['index'] % 2 else 1.0\n"
    )
    ref = f"{rewards}:nan_for_odd"
    result = LocalExecutor(
        load_graph("graphs.text_ppo", batch_size=4, reward=ref, on_bad_sample="skip")
    ).step()
    assert result.outputs["scores"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert result.outputs["bad_samples"].tolist() == [False, True, False, True]
    from yatt_graph import NodeUsageError

    message = r"node 'reward' \(RuleReward\) stopped at step 0: sample 1 got a non-finite score nan"
    with pytest.raises(NodeUsageError, match=message):
        LocalExecutor(load_graph("graphs.text_ppo", batch_size=4, reward=ref)).step()


def test_a_streaming_rollout_feeds_reward_reference_and_critic_piece_by_piece(monkeypatch):
    """mm_ppo with stream=True: the per-sample nodes after the rollout take its pieces (their
    per-prompt inputs, image embeddings and answers, row by row); results are those of the
    unstreamed graph up to float rounding of smaller calls."""
    import runtime.engine.streams

    fed: dict[str, int] = {}
    call_piece = runtime.engine.streams.call_piece

    def counting(call, node, *args, **kwargs):
        fed[node.name] = fed.get(node.name, 0) + 1
        return call_piece(call, node, *args, **kwargs)

    monkeypatch.setattr(runtime.engine.streams, "call_piece", counting)
    options = {"batch_size": 32, "max_new_tokens": 6}  # rows ending at several steps
    whole = LocalExecutor(load_graph("graphs.mm_ppo", **options)).run(2)
    graph = load_graph("graphs.mm_ppo", stream=True, **options)
    for name in ("reward", "reference", "critic"):  # in process a call fuses what its budget
        graph.nodes[name].batch_policy = BatchPolicy(max_batch_size=2)  # allows: keep it small
    streamed = LocalExecutor(graph).run(2)
    assert set(fed) == {"reward", "reference", "critic"}
    assert min(fed.values()) > 2  # more than one call per step
    for a, b in zip(whole, streamed, strict=True):
        assert torch.equal(a.outputs["scores"], b.outputs["scores"])
        assert torch.equal(a.outputs["response_lengths"], b.outputs["response_lengths"])
        for key, value in a.outputs["metrics"].items():
            assert b.outputs["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


COUNTER_ENV = """
from nodes.agents import Environment, Observation

class Counter(Environment):
    max_turns = 3
    words = ('again',)
    def reset(self, row):
        self.turn = 0
        return Observation(row['prompt'])
    def step(self, action):
        self.turn += 1
        return Observation('again'), 0.25, False
"""


def test_the_agent_graph_runs_a_users_environment(tmp_path):
    env = tmp_path / "my_env.py"
    env.write_text(COUNTER_ENV)
    graph = load_graph("graphs.text_agent", batch_size=2, group_size=2, env=f"{env}:Counter")
    assert "again" in graph.nodes["rollout"].config()["policy"]["words"]
    result = LocalExecutor(graph).run(2)[-1]
    assert torch.equal(result.outputs["scores"], torch.full((4,), 0.75))  # 3 turns of 0.25
    assert result.outputs["agent"]["turns_mean"] == 3.0  # (AgentStats over the records)
    from runtime.train.samples import lineage_columns, sample_rows

    cols = sample_rows(1, result.outputs)
    lineage_columns(1, result.outputs, cols)
    assert cols["turns"] == [3] * 4 and cols["stop_reason"] == ["max_new_tokens"] * 4
    assert cols["data_file"] == ["shapes:color"] * 4 and len(cols["advantage"]) == 4
    assert torch.isfinite(torch.tensor(result.outputs["metrics"]["loss"]))
    with pytest.raises(ValueError, match="reward='x.py:f': must be left at its default"):
        load_graph("graphs.text_agent", reward="x.py:f")


@pytest.mark.timeout(300)
def test_each_turn_of_a_trajectory_is_a_span_in_the_trace(tmp_path):
    import json

    from runtime.cli import main

    (tmp_path / "my_env.py").write_text(COUNTER_ENV)
    out = tmp_path / "run"
    argv = ["run", "text_agent", "--env", f"{tmp_path / 'my_env.py'}:Counter", "--steps", "2",
            "--set", "batch_size=2", "group_size=2", "--out", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    events = [e for e in json.loads((out / "trace.json").read_text())["traceEvents"]
              if e.get("ph") == "X"]  # fmt: skip
    for step in (0, 1):
        spans = {e["name"]: e for e in events if e["args"].get("step") == step}
        rollout = spans["rollout"]
        for k in (1, 2, 3):  # three turns of all four trajectories, inside the rollout's span
            turn, env = spans[f"turn {k}"], spans[f"turn {k}: environment"]
            assert turn["args"]["trajectories"] == [0, 1, 2, 3]
            assert rollout["ts"] - 1e3 <= turn["ts"] <= env["ts"], (turn, rollout)
            assert env["ts"] + env["dur"] <= turn["ts"] + turn["dur"] + 1
            assert turn["ts"] + turn["dur"] <= rollout["ts"] + rollout["dur"] + 1e3
        assert spans["turn 1"]["ts"] + spans["turn 1"]["dur"] <= spans["turn 2"]["ts"] + 1


@pytest.mark.timeout(300)
def test_a_streamed_agent_run_equals_the_whole_one():
    """The trajectories that end at the first turn (an answer without a look) leave the
    rollout before the others look; the run's samples and update equal the unstreamed."""
    runs = []
    for stream in (False, True):
        graph = load_graph("graphs.text_agent", batch_size=4, stream=stream)
        assert graph.nodes["rollout"].streaming == stream
        runs.append(LocalExecutor(graph).run(2))
    assert runs[1][1].outputs["weight_sync"]["bytes"] > 0  # step 1 loaded the update
    for whole, streamed in zip(*runs, strict=True):
        assert torch.equal(whole.outputs["scores"], streamed.outputs["scores"])
        assert whole.outputs["texts"] == streamed.outputs["texts"]
        assert whole.outputs["weight_sync"]["bytes"] == streamed.outputs["weight_sync"]["bytes"]
        for key, value in whole.outputs["metrics"].items():
            assert streamed.outputs["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6)
