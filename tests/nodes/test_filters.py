"""Dynamic sampling's filter: the first informative groups kept whole, per prompt rows with
them, and what happens when too few or none differ."""

import pytest
import torch

from nodes.filters import KeepGroups


def _step(scores: list[float], n: int = 2) -> dict:
    B = len(scores)
    return {
        "scores": torch.tensor(scores, dtype=torch.float32),
        "group_ids": torch.arange(B // n).repeat_interleave(n) + 10,
        "response_ids": torch.arange(B)[:, None].repeat(1, 3),
        "texts": [f"t{i}" for i in range(B)],
        "image_embeds": torch.arange(B // n, dtype=torch.float32)[:, None].repeat(1, 4),
    }


def test_the_first_groups_whose_scores_differ_are_kept_whole_in_order():
    # groups: flat, differ, differ, flat, differ
    inputs = _step([1, 1, 0, 1, 1, 0, 0, 0, 0.5, 0])
    node = KeepGroups(2, rows=["response_ids", "texts"], prompts=["image_embeds"])
    out = node.run(inputs)
    assert out["response_ids"][:, 0].tolist() == [2, 3, 4, 5]  # groups 1 and 2, whole
    assert out["texts"] == ["t2", "t3", "t4", "t5"]
    assert out["image_embeds"][:, 0].tolist() == [1.0, 2.0]  # their prompts' rows
    assert out["group_ids"].tolist() == [11, 11, 12, 12] and out["scores"].tolist() == [0, 1, 1, 0]
    assert out["stats"] == {"drawn_groups": 5.0, "informative_groups": 3.0, "kept_groups": 2.0}


def test_too_few_informative_groups_make_a_smaller_step_and_none_the_first_groups():
    few = KeepGroups(4, rows=["response_ids"]).run(
        {k: v for k, v in _step([1, 1, 0, 1, 0, 0]).items() if k in ("scores", "group_ids", "response_ids")}
    )  # fmt: skip
    assert few["response_ids"][:, 0].tolist() == [2, 3] and few["stats"]["kept_groups"] == 1.0
    none = KeepGroups(2).run(
        {"scores": torch.zeros(6), "group_ids": torch.tensor([0, 0, 1, 1, 2, 2])}
    )
    assert none["group_ids"].tolist() == [0, 0, 1, 1] and none["stats"]["informative_groups"] == 0.0


def test_what_it_cannot_carry_or_cut_is_refused():
    with pytest.raises(ValueError, match="carries no port \\['advantages'\\]"):
        KeepGroups(2, rows=["advantages"])
    with pytest.raises(ValueError, match="keep=0"):
        KeepGroups(0)
    with pytest.raises(ValueError, match="5 rows in 2 groups"):
        KeepGroups(1).run({"scores": torch.zeros(5), "group_ids": torch.tensor([0, 0, 0, 1, 1])})
