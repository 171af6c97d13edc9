"""GreedyValidation's sampled passes (avg@k, pass@k) and the pass@k estimator."""

from __future__ import annotations

import json
import math

import pytest

from nodes.validation import GreedyValidation, pass_at_k

# The reward reads only the row: 1 for a red shape, 0.25 otherwise, whatever the response,
# so the figures of a pass follow from the data file alone.
ROW_REWARD = """
def score(text, meta):
    return 1.0 if meta["answer"] == "red" else 0.25
"""


def test_pass_at_k_is_the_unbiased_estimator_of_chen_et_al():
    # n == k: any of the k succeeds
    assert [pass_at_k(4, c, 4) for c in range(5)] == [0.0, 1.0, 1.0, 1.0, 1.0]
    # n = 5, c = 2, k = 2: 1 - C(3, 2) / C(5, 2) = 1 - 3 / 10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # pass@1 is the success rate
    with pytest.raises(ValueError, match="need 0 <= c <= n and 1 <= k <= n"):
        pass_at_k(3, 1, 4)


@pytest.fixture
def rows(tmp_path):
    answers = ["red", "blue", "red", "green", "yellow"]
    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps({"prompt": "what colour?", "answer": a}) + "\n"
                            for a in answers))  # fmt: skip
    (tmp_path / "rewards.py").write_text(ROW_REWARD)
    return str(data), f"{tmp_path / 'rewards.py'}:score", answers


def _node(rows, **options):
    data, reward, _ = rows
    spec = {"name": "tiny-qwen2", "seed": 0}
    return GreedyValidation(spec, data, reward, max_new_tokens=2, batch_size=3, **options)


def test_k_samples_a_row_give_avg_and_pass_at_k_scored_against_their_own_rows(rows):
    answers = rows[2]
    node = _node(rows, samples=3, temperature=1.0, top_p=0.9)
    node.setup()
    val = node.forward()["val"]
    red = sum(a == "red" for a in answers) / len(answers)
    assert set(val) == {"greedy", "avg@3", "pass@3", "samples", "response_length"}
    assert val["samples"] == len(answers)
    expected = red * 1.0 + (1 - red) * 0.25
    assert val["greedy"] == pytest.approx(expected) and val["avg@3"] == pytest.approx(expected)
    assert val["pass@3"] == pytest.approx(red)  # a red row passes (1 >= 1), the others never
    greedy = _node(rows)  # samples=1: today's figures, under today's names
    greedy.setup()
    assert set(greedy.forward()["val"]) == {"reward", "samples", "response_length"}


def test_every_pass_draws_the_same_samples_and_the_threshold_decides_a_pass(rows, tmp_path):
    (tmp_path / "lengths.py").write_text("def score(text, meta):\n    return float(len(text))\n")
    reward = f"{tmp_path / 'lengths.py'}:score"
    figures = []
    for threshold in (0.0, 1e9):
        node = _node((rows[0], reward, rows[2]), samples=4, pass_threshold=threshold, every=1)
        node.setup()
        first, again = node.forward()["val"], node.forward()["val"]
        assert first == again  # the same weights: the same samples, the same figures
        figures.append(first)
    assert figures[0]["pass@4"] == 1.0 and figures[1]["pass@4"] == 0.0
    assert figures[0]["avg@4"] == figures[1]["avg@4"]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"samples": 0}, "samples must be an int >= 1, got 0"),
        ({"samples": 2.5}, "samples must be an int >= 1, got 2.5"),
        ({"temperature": -1.0}, "the samples' temperature=-1.0; it must be 0 \\(greedy\\) or"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"pass_threshold": math.nan}, "pass_threshold must be a finite reward"),
    ],
)
def test_bad_sampling_options_are_one_line_errors(rows, options, match):
    with pytest.raises(ValueError, match=match) as info:
        _node(rows, **options)
    assert "\n" not in str(info.value)
