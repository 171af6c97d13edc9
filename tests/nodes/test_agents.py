"""Multi-turn rollouts: the environment protocol, tools, token-in/token-out trajectories, and
the masks the update and the reference read."""

from __future__ import annotations

import time

import pytest
import torch

from nodes.agents import (
    AgentRollout,
    AgentStats,
    Environment,
    Observation,
    ToolEnv,
    observation_ids,
    parse_tool_call,
)
from nodes.data import ShapesSource, task_vocabulary
from nodes.reference import ReferenceLogprobs
from nodes.update import GRPOUpdate
from yatt_graph import UsageError

WORDS = [*task_vocabulary(), "look"]
SPEC = {"name": "tiny-qwen2", "seed": 0, "words": WORDS}
OBSERVATION = "it is red ."


class Echo(Environment):
    """Every turn gets the same observation and half a point, for three turns."""

    max_turns = 3

    def reset(self, row):
        return Observation(row["prompt"])

    def step(self, action):
        return Observation(OBSERVATION), 0.5, False


def _sample(env=Echo, n=2, **kw):
    node = AgentRollout(policy=SPEC, env=env, n=n, max_new_tokens=3, **kw)
    node.setup()
    out = node.run(prompts=["what color is the shape ?", "how many shapes ?"], meta=None)
    return node, out


def test_tool_calls_are_read_in_both_forms():
    tools = {"look": None, "zoom": None}
    assert parse_tool_call("look", tools) == ("look", [], {})
    assert parse_tool_call("zoom 2 more.", tools) == ("zoom", ["2", "more"], {})
    assert parse_tool_call("look? then", tools) == ("look", ["then"], {})
    tagged = 'ok <tool_call>{"name": "zoom", "arguments": {"factor": 2}}</tool_call>'
    assert parse_tool_call(tagged, tools) == ("zoom", [], {"factor": 2})
    assert parse_tool_call("red", tools) is None  # a final answer
    assert parse_tool_call('<tool_call>{"name": "nope"}</tool_call>', tools) is None
    assert parse_tool_call("<tool_call>{not json</tool_call>", tools) is None


class Tools(ToolEnv):
    time_limit_s = 0.5
    failure_reward = -1.0

    @property
    def tools(self):
        return {
            "ok": lambda *a: "it is red .",
            "boom": lambda *a: 1 / 0,
            "hang": lambda *a: time.sleep(5),
            "junk": lambda *a: 42,
        }

    def score(self, answer):
        return float(answer.strip() == "red")


@pytest.mark.parametrize(
    ("tool", "why"),
    [
        ("boom", "raised ZeroDivisionError"),
        ("hang", "ran past its time limit of 0.5 s"),
        ("junk", "returned a int, neither text nor an image"),
    ],
)
def test_a_failing_tool_ends_its_trajectory_with_the_reason_and_the_failure_reward(tool, why):
    env = Tools()
    assert env.reset({"prompt": "what color ?"}).text == "what color ?"
    start = time.perf_counter()
    obs, reward, done = env.step(tool)
    assert time.perf_counter() - start < 2  # a hanging tool does not hold the rollout
    assert (obs, reward, done) == (None, -1.0, True)
    assert [c.name for c in env.calls] == [tool] and why in env.calls[0].error


def test_a_tool_answers_and_a_final_answer_is_scored():
    env = Tools()
    env.reset({"prompt": "what color ?"})
    obs, reward, done = env.step("ok")
    assert (obs.text, reward, done) == ("it is red .", 0.0, False)
    assert env.step("red") == (None, 1.0, True)
    assert env.calls[0].error is None


def test_trajectories_keep_the_sampled_tokens_and_mask_the_observations():
    node, out = _sample()
    B = 4
    response, policy, context = out["response_ids"], out["response_mask"], out["context_mask"]
    assert response.shape[0] == B and torch.equal(out["group_ids"], torch.tensor([0, 0, 1, 1]))
    assert bool((context >= policy).all())  # every policy token is read
    observed = observation_ids(node.policy, OBSERVATION)
    for i in range(B):
        turns = policy[i].bool()
        gaps = (context[i].bool() & ~turns).nonzero().flatten().tolist()
        assert len(gaps) == 2 * len(observed)  # two observations between three turns
        assert response[i, gaps].tolist() == observed * 2  # tokenized as the env wrote them
        assert torch.all(out["logprobs"][i, gaps] == 0)
        assert out["texts"][i].count(OBSERVATION) == 2
    assert torch.equal(out["scores"], torch.full((B,), 1.5))  # the turns' rewards add up
    assert torch.equal(out["truncated"], torch.ones(B))  # out of turns, the env still waiting
    assert [r["turns"] for r in out["trajectories"]] == [3] * B
    stats = AgentStats().run(trajectories=out["trajectories"])["stats"]
    assert stats == {
        "turns_mean": 3.0,
        "observation_tokens_mean": 2.0 * len(observed),
        "env_errors": 0.0,
    }


def test_the_trainer_sees_what_each_turn_was_sampled_in():
    """Token in, token out: a teacher-forced pass over the trajectory with its observations as
    context gives the logprobs the turns were sampled with; without them it does not."""
    node, out = _sample()
    policy = node.policy
    batch = policy.prepare(out["prompt_ids"], out["prompt_mask"])
    turns = out["response_mask"] > 0
    with torch.no_grad():
        seen = policy.response_logprobs(batch, out["response_ids"], out["context_mask"])
        blind = policy.response_logprobs(batch, out["response_ids"], out["response_mask"])
    torch.testing.assert_close(seen[turns], out["logprobs"][turns], atol=1e-5, rtol=0)
    assert (blind[turns] - out["logprobs"][turns]).abs().max() > 1e-2

    ref = ReferenceLogprobs(policy=SPEC)
    ref.setup()
    ports = {k: out[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
    got = ref.run(**ports, context_mask=out["context_mask"])["ref_logprobs"]
    torch.testing.assert_close(got[turns], out["logprobs"][turns], atol=1e-5, rtol=0)
    assert torch.all(got[~turns] == 0)


def test_the_update_reads_the_observations_as_context():
    """At the first pass over a batch the ratio is 1 where the update sees each turn's context
    (approx_kl about 0); fed without the observations it is not."""
    _, out = _sample()
    ports = {k: out[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
    ports |= {"logprobs": out["logprobs"], "advantages": out["response_mask"] * 0.5}
    kw = {"policy": SPEC, "lr": 1e-3, "max_grad_norm": 0}
    seen = GRPOUpdate(**kw)
    seen.setup()
    metrics = seen.run(**ports, context_mask=out["context_mask"])["metrics"]
    assert metrics["approx_kl"] < 1e-6 and metrics["clip_fraction"] == 0.0
    blind = GRPOUpdate(**kw)
    blind.setup()
    assert blind.run(**ports)["metrics"]["approx_kl"] > 1e-3
    bad = out["context_mask"].clone()
    bad[0, 0] = 0.0  # a policy token not read
    with pytest.raises(ValueError, match="'context_mask' is 0 where 'response_mask' is 1"):
        seen.run(**ports, context_mask=bad)


def test_the_look_task_scores_a_look_then_the_colour():
    from nodes.agents.lookup import LookEnv

    row = ShapesSource(batch_size=1, seed=3).run()["meta"][0]
    env = LookEnv()
    assert "color" not in env.reset({**row, "prompt": "what color is the shape ?"}).text.split()[3:]
    obs, reward, done = env.step("look")
    assert row["color"] in obs.text.split() and (reward, done) == (0.0, False)
    assert env.step(f"{row['color']} .") == (None, 1.0, True)
    env.reset({**row, "prompt": "what color is the shape ?"})
    assert env.step(row["color"]) == (None, 0.0, True)  # right, but a guess: never looked
    env.reset({**row, "prompt": "what color is the shape ?"})
    env.step("look")
    wrong = next(c for c in ("red", "blue") if c != row["color"])
    assert env.step(wrong) == (None, 0.0, True)
    with pytest.raises(ValueError, match="no 'color' column"):
        LookEnv().reset({"prompt": "hi", "answer": "x"})


class NotAnEnv:
    pass


class Wrong(Environment):
    def reset(self, row):
        return Observation(row["prompt"])

    def step(self, action):
        return "it is red ."  # not (observation, reward, done)


def test_an_env_that_breaks_the_protocol_is_named():
    with pytest.raises(UsageError, match="is not an environment class"):
        AgentRollout(policy=SPEC, env=NotAnEnv)
    with pytest.raises(UsageError, match="env 'no_such_module:Env' cannot be loaded"):
        AgentRollout(policy=SPEC, env="no_such_module:Env")
    with pytest.raises(UsageError, match=r"Wrong.step must return \(observation or None"):
        _sample(env=Wrong)


def test_the_stats_count_every_trajectorys_tools():
    def record(calls, errors=(), seconds=0.0):
        return {"turns": 1 + len(calls), "observation_tokens": 4 * len(calls), "tool_calls": calls,
                "tool_errors": list(errors), "tool_seconds": seconds, "uses_tools": True}  # fmt: skip

    records = [record(["look"], seconds=0.5), record([]), record(["look", "zoom"], ["zoom: x"])]
    stats = AgentStats().run(trajectories=records)["stats"]
    assert stats == {
        "turns_mean": 2.0,
        "observation_tokens_mean": 4.0,
        "env_errors": 0.0,
        "tool_use_rate": 2 / 3,
        "tool_calls_per_trajectory": 1.0,
        "tool_errors": 1.0,
        "tool_seconds": 0.5,
        "tool_calls/look": 2.0,
        "tool_calls/zoom": 1.0,
    }


class Show(Environment):
    """An image with the prompt, and another with each observation, for three turns."""

    max_turns = 3

    def reset(self, row):
        from PIL import Image

        return Observation(row["prompt"], [Image.new("RGB", (32, 32), (200, 30, 30))])

    def step(self, action):
        from PIL import Image

        return Observation("now", [Image.new("RGB", (32, 32), (30, 200, 30))]), 0.5, False


def test_observation_images_enter_the_context_and_the_trainer_sees_them_as_sampled():
    """A VLM's trajectory with an image in each observation: the placeholders its processor
    expands each image into sit between the turns, every image travels with the row in
    order, and the teacher-forced passes of the policy, the reference and the update give the
    logprobs the turns were sampled with."""
    node = AgentRollout(policy="tiny-qwen2-vl", env=Show, n=2, max_new_tokens=3)
    node.setup()
    out = node.run(prompts=["what ?", "which ?"], meta=None)
    policy = node.policy
    assert [len(images) for images in out["images"]] == [3] * 4  # the prompt's, then 2 more
    turns = out["response_mask"] > 0
    observed = observation_ids(policy, Observation("now", out["images"][0][1:2]))
    assert observed.count(policy.image_token_id) == 4  # a 32x32 image: 4 placeholders
    gaps = (~turns[0]).nonzero().flatten().tolist()
    assert out["response_ids"][0, gaps].tolist() == observed * 2
    batch = policy.prepare(out["prompt_ids"], out["prompt_mask"], images=out["images"])
    with torch.no_grad():
        seen = policy.response_logprobs(batch, out["response_ids"], out["context_mask"])
    torch.testing.assert_close(seen[turns], out["logprobs"][turns], atol=1e-5, rtol=0)

    ports = {k: out[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
    ports |= {"images": out["images"], "context_mask": out["context_mask"]}
    ref = ReferenceLogprobs(policy="tiny-qwen2-vl")
    ref.setup()
    got = ref.run(**ports)["ref_logprobs"]
    torch.testing.assert_close(got[turns], out["logprobs"][turns], atol=1e-5, rtol=0)
    update = GRPOUpdate(policy="tiny-qwen2-vl", lr=1e-3, max_grad_norm=0)
    update.setup()
    metrics = update.run(**ports, logprobs=out["logprobs"], advantages=out["response_mask"] * 0.5)[
        "metrics"
    ]
    assert metrics["approx_kl"] < 1e-6


def test_images_a_policy_cannot_read_are_refused():
    with pytest.raises(UsageError, match="returned an observation with images and the "
                       "HFCausalPolicy policy reads none"):  # fmt: skip
        _sample(env=Show)


def test_image_placeholders_no_image_fills_are_refused():
    node = AgentRollout(policy="tiny-qwen2-vl", env=Show, n=1, max_new_tokens=3)
    node.setup()
    out = node.run(prompts=["what ?"], meta=None)
    policy = node.policy
    short = [images[:2] for images in out["images"]]  # an observation's image left out
    batch = policy.prepare(out["prompt_ids"], out["prompt_mask"], images=short)
    with pytest.raises(
        ValueError, match="hold 12 image placeholder tokens and the images given fill 8"
    ):
        policy.response_logprobs(batch, out["response_ids"], out["context_mask"])


def test_the_image_look_task_hides_the_colour_until_a_look():
    from nodes.agents.lookup import LookImageEnv

    data = ShapesSource(batch_size=1, seed=3).run()
    row = {**data["meta"][0], "image": data["images"][0], "prompt": data["prompts"][0]}
    env = LookImageEnv()
    first = env.reset(row)
    (dark,) = first.images
    assert dark.size == row["image"].size and dark.getextrema() == ((96, 96),) * 3  # one grey
    obs, reward, done = env.step("look")
    assert obs.images == [row["image"]] and (reward, done) == (0.0, False)
    assert env.step(row["color"]) == (None, 1.0, True)
    with pytest.raises(ValueError, match="LookImageEnv: the data row has no image"):
        LookImageEnv().reset(data["meta"][0] | {"prompt": "what color is the shape ?"})


class EndsAt(Environment):
    """A trajectory ends after its row's ``turns`` turns, a point for each."""

    max_turns = 3

    def reset(self, row):
        self.left = row["turns"]
        return Observation(row["prompt"])

    def step(self, action):
        self.left -= 1
        return (None, 1.0, True) if self.left == 0 else (Observation(OBSERVATION), 1.0, False)


def test_a_streamed_call_hands_out_each_turns_ended_trajectories_and_joins_to_the_whole():
    from yatt_graph.stream import join_pieces

    def node(stream):
        n = AgentRollout(policy=SPEC, env=EndsAt, n=2, max_new_tokens=3, stream=stream)
        n.setup()
        return n

    inputs = {"prompts": ["what color is the shape ?", "how many shapes ?"],
              "meta": [{"turns": 3}, {"turns": 1}], "images": None, "weights": None}  # fmt: skip
    whole = node(False).forward(**inputs)
    streamed = node(True)
    assert streamed.streaming
    pieces = list(streamed.forward_stream(**inputs))
    assert [rows for rows, _, _ in pieces] == [[2, 3], [0, 1]]  # turn 1's, then turn 3's
    assert all(size == 4 for _, _, size in pieces)
    joined = join_pieces([p[:2] for p in pieces], streamed.name)
    assert torch.equal(joined["scores"], torch.tensor([3.0, 3.0, 1.0, 1.0]))
    for key in ("scores", "response_mask", "context_mask", "logprobs", "prompt_ids", "group_ids"):
        a, b = whole[key], joined[key]
        b = b[:, : a.shape[1]] if b.dim() > 1 else b
        assert torch.equal(a, b), key
    mask = whole["context_mask"] > 0
    assert torch.equal(whole["response_ids"][mask], joined["response_ids"][mask])
    assert whole["texts"] == joined["texts"]
    assert streamed.step == 1  # one call counted, as unstreamed
