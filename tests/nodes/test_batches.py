"""Cutting a batch by a token budget: padded, or packed (each row's own tokens)."""

import torch

from nodes.batches import View, token_budget_parts


def _view(prompt_lengths, response_lengths, P=8, R=8):
    prompt_mask = torch.tensor([[0] * (P - p) + [1] * p for p in prompt_lengths])  # left-padded
    real = torch.tensor([[1] * r + [0] * (R - r) for r in response_lengths]).bool()
    t = {"prompt_ids": prompt_mask.clone(), "prompt_mask": prompt_mask,
         "response_ids": real.long(), "response_mask": real.float()}  # fmt: skip
    return View(t, real, None, None, 1)


def test_a_padded_budget_counts_rows_times_the_longest_and_a_packed_one_each_rows_tokens():
    view = _view([8, 2, 2, 2], [8, 2, 2, 2])  # one long row, three short ones
    # padded: the long row (16 tokens) with any other makes 2 x 16 > 20
    assert token_budget_parts(view, 20) == [[0], [1, 2, 3]]
    # packed: 16 + 4 = 20 fits, then 4 + 4 more
    assert token_budget_parts(view, 20, packed=True) == [[0, 1], [2, 3]]
    assert token_budget_parts(view, 20, max_rows=2, packed=True) == [[0, 1], [2, 3]]
    assert token_budget_parts(view, 8, packed=True) == [[0], [1, 2], [3]]  # a large row alone
