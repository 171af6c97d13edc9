"""Reward nodes: rules, bad-score policy, token rewards, a tiny reward model, a tiny CLIP score."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from PIL import Image

from nodes.models.policy import char_tokenizer
from nodes.rewards import (
    ClipScoreReward,
    RewardModel,
    RuleReward,
    clip_score,
    contains_answer,
    exact_match,
    place_on_last_token,
    regex_format,
)
from yatt_graph import NodeInputError

# --- rule functions used by the tests (module level, so they are importable by reference) ----


def length_score(text, meta, *, per_char=1.0):
    return per_char * len(text)


def nan_on_x(text, meta):
    return float("nan") if text == "x" else 1.0


def inf_on_x(text, meta):
    return math.inf if text == "x" else 2.0


def word_on_x(text, meta):
    return "high" if text == "x" else 3.0


def dict_score(text, meta):
    return {"score": len(text), "token_rewards": [0.5] * len(text), "note": "ignored"}


def raises_on_x(text, meta):
    if text == "x":
        raise KeyError("missing")
    return 0.0


# --- ready rules ------------------------------------------------------------------------------


def test_ready_rules_on_crafted_texts():
    assert exact_match("  The Answer is 4 ", {"answer": "the answer  is 4"}) == 1.0
    assert exact_match("4.0", {"answer": "4"}) == 0.0
    assert exact_match("Four", {"answer": "four"}, normalize=False) == 0.0
    assert exact_match("b", {"answer": ["a", "b"]}) == 1.0
    assert contains_answer("so the result is 42.", {"answer": 42}) == 1.0
    assert contains_answer("so the result is 41.", {"answer": 42}) == 0.0
    assert contains_answer("CAT", {"answer": "cat"}) == 1.0
    assert contains_answer("CAT", {"answer": "cat"}, case_sensitive=True) == 0.0
    fmt = r"<think>.*</think>\s*<answer>.*</answer>"
    assert regex_format("<think>a\nb</think> <answer>3</answer>", {}, pattern=fmt) == 1.0
    assert regex_format("<answer>3</answer>", {}, pattern=fmt) == 0.0
    assert regex_format("x <answer>3</answer>", {}, pattern="<answer>.*</answer>") == 1.0
    assert (
        regex_format("x <answer>3</answer>", {}, pattern="<answer>.*</answer>", full_match=True)
        == 0.0
    )
    with pytest.raises(ValueError, match="meta has no 'answer' key"):
        exact_match("a", {"solution": "a"})


def test_rule_reward_node_scores_by_function_and_by_reference():
    texts = ["4", "five", " 4 "]
    meta = [{"answer": "4"}] * 3
    out = RuleReward(exact_match).run(texts=texts, meta=meta)
    assert out["scores"].dtype == torch.float32
    assert out["scores"].tolist() == [1.0, 0.0, 1.0]
    by_ref = RuleReward("nodes.rewards:contains_answer").run(texts=texts, meta=meta)
    assert by_ref["scores"].tolist() == [1.0, 0.0, 1.0]
    fmt = RuleReward(regex_format, params={"pattern": r"^\d+$"}).run(texts=["12", "1a"])
    assert fmt["scores"].tolist() == [1.0, 0.0]
    scaled = RuleReward(length_score, params={"per_char": 0.5}).run(texts=["ab", ""])
    assert scaled["scores"].tolist() == [1.0, 0.0]


def test_rule_reward_config_rebuilds_the_node():
    node = RuleReward(regex_format, params={"pattern": "a"}, name="fmt")
    again = type(node)(**node.config())
    assert again.name == "fmt" and again.run(texts=["a", "b"])["scores"].tolist() == [1.0, 0.0]


def test_rule_reward_refuses_lambdas_and_bad_refs():
    with pytest.raises(TypeError, match="lambda or a local function"):
        RuleReward(lambda t, m: 1.0)
    with pytest.raises(ImportError, match="no_such_rule"):
        RuleReward("nodes.rewards:no_such_rule")
    # a function that cannot take (text, meta, **params) is refused before any step
    with pytest.raises(TypeError, match=r"the reward math:floor\(x, /\) cannot be called as fn"):
        RuleReward("math:floor")
    with pytest.raises(TypeError, match=r"fn\(text, meta, \*\*params\)"):
        RuleReward(exact_match, params={"no_such_option": 1})


def test_rule_reward_input_errors_name_node_and_port():
    node = RuleReward(exact_match, name="acc")
    with pytest.raises(ValueError, match="node 'acc': input 'meta' has 2 items but 'texts' has 3"):
        node.run(texts=["a", "b", "c"], meta=[{"answer": "a"}, {"answer": "b"}])
    # One meta per prompt, two samples per prompt (rows grouped as the rollout emits them).
    scores = node.run(texts=["a", "x", "y", "b"], meta=[{"answer": "a"}, {"answer": "b"}])["scores"]
    assert scores.tolist() == [1.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match=r"node 'acc': texts\[1\] is a int"):
        node.run(texts=["a", 3])
    with pytest.raises(NodeInputError, match="required input 'texts'"):
        node.run(meta=[{}])
    with pytest.raises(
        ValueError,
        match="node 'acc': sample 0 got no score from reward function .*exact_match: it raised",
    ):
        node.run(texts=["a"], meta=[{}])


# --- bad scores -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fn", "what"),
    [
        (nan_on_x, "non-finite score nan"),
        (inf_on_x, "non-finite score inf"),
        (word_on_x, "non-numeric"),
    ],
)
def test_bad_scores_are_refused_naming_node_and_sample(fn, what):
    node = RuleReward(fn, name="judge")
    with pytest.raises(ValueError, match=f"node 'judge': sample 2 got a {what}") as info:
        node.run(texts=["a", "b", "x", "c"])
    assert "on_bad_sample='skip'" in str(info.value)


def test_skip_policy_scores_zero_and_counts(caplog):
    node = RuleReward(nan_on_x, on_bad_sample="skip", emit_bad_mask=True, name="judge")
    with caplog.at_level(logging.WARNING, logger="nodes.rewards"):
        out = node.run(texts=["x", "a", "x"])
    assert out["scores"].tolist() == [0.0, 1.0, 0.0]
    assert out["bad_samples"].tolist() == [True, False, True]
    assert node.last_bad_count == 2 and node.total_bad_count == 2
    assert "judge" in caplog.text and "[0, 2]" in caplog.text
    node.run(texts=["a"])
    assert node.last_bad_count == 0 and node.total_bad_count == 2
    plain = RuleReward(nan_on_x, on_bad_sample="skip")
    assert set(plain.outputs) == {"scores"}
    with pytest.raises(ValueError, match="on_bad_sample must be one of"):
        RuleReward(nan_on_x, on_bad_sample="ignore")


def test_exceptions_in_the_rule_follow_on_bad_sample():
    with pytest.raises(ValueError, match="sample 1 got no score .*: it raised KeyError") as info:
        RuleReward(raises_on_x).run(texts=["a", "x"])
    assert isinstance(info.value.__cause__, KeyError)  # the reward's own traceback is kept
    node = RuleReward(raises_on_x, on_bad_sample="skip", emit_bad_mask=True)
    out = node.run(texts=["a", "x"])
    assert out["bad_samples"].tolist() == [False, True] and node.last_bad_count == 1


# --- token rewards ----------------------------------------------------------------------------


def test_place_on_last_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    out = place_on_last_token(torch.tensor([1.0, 2.0, 3.0]), mask)
    expected = torch.tensor([[0, 0, 1, 0], [2, 0, 0, 0], [0, 0, 0, 3]], dtype=torch.float32)
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="row 1 has no real token"):
        place_on_last_token(torch.ones(2), torch.tensor([[1.0, 0.0], [0.0, 0.0]]))


def test_token_level_rule_reward():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    node = RuleReward(length_score, token_level=True)
    assert node.inputs["response_mask"].required and "token_rewards" in node.outputs
    out = node.run(texts=["ab", "c"], response_mask=mask)
    assert out["token_rewards"].tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, 1.0]]
    with pytest.raises(NodeInputError, match="required input 'response_mask'"):
        node.run(texts=["ab", "c"])
    per_token = RuleReward(dict_score, token_level=True).run(
        texts=["ab", "xyz"], response_mask=mask
    )
    assert per_token["scores"].tolist() == [2.0, 3.0]
    assert per_token["token_rewards"].tolist() == [[0.5, 0.5, 0.0], [0.5, 0.5, 0.5]]
    with pytest.raises(ValueError, match="sample 0 returned 3 token rewards but .* 2 real tokens"):
        RuleReward(dict_score, token_level=True).run(texts=["abc", "xyz"], response_mask=mask)


# --- reward model -----------------------------------------------------------------------------

TINY_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 128}


@pytest.fixture(scope="module")
def reward_model():
    return RewardModel(config=TINY_GPT2, seed=3, micro_batch_size=2)


def test_reward_model_scores_shape_and_determinism(reward_model):
    prompts = ["Q: 2+2? A:", "Q: sky? A:", "Q: hi", "x"]
    texts = [" 4", " blue, mostly", " hello there friend", ""]
    out = reward_model.run(texts=texts, prompts=prompts)
    scores = out["scores"]
    assert scores.shape == (4,) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all()
    assert len(set(scores.tolist())) == 4  # different inputs, different scores
    assert torch.equal(reward_model.run(texts=texts, prompts=prompts)["scores"], scores)
    # micro-batching and padding do not change a sample's score
    alone = torch.cat(
        [reward_model.run(texts=[t], prompts=[p])["scores"] for p, t in zip(prompts, texts)]
    )
    torch.testing.assert_close(alone, scores, atol=1e-5, rtol=1e-5)
    # the same config and seed builds the same model (as a rebuilt node in another process would)
    again = RewardModel(**reward_model.config())
    torch.testing.assert_close(again.run(texts=texts, prompts=prompts)["scores"], scores)
    other_seed = RewardModel(config=TINY_GPT2, seed=4)
    assert not torch.allclose(other_seed.run(texts=texts, prompts=prompts)["scores"], scores)


def test_reward_model_loads_from_a_local_path(tmp_path, reward_model):
    reward_model.model.save_pretrained(tmp_path)
    reward_model.tokenizer.save_pretrained(tmp_path)
    loaded = RewardModel(str(tmp_path))
    texts = ["abc", "a much longer response"]
    torch.testing.assert_close(
        loaded.run(texts=texts)["scores"], reward_model.run(texts=texts)["scores"]
    )
    with pytest.raises(FileNotFoundError, match="not a directory"):
        RewardModel(str(tmp_path / "missing"))


def test_reward_model_argument_errors():
    with pytest.raises(ValueError, match="exactly one of path="):
        RewardModel()
    with pytest.raises(ValueError, match="must contain \\{response\\}"):
        RewardModel(config=TINY_GPT2, template="{prompt}")
    with pytest.raises(ValueError, match="needs 'model_type'"):
        RewardModel(config={"n_layer": 1})


def test_reward_model_nan_is_refused_or_skipped():
    rm = RewardModel(config=TINY_GPT2, name="rm")
    with torch.no_grad():
        rm.model.score.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="node 'rm': sample 0 got a non-finite score nan"):
        rm.run(texts=["a", "b"])
    rm.on_bad_sample = "skip"
    out = rm.run(texts=["a", "b"])
    assert out["scores"].tolist() == [0.0, 0.0] and rm.last_bad_count == 2


def test_reward_model_token_level(reward_model):
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    rm = RewardModel(model=reward_model.model, tokenizer=reward_model.tokenizer, token_level=True)
    out = rm.run(texts=["ab", "c"], response_mask=mask)
    assert out["token_rewards"].shape == (2, 3)
    assert (
        out["token_rewards"][0, 1] == out["scores"][0]
        and out["token_rewards"][1, 0] == out["scores"][1]
    )
    assert out["token_rewards"].count_nonzero() <= 2


# --- CLIP score -------------------------------------------------------------------------------

TINY_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


@pytest.fixture(scope="module")
def clip_reward():
    return ClipScoreReward("ViT-S-32", model_overrides=TINY_CLIP, micro_batch_size=2, name="clip")


def _images():
    return [
        Image.new("RGB", (40, 30), (255, 0, 0)),
        Image.new("RGB", (32, 32), (0, 0, 255)),
        Image.linear_gradient("L").convert("RGB").resize((48, 48)),
    ]


def test_clip_score_function_properties():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    torch.testing.assert_close(clip_score(a, b), clip_score(b, a))  # symmetric
    torch.testing.assert_close(clip_score(a, a), torch.full((6,), 2.5))  # identical -> max
    torch.testing.assert_close(clip_score(a, 3 * a, scale=1.0), torch.ones(6))  # scale-invariant
    assert torch.equal(clip_score(a, -a), torch.zeros(6))  # clamped at 0
    raw = clip_score(a, b, scale=1.0, clamp_negative=False)
    assert raw.min() >= -1 and raw.max() <= 1 and (raw < 0).any()
    s = clip_score(a, b)
    assert (s >= 0).all() and (s <= 2.5).all()
    assert torch.isnan(clip_score(torch.zeros(1, 8), a[:1])).all()  # caught as a bad score


def test_clip_reward_range_batching_and_determinism(clip_reward):
    texts = ["a red square", "a blue square", "a gradient"]
    out = clip_reward.run(texts=texts, images=_images())
    scores = out["scores"]
    assert scores.shape == (3,) and scores.dtype == torch.float32
    assert (scores >= 0).all() and (scores <= 2.5).all()
    one_by_one = torch.cat(
        [clip_reward.run(texts=[t], images=[im])["scores"] for t, im in zip(texts, _images())]
    )
    torch.testing.assert_close(one_by_one, scores, atol=1e-5, rtol=1e-5)
    raw = ClipScoreReward(**{**clip_reward.config(), "clamp_negative": False, "scale": 1.0})
    raw_scores = raw.run(texts=texts, images=_images())["scores"]
    torch.testing.assert_close(raw_scores.clamp(min=0) * 2.5, scores)  # same seed, same model


def test_clip_reward_embeddings_of_identical_inputs_give_max_score(clip_reward):
    image_embeds, text_embeds = clip_reward.embed(_images()[:2], ["same text", "same text"])
    assert image_embeds.shape == (2, 16) and text_embeds.shape == (2, 16)
    torch.testing.assert_close(text_embeds[0], text_embeds[1])
    torch.testing.assert_close(clip_score(image_embeds, image_embeds), torch.full((2,), 2.5))


def test_clip_reward_from_a_local_checkpoint_and_prompts(tmp_path, clip_reward):
    path = tmp_path / "tiny_clip.pt"
    torch.save(clip_reward.model.state_dict(), path)
    loaded = ClipScoreReward("ViT-S-32", str(path), model_overrides=TINY_CLIP, seed=99)
    texts = ["a", "b", "c"]
    torch.testing.assert_close(
        loaded.run(texts=texts, images=_images())["scores"],
        clip_reward.run(texts=texts, images=_images())["scores"],
    )
    by_prompt = ClipScoreReward(**{**clip_reward.config(), "text_source": "prompts"})
    torch.testing.assert_close(
        by_prompt.run(texts=["x", "y", "z"], prompts=texts, images=_images())["scores"],
        clip_reward.run(texts=texts, images=_images())["scores"],
    )


def test_clip_reward_errors(clip_reward):
    with pytest.raises(ValueError, match="not a local file; named tags download"):
        ClipScoreReward("ViT-S-32", "openai")
    with pytest.raises(NodeInputError, match="required input 'images'"):
        clip_reward.run(texts=["a"])
    with pytest.raises(ValueError, match=r"node 'clip': images\[1\] is a str"):
        clip_reward.run(texts=["a", "b"], images=[_images()[0], "not an image"])
    with pytest.raises(
        ValueError, match="node 'clip': input 'images' has 2 items but 'texts' has 3"
    ):
        clip_reward.run(texts=["a", "b", "c"], images=_images()[:2])


# --- needs_* and reward-model directories -----------------------------------------------------


def test_needs_prompts_and_images_say_which_inputs_a_node_reads(reward_model, clip_reward):
    from nodes.rewards import JudgeReward, RewardNode

    assert (RewardNode.needs_prompts, RewardNode.needs_images) == (False, False)
    assert (RuleReward.needs_prompts, RuleReward.needs_images) == (False, False)
    assert (RewardModel.needs_prompts, RewardModel.needs_images) == (True, False)
    assert (ClipScoreReward.needs_prompts, ClipScoreReward.needs_images) == (False, True)
    assert (JudgeReward.needs_prompts, JudgeReward.needs_images) == (True, False)
    # an instance refines them by what it reads
    assert RewardModel(config=TINY_GPT2, template="{response}").needs_prompts is False
    assert ClipScoreReward("ViT-S-32", text_source="prompts").needs_prompts is True
    assert clip_reward.needs_prompts is False and reward_model.needs_prompts is True


def test_reward_model_dir_errors_say_what_they_found(tmp_path, reward_model):
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    lm = tmp_path / "lm"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=100)).save_pretrained(lm)
    with pytest.raises(ValueError, match=r"holds a GPT2LMHeadModel .*not a sequence classifier"):
        RewardModel(str(lm), name="rm").setup()
    three = tmp_path / "three"
    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=100, num_labels=3)
    GPT2ForSequenceClassification(cfg).save_pretrained(three)
    with pytest.raises(ValueError, match="with 3 labels; a reward model needs a single-logit"):
        RewardModel(str(three)).setup()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "weights.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"has no config.json \(it holds \['weights.pt'\]\)"):
        RewardModel(str(empty)).setup()


# --- reward_from_option -----------------------------------------------------------------------


def _saved_reward_model(tmp_path, reward_model):
    path = tmp_path / "rm"
    reward_model.model.save_pretrained(path)
    tok = char_tokenizer()
    tok.pad_token = None  # the loader falls back to eos
    tok.save_pretrained(path)
    return path


def test_reward_from_option_every_spelling(tmp_path, reward_model):
    from nodes.data import answer_reward, make_sample
    from nodes.rewards import JudgeReward, reward_from_option

    rule = reward_from_option("nodes.data:answer_reward")
    assert isinstance(rule, RuleReward) and rule.fn is answer_reward and rule.name == "reward"
    file = tmp_path / "my_reward.py"
    file.write_text("def score(text, meta):\n    return float(len(text))\n")
    by_file = reward_from_option(f"{file}:score", name="r2")
    assert by_file.name == "r2" and by_file.run(texts=["abc"])["scores"].tolist() == [3.0]

    samples = [make_sample(0, i) for i in range(3)]
    images, prompts, meta = (list(x) for x in zip(*samples))
    clip = reward_from_option("clip")
    assert isinstance(clip, ClipScoreReward) and clip.template == "{response}"
    scores = clip.run(texts=[m["answer"] for m in meta], images=images, meta=meta)["scores"]
    assert scores.shape == (3,) and ((scores >= 0) & (scores <= 2.5)).all()
    named = reward_from_option("clip:open_clip:ViT-S-32")
    assert (named.model_name, named.pretrained) == ("ViT-S-32", None)
    with pytest.raises(ValueError, match="is not a local file"):
        reward_from_option(f"clip:open_clip:ViT-S-32:{tmp_path / 'missing.pt'}")

    path = _saved_reward_model(tmp_path, reward_model)
    model = reward_from_option(f"model:{path}")
    assert isinstance(model, RewardModel)
    texts = ["a", "a longer one"]
    torch.testing.assert_close(
        model.run(texts=texts, prompts=prompts[:2])["scores"],
        reward_model.run(texts=texts, prompts=prompts[:2])["scores"],
    )
    assert model.tokenizer.pad_token == model.tokenizer.eos_token
    with pytest.raises(FileNotFoundError, match="not a directory"):
        reward_from_option(f"model:{tmp_path / 'nope'}")

    judge = reward_from_option("judge:tiny")
    assert isinstance(judge, JudgeReward) and judge.needs_prompts
    assert judge.run(texts=["red"] * 3, prompts=prompts, meta=meta)["scores"].shape == (3,)


@pytest.mark.parametrize(
    "value",
    ["nonsense", "", "clip:vit", "clip:open_clip", "model:", "judge:", ":fn", "no_such_mod_x:f"],
)
def test_reward_from_option_bad_spellings_list_the_spellings(value):
    from nodes.rewards import reward_from_option

    with pytest.raises(ValueError, match=r"(?s)reward .*The spellings are:.*model:DIR.*judge:DIR"):
        reward_from_option(value)


def test_reward_from_option_under_skip_every_kind_has_two_outputs(tmp_path, reward_model):
    from nodes.rewards import reward_from_option

    with pytest.raises(ValueError, match="on_bad_sample must be 'raise' or 'skip'"):
        reward_from_option("clip", on_bad_sample="ignore")
    path = _saved_reward_model(tmp_path, reward_model)
    image = Image.new("RGB", (32, 32), (255, 0, 0))
    for value in ["nodes.data:answer_reward", "clip", f"model:{path}", "judge:tiny"]:
        node = reward_from_option(value, on_bad_sample="skip")
        assert list(node.outputs) == ["scores", "bad_samples"], value
        plain = reward_from_option(value)
        assert list(plain.outputs) == ["scores"], value
        inputs = {"texts": ["red"], "meta": [{"answer": "red", "choices": ["red"]}]}
        if node.needs_prompts:
            inputs["prompts"] = ["what colour ?"]
        if node.needs_images:
            inputs["images"] = [image]
        out = node.run(**inputs)
        assert out["bad_samples"].tolist() == [False] and out["scores"].shape == (1,), value


# --- CLIP against what the image shows, templates, no images ---------------------------------

COLOURS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}


def test_a_trained_tiny_clip_scores_the_response_that_names_the_image_highest():
    """Train the tiny CLIP's two projections contrastively on three colour images and their
    words (a few seconds); then, per image, the response naming its colour scores highest."""
    node = ClipScoreReward(
        "ViT-S-32", model_overrides=TINY_CLIP, template="a {response} shape", meta_keys=()
    )
    images = [Image.new("RGB", (32, 32), c) for c in COLOURS.values()]
    words = list(COLOURS)
    m = node.model
    pixels = torch.stack([node.preprocess(im) for im in images])  # (3, 3, 32, 32)
    tokens = node.tokenizer([f"a {w} shape" for w in words])  # (3, 16)
    heads = [m.visual.proj, m.text_projection]
    for p in m.parameters():
        p.requires_grad_(p is heads[0] or p is heads[1])
    opt = torch.optim.Adam(heads, lr=3e-2)
    torch.manual_seed(0)
    for _ in range(30):
        i = torch.nn.functional.normalize(m.encode_image(pixels), dim=-1)  # (3, D)
        t = torch.nn.functional.normalize(m.encode_text(tokens), dim=-1)  # (3, D)
        logits = 10 * i @ t.T  # (3, 3)
        target = torch.arange(3)
        loss = torch.nn.functional.cross_entropy(logits, target)
        loss = (loss + torch.nn.functional.cross_entropy(logits.T, target)) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
    for k, image in enumerate(images):
        scores = node.run(texts=words, images=[image] * 3)["scores"]
        assert int(scores.argmax()) == k, (words[k], scores)


def test_clip_template_reads_meta_and_prompts(clip_reward):
    meta = [{"answer": "red"}, {"answer": "blue"}, {"answer": "grey"}]
    texts = ["x", "y", "z"]
    filled = ClipScoreReward(
        **{**clip_reward.config(), "template": "{response} (expected {answer})"}
    )
    expected = [f"{t} (expected {m['answer']})" for t, m in zip(texts, meta)]
    torch.testing.assert_close(
        filled.run(texts=texts, images=_images(), meta=meta)["scores"],
        clip_reward.run(texts=expected, images=_images())["scores"],
    )
    with pytest.raises(ValueError, match=r"unknown placeholder \{colour\}"):
        ClipScoreReward("ViT-S-32", template="{colour} {response}")
    with pytest.raises(ValueError, match=r"must contain \{response\} or \{prompt\}"):
        ClipScoreReward("ViT-S-32", template="a photo")
    with pytest.raises(ValueError, match="template= or text_source='prompts', not both"):
        ClipScoreReward("ViT-S-32", template="a {response}", text_source="prompts")


def test_clip_without_images_says_what_to_wire(clip_reward):
    with pytest.raises(ValueError, match="node 'clip': a CLIP score .* no images were given"):
        clip_reward.forward(texts=["a"], meta=[{}])


# --- reward models from local directories ------------------------------------------------------


def test_a_llama_sequence_classifier_dir_without_pad_token_loads_and_scores(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate("abcdefgh ")}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    assert tok.pad_token is None
    cfg = LlamaConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, num_labels=1, eos_token_id=1, bos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForSequenceClassification(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    rm = RewardModel(str(tmp_path), template="{response} {answer}", micro_batch_size=3)
    meta = [{"answer": "a"}, {"answer": "bb"}, {"answer": "c"}, {"answer": "dd"}]
    texts = ["abc", "a", "hhhh gg", "dead beef"]
    scores = rm.run(texts=texts, meta=meta)["scores"]
    assert rm.tokenizer.pad_token == "</s>" and torch.isfinite(scores).all()
    assert len(set(scores.tolist())) == 4 and not rm.needs_prompts
    alone = torch.cat([rm.run(texts=[t], meta=[m])["scores"] for t, m in zip(texts, meta)])
    torch.testing.assert_close(alone, scores, atol=1e-5, rtol=1e-5)


def test_a_reward_model_dir_transformers_cannot_read_is_one_line_naming_it(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no_such_model_type"}')
    with pytest.raises(ValueError, match=r"node 'rm': .*could not be loaded") as info:
        RewardModel(str(tmp_path), name="rm").setup()
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)


def _overflow(text, meta):
    return 1e39  # a Python float, beyond float32's range


def _exits(text, meta):
    raise SystemExit(3)


def _writes_meta(text, meta):
    meta["seen"] = meta.get("seen", 0) + 1
    return float(meta["seen"])


def test_a_score_beyond_float32_follows_on_bad_sample():
    from nodes.rewards import RuleReward

    with pytest.raises(ValueError, match="sample 0 got a score beyond float32 1e"):
        RuleReward(_overflow).run(texts=["a"], meta=[{}])
    out = RuleReward(_overflow, on_bad_sample="skip", emit_bad_mask=True).run(
        texts=["a"], meta=[{}]
    )
    assert out["scores"].tolist() == [0.0] and out["bad_samples"].tolist() == [True]


def test_a_reward_that_calls_sys_exit_is_a_reward_error_naming_the_sample():
    from nodes.rewards import RuleReward

    with pytest.raises(ValueError, match="sample 0 got no score .*: it raised SystemExit: 3"):
        RuleReward(_exits).run(texts=["a", "b"], meta=[{}, {}])


def test_each_sample_gets_its_own_meta():
    from nodes.rewards import RuleReward

    shared = {"answer": "x"}
    out = RuleReward(_writes_meta).run(texts=["a", "b", "c"], meta=[shared, shared, shared])
    assert out["scores"].tolist() == [1.0, 1.0, 1.0] and shared == {"answer": "x"}
    assert RuleReward(_writes_meta).run(texts=["a", "b"])["scores"].tolist() == [1.0, 1.0]


def trl_reward(prompts, completions, answer, **kwargs):
    """A reward as TRL's GRPOTrainer takes it: the batch's prompts, completions and columns."""
    return [None if c == "?" else float(a in c) + 0.0 * len(p) for p, c, a in zip(prompts, completions, answer)]  # fmt: skip


def trl_reward_short(prompts, completions, **kwargs):
    return [1.0]


def test_a_trl_style_reward_is_taken_as_it_is():
    node = RuleReward(trl_reward, on_bad_sample="skip", emit_bad_mask=True)
    assert node.batched and node.needs_prompts
    meta = [{"answer": "red", "id": 1}, {"answer": "red", "id": 2}, {"answer": "blue", "id": 3}]
    out = node.run(texts=["red it is", "blue", "?"], meta=meta, prompts=["q1", "q2", "q3"])
    assert out["scores"].tolist() == [1.0, 0.0, 0.0] and out["bad_samples"].tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match=r"returned a list of 1 score\(s\) for 3 completions"):
        RuleReward(trl_reward_short).run(texts=["a", "b", "c"], meta=meta, prompts=["", "", ""])
