"""JudgeReward: the score maths, batching, templates, score words, local dirs, bad scores."""

from __future__ import annotations

import pytest
import torch

from nodes.rewards import JudgeReward
from nodes.rewards.models import char_tokenizer

PROMPTS = ["what colour is the shape ?", "what shape is it ?", "how many ?", "q"]
TEXTS = ["red", "a blue square , mostly", "two", ""]


@pytest.fixture(scope="module")
def judge():
    return JudgeReward("tiny", seed=1, max_batch=2, name="judge")


def manual_scores(judge, inputs):
    """One unpadded forward per input: full softmax, renormalised over the score words."""
    ids = torch.tensor(judge.word_ids)
    values = torch.tensor(list(judge.score_words.values()))
    out = []
    with torch.no_grad():
        for text in inputs:
            enc = judge.tokenizer(text, return_tensors="pt")
            logits = judge.model(input_ids=enc["input_ids"]).logits[0, -1]  # (V,)
            p = torch.softmax(logits.double(), dim=-1)[ids]  # (W,)
            out.append(float((p / p.sum()).float() @ values))
    return torch.tensor(out)


def test_judge_score_is_the_renormalised_probability_of_the_score_words(judge):
    inputs = judge.judge_inputs(TEXTS, [{}] * 4, PROMPTS)
    assert inputs[0] == "Question: what colour is the shape ?\nAnswer: red\nIs the answer correct? "
    scores = judge.run(texts=TEXTS, prompts=PROMPTS)["scores"]
    assert scores.shape == (4,) and scores.dtype == torch.float32
    assert ((scores > 0) & (scores < 1)).all()
    torch.testing.assert_close(scores, manual_scores(judge, inputs), atol=1e-5, rtol=1e-5)
    # weighted score words: the reward stays within the values' range
    graded = JudgeReward("tiny", seed=1, score_words={"yes": 2.0, "no": -1.0, "maybe": 0.5})
    g = graded.run(texts=TEXTS, prompts=PROMPTS)["scores"]
    assert ((g > -1) & (g < 2)).all()
    torch.testing.assert_close(g, manual_scores(graded, inputs), atol=1e-5, rtol=1e-5)


def test_judge_batching_equals_one_by_one_and_rebuilds(judge):
    batched = judge.run(texts=TEXTS, prompts=PROMPTS)["scores"]
    wide = JudgeReward(**{**judge.config(), "max_batch": 16}).run(texts=TEXTS, prompts=PROMPTS)
    alone = torch.cat([judge.run(texts=[t], prompts=[p])["scores"] for p, t in zip(PROMPTS, TEXTS)])
    torch.testing.assert_close(wide["scores"], batched, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone, batched, atol=1e-5, rtol=1e-5)
    other = JudgeReward("tiny", seed=2).run(texts=TEXTS, prompts=PROMPTS)["scores"]
    assert not torch.allclose(other, batched)


def test_judge_templates_with_meta_placeholders_and_errors():
    meta = [{"answer": "red"}, {"answer": "blue", "grade": "A"}]
    j = JudgeReward("tiny", template="Expected {answer} got {response} ? ", name="j")
    assert j.needs_prompts is False and not j.inputs["prompts"].required
    assert j.judge_inputs(["red", "green"], meta, None) == [
        "Expected red got red ? ",
        "Expected blue got green ? ",
    ]
    assert j.run(texts=["red", "green"], meta=meta)["scores"].shape == (2,)
    assert JudgeReward("tiny").inputs["prompts"].required
    with pytest.raises(ValueError, match=r"placeholder \{\} is not a name"):
        JudgeReward("tiny", template="{} {response}")
    with pytest.raises(ValueError, match=r"placeholder \{a\.b\} is not a name"):
        JudgeReward("tiny", template="{a.b} {response}")
    with pytest.raises(ValueError, match="is malformed"):
        JudgeReward("tiny", template="{response")
    with pytest.raises(ValueError, match=r"must contain \{response\}"):
        JudgeReward("tiny", template="{prompt} ?")
    # a placeholder that is no declared meta key is refused when the node is declared
    with pytest.raises(
        ValueError, match=r"node 'g': .*unknown placeholder \{grade\}.*add a data column's name"
    ):
        JudgeReward("tiny", template="{grade} {response}", name="g")
    g = JudgeReward("tiny", template="{grade} {response}", meta_keys=["answer", "grade"], name="g")
    assert g.judge_inputs(["x"], [meta[1]], None) == ["A x"]
    with pytest.raises(ValueError, match=r"node 'g': sample 0: meta has no 'grade' .*\{grade\}"):
        g.run(texts=["a", "b"], meta=meta)
    with pytest.raises(ValueError, match=r"reads \{prompt\} but no prompts were given"):
        JudgeReward("tiny").forward(texts=["a"])


def test_a_judge_that_reads_its_last_token_scores_yes_answers_higher_in_any_batch():
    """A tiny judge made deterministic: its blocks and position embeddings zeroed, so the next
    token depends on the last input token only (ln_f(wte[last]) @ wte.T, weights tied), and
    "yes"/"no" embeddings orthogonal. Answers ending in "yes" score ~1 and in "no" ~0, also
    when left padding shifts them in a batch of mixed lengths."""
    j = JudgeReward("tiny", template="{response}", meta_keys=(), max_batch=4)
    gpt2 = j.model.transformer
    with torch.no_grad():
        gpt2.wpe.weight.zero_()
        for block in gpt2.h:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.zero_()
                proj.bias.zero_()
        yes, no = j.word_ids
        gpt2.wte.weight[[yes, no]] = 0.0
        gpt2.wte.weight[yes, :2] = torch.tensor([5.0, -5.0])
        gpt2.wte.weight[no, 2:4] = torch.tensor([5.0, -5.0])
    texts = ["yes", "it is a red circle , no", "no", "red circle yes", "circle circle no"]
    scores = j.run(texts=texts)["scores"]
    assert scores[[0, 3]].min() > 0.99 and scores[[1, 2, 4]].max() < 0.01, scores
    alone = torch.cat([j.run(texts=[t])["scores"] for t in texts])
    torch.testing.assert_close(alone, scores, atol=1e-5, rtol=1e-5)


def test_judge_chat_template(tmp_path):
    chat = JudgeReward("tiny", seed=1, chat_template=True, max_batch=3)
    inputs = chat.judge_inputs(TEXTS, [{}] * 4, PROMPTS)
    assert (
        inputs[0]
        == "judge : Question: what colour is the shape ?\nAnswer: red\nIs the answer correct? "
    )
    scores = chat.run(texts=TEXTS, prompts=PROMPTS)["scores"]
    torch.testing.assert_close(scores, manual_scores(chat, inputs), atol=1e-5, rtol=1e-5)
    plain = JudgeReward("tiny", seed=1).run(texts=TEXTS, prompts=PROMPTS)["scores"]
    assert not torch.allclose(plain, scores)  # the judge reads the chat turn


def test_judge_score_word_checks(tmp_path):
    with pytest.raises(ValueError, match="at least two words"):
        JudgeReward("tiny", score_words={"yes": 1.0})
    with pytest.raises(ValueError, match="is not a number"):
        JudgeReward("tiny", score_words={"yes": "high", "no": 0.0})
    with pytest.raises(ValueError, match="is not finite"):
        JudgeReward("tiny", score_words={"yes": float("inf"), "no": 0.0})
    # a character-level judge: "yes" is three tokens, "y" one
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = char_tokenizer()
    cfg = GPT2Config(vocab_size=len(tok), n_layer=1, n_head=2, n_embd=16, n_positions=128)
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    multi = JudgeReward(str(tmp_path), name="cj")
    with pytest.raises(
        ValueError, match=r"node 'cj': score word 'yes' is 3 tokens \['y', 'e', 's'\]"
    ):
        multi.setup()
    single = JudgeReward(str(tmp_path), score_words={"y": 1.0, "n": 0.0}, max_batch=3)
    out = single.run(texts=TEXTS, prompts=PROMPTS)["scores"]
    torch.testing.assert_close(
        out,
        manual_scores(single, single.judge_inputs(TEXTS, [{}] * 4, PROMPTS)),
        atol=1e-5,
        rtol=1e-5,
    )
    with pytest.raises(ValueError, match="score word 'é' is not in the judge's vocabulary"):
        JudgeReward(str(tmp_path), score_words={"y": 1.0, "é": 0.0}).setup()


def test_judge_from_a_local_dir_matches_the_tiny_one(tmp_path, judge):
    judge.model.save_pretrained(tmp_path)
    judge.tokenizer.save_pretrained(tmp_path)
    loaded = JudgeReward(str(tmp_path))
    torch.testing.assert_close(
        loaded.run(texts=TEXTS, prompts=PROMPTS)["scores"],
        judge.run(texts=TEXTS, prompts=PROMPTS)["scores"],
        atol=1e-5,
        rtol=1e-5,
    )
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        JudgeReward(str(tmp_path / "missing"))


def test_judge_refuses_a_sequence_classifier_dir(tmp_path):
    from nodes.rewards import RewardModel

    rm = RewardModel(config={"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16})
    rm.model.save_pretrained(tmp_path)
    rm.tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2ForSequenceClassification .* not a causal LM"):
        JudgeReward(str(tmp_path)).setup()
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        JudgeReward(str(tmp_path)).setup()


def test_judge_nan_is_refused_or_skipped():
    j = JudgeReward("tiny", name="nj")
    with torch.no_grad():
        j.model.lm_head.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="node 'nj': sample 0 got a non-finite score nan"):
        j.run(texts=["a", "b"], prompts=["p", "q"])
    j.on_bad_sample = "skip"
    out = j.run(texts=["a", "b"], prompts=["p", "q"])
    assert out["scores"].tolist() == [0.0, 0.0] and j.last_bad_count == 2


def test_judge_chat_template_needs_one_in_the_dir(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = char_tokenizer()
    GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tok), n_layer=1, n_head=2, n_embd=16)
    ).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match="node 'cj': chat_template=True, but the judge in .* has no"
    ):
        JudgeReward(
            str(tmp_path), score_words={"y": 1, "n": 0}, chat_template=True, name="cj"
        ).setup()


def test_a_vlm_judge_reads_the_images(tmp_path):
    from PIL import Image

    from nodes.models.hf_vlm import tiny_qwen2_vl

    tiny_qwen2_vl(seed=0).save_pretrained(tmp_path)
    j = JudgeReward(
        str(tmp_path),
        template="{response} ?",
        meta_keys=(),
        score_words={"Y": 1, "N": 0},
        max_batch=2,
    )
    assert j.needs_images and not j.needs_prompts and not JudgeReward("tiny").needs_images
    red, blue = Image.new("RGB", (32, 32), (255, 0, 0)), Image.new("RGB", (32, 32), (0, 0, 255))
    texts, images = ["red", "red", "a blue one"], [red, blue, Image.new("RGB", (40, 30), "green")]
    scores = j.run(texts=texts, images=images)["scores"]
    assert ((scores > 0) & (scores < 1)).all()
    assert scores[0] != scores[1]  # same text, other image
    alone = torch.cat([j.run(texts=[t], images=[im])["scores"] for t, im in zip(texts, images)])
    torch.testing.assert_close(alone, scores, atol=1e-5, rtol=1e-5)
    text_only = j.run(texts=texts)["scores"]  # a VLM judge also judges without images
    assert text_only[0] == pytest.approx(float(text_only[1]), abs=1e-6)
    assert not torch.allclose(text_only, scores)


def test_a_token_budget_cuts_the_judges_and_the_reward_models_passes_and_keeps_the_scores():
    from nodes.batches import length_parts
    from nodes.rewards.models import RewardModel

    assert length_parts([3, 9, 4, 9, 1], budget=20) == [[1, 3], [2, 0, 4]]  # 2 x 9, 3 x 4
    assert length_parts([3, 9, 4], budget=20, max_rows=1) == [[1], [2], [0]]
    assert length_parts([30, 2], budget=20) == [[0], [1]]  # a longer text alone
    texts = ["red", "a blue square " * 6, "green", "it is a yellow circle"]
    meta = [{"answer": "red"}] * 4
    prompts = ["what color?"] * 4
    judge, budgeted = JudgeReward("tiny"), JudgeReward("tiny", micro_batch_tokens=24)
    judge.setup(), budgeted.setup()  # (score_samples is what run() calls once set up)
    assert len(budgeted._parts(budgeted.judge_inputs(texts, meta, prompts))) > 1
    torch.testing.assert_close(
        budgeted.score_samples(texts, meta, prompts, None),
        judge.score_samples(texts, meta, prompts, None), atol=1e-5, rtol=1e-5,
    )  # fmt: skip
    config = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32}
    model, split = RewardModel(config=config), RewardModel(config=config, micro_batch_tokens=40)
    model.setup(), split.setup()
    torch.testing.assert_close(
        split.score_samples(texts, meta, prompts, None),
        model.score_samples(texts, meta, prompts, None), atol=1e-5, rtol=1e-5,
    )  # fmt: skip
    with pytest.raises(ValueError, match="micro_batch_tokens >= 0"):
        RewardModel(config=config, micro_batch_tokens=-1)
