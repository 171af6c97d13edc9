"""Tests for nodes.rl.advantages and nodes.rl.masked: hand-computed cases, float64 reference loops,
padding that never leaks, and clear errors for bad input."""

from __future__ import annotations

import math
import re
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from masked_helpers import fill_padding, ragged_mask

from nodes.rl.advantages import (
    apply_kl_to_rewards,
    broadcast_to_tokens,
    compute_gae,
    grpo_advantages,
    kl_penalty,
    rloo_advantages,
)
from nodes.rl.masked import masked_mean, masked_sum, masked_var, masked_whiten

NAN = float("nan")
INF = float("inf")


# ---------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------


def test_gae_hand_computed():
    # gamma = 0.5, lam = 0.5, so gamma * lam = 0.25; the value after the last real token is 0.
    # row 0 (3 real tokens): r = [1, 0, 2], V = [0.5, 1.0, 1.5]
    #   t=2: delta = 2 + 0.5*0   - 1.5 =  0.5  ; A2 =  0.5
    #   t=1: delta = 0 + 0.5*1.5 - 1.0 = -0.25 ; A1 = -0.25 + 0.25*0.5    = -0.125
    #   t=0: delta = 1 + 0.5*1.0 - 0.5 =  1.0  ; A0 =  1.0  + 0.25*-0.125 =  0.96875
    #   returns = A + V = [1.46875, 0.875, 2.0]
    # row 1 (2 real tokens, then padding holding junk): r = [0, 3, 99], V = [2, 1, -50]
    #   t=1: delta = 3 + 0      - 1 =  2   ; A1 =  2
    #   t=0: delta = 0 + 0.5*1  - 2 = -1.5 ; A0 = -1.5 + 0.25*2 = -1.0
    #   returns = [1.0, 3.0, 0 (padding)]
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 99.0]])
    values = torch.tensor([[0.5, 1.0, 1.5], [2.0, 1.0, -50.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.5, lam=0.5)
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(
        advantages, torch.tensor([[0.96875, -0.125, 0.5], [-1.0, 2.0, 0.0]]), rtol=0, atol=1e-7
    )
    torch.testing.assert_close(
        returns, torch.tensor([[1.46875, 0.875, 2.0], [1.0, 3.0, 0.0]]), rtol=0, atol=1e-7
    )


def gae_reference(rewards, values, mask, gamma, lam):
    """Plain Python loop over each row's real tokens, in float64."""
    B, T = rewards.shape
    advantages = torch.zeros(B, T, dtype=torch.float64)
    returns = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        real = [t for t in range(T) if mask[b, t] != 0]
        next_value, next_advantage = 0.0, 0.0
        for t in reversed(real):
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            next_advantage = delta + gamma * lam * next_advantage
            next_value = float(values[b, t])
            advantages[b, t] = next_advantage
            returns[b, t] = next_advantage + next_value
    return advantages, returns


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0), (0.0, 0.5)])
def test_gae_matches_float64_reference_on_ragged_batch(gamma, lam):
    g = torch.Generator().manual_seed(0)
    lengths = [7, 1, 0, 4, 7, 3]  # ragged, with a full row, a 1-token row and an empty row
    B, T = len(lengths), 7
    mask = ragged_mask(lengths, T)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
    assert advantages.dtype == torch.float64 and returns.dtype == torch.float64
    ref_advantages, ref_returns = gae_reference(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages, ref_advantages, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns, ref_returns, rtol=1e-12, atol=1e-12)


def test_gae_skips_holes_in_a_non_contiguous_mask():
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 1, 1, 0, 1]])  # gaps link to the next real token
    rewards = torch.randn(2, 5, generator=g, dtype=torch.float64)
    values = torch.randn(2, 5, generator=g, dtype=torch.float64)
    advantages, returns = compute_gae(rewards, values, mask, 0.9, 0.8)
    ref_advantages, ref_returns = gae_reference(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(advantages, ref_advantages, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns, ref_returns, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("junk", [NAN, INF, -INF, 1e30])
def test_gae_padding_never_leaks(junk):
    g = torch.Generator().manual_seed(2)
    mask = ragged_mask([5, 2, 3], 5)
    rewards = torch.randn(3, 5, generator=g)
    values = torch.randn(3, 5, generator=g)
    clean_advantages, clean_returns = compute_gae(rewards, values, mask, 0.99, 0.95)

    dirty_rewards = fill_padding(rewards, mask, junk).requires_grad_()
    dirty_values = fill_padding(values, mask, junk).requires_grad_()
    advantages, returns = compute_gae(dirty_rewards, dirty_values, mask, 0.99, 0.95)
    assert torch.equal(advantages, clean_advantages)
    assert torch.equal(returns, clean_returns)
    assert torch.all(advantages[mask == 0] == 0) and torch.all(returns[mask == 0] == 0)

    (advantages.sum() + returns.sum()).backward()
    for grad in (dirty_rewards.grad, dirty_values.grad):
        assert torch.isfinite(grad).all()
        assert torch.all(grad[mask == 0] == 0)


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_gae_with_gamma_lam_one_is_reward_to_go_minus_value(lengths, seed):
    # With gamma = lam = 1 the GAE telescopes: A_t = sum_{k >= t} r_k - V_t, returns = reward-to-go.
    g = torch.Generator().manual_seed(seed)
    T = 6
    mask = ragged_mask(lengths, T)  # (B, T)
    rewards = torch.randn(len(lengths), T, generator=g, dtype=torch.float64) * mask
    values = torch.randn(len(lengths), T, generator=g, dtype=torch.float64) * mask
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = rewards.flip(1).cumsum(1).flip(1) * mask  # (B, T)
    torch.testing.assert_close(returns, reward_to_go, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(advantages, (reward_to_go - values) * mask, rtol=1e-10, atol=1e-10)


def test_gae_bad_input():
    mask = torch.ones(4, 7)
    with pytest.raises(ValueError) as info:
        compute_gae(torch.zeros(4, 7), torch.zeros(4, 6), mask, 1.0, 0.95)
    assert str(info.value) == (
        "compute_gae: rewards has shape (4, 7) but values has shape (4, 6); both must be (B, T)"
    )
    with pytest.raises(ValueError, match=r"compute_gae: rewards has shape \(4, 7\) but mask"):
        compute_gae(torch.zeros(4, 7), torch.zeros(4, 7), torch.ones(4, 6), 1.0, 0.95)
    rewards = torch.zeros(4, 7)
    rewards[2, 5] = NAN
    with pytest.raises(ValueError, match=r"compute_gae: rewards .*\(nan\) at sample 2, token 5"):
        compute_gae(rewards, torch.zeros(4, 7), mask, 1.0, 0.95)
    rewards[2, 5] = INF
    with pytest.raises(ValueError, match=r"compute_gae: rewards .*\(inf\) at sample 2"):
        compute_gae(rewards, torch.zeros(4, 7), mask, 1.0, 0.95)
    values = torch.zeros(4, 7)
    values[3, 0] = NAN
    with pytest.raises(ValueError, match=r"compute_gae: values .* at sample 3, token 0"):
        compute_gae(torch.zeros(4, 7), values, mask, 1.0, 0.95)
    with pytest.raises(ValueError, match=r"compute_gae: rewards is empty \(shape \(0, 7\)\)"):
        compute_gae(torch.zeros(0, 7), torch.zeros(0, 7), torch.ones(0, 7), 1.0, 0.95)
    with pytest.raises(ValueError, match=r"compute_gae: rewards has shape \(7,\); it must be 2-D"):
        compute_gae(torch.zeros(7), torch.zeros(7), torch.ones(7), 1.0, 0.95)
    with pytest.raises(ValueError, match=r"compute_gae: mask must hold only 0 and 1"):
        compute_gae(torch.zeros(4, 7), torch.zeros(4, 7), mask * 0.5, 1.0, 0.95)
    with pytest.raises(ValueError, match=r"compute_gae: gamma is 1.5"):
        compute_gae(torch.zeros(4, 7), torch.zeros(4, 7), mask, 1.5, 0.95)
    with pytest.raises(ValueError, match=r"compute_gae: lam is -0.1"):
        compute_gae(torch.zeros(4, 7), torch.zeros(4, 7), mask, 1.0, -0.1)
    with pytest.raises(ValueError, match=r"compute_gae: rewards has dtype torch.int64"):
        compute_gae(torch.zeros(4, 7, dtype=torch.long), torch.zeros(4, 7), mask, 1.0, 0.95)


# ---------------------------------------------------------------------------------------------
# GRPO and RLOO
# ---------------------------------------------------------------------------------------------


def test_grpo_hand_computed_group_size():
    # group 0: [0, 1, 2]  -> mean 1, unbiased std sqrt((1 + 0 + 1) / 2) = 1 -> [-1, 0, 1]
    # group 1: [4, 4, 10] -> mean 6, deviations [-2, -2, 4],
    #          unbiased std sqrt((4 + 4 + 16) / 2) = sqrt(12) = 3.4641016 -> [-0.57735, -0.57735, 1.1547]
    scores = torch.tensor([0.0, 1.0, 2.0, 4.0, 4.0, 10.0])
    advantages = grpo_advantages(scores, 3, eps=0.0)
    s12 = math.sqrt(12.0)
    expected = torch.tensor([-1.0, 0.0, 1.0, -2 / s12, -2 / s12, 4 / s12])
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-6)
    # default eps = 1e-6 divides by (std + eps)
    torch.testing.assert_close(
        grpo_advantages(scores, 3)[:3], torch.tensor([-1.0, 0.0, 1.0]) / (1 + 1e-6)
    )
    # Dr. GRPO: no std normalization, only the group mean removed
    torch.testing.assert_close(
        grpo_advantages(scores, 3, normalize_std=False),
        torch.tensor([-1.0, 0.0, 1.0, -2.0, -2.0, 4.0]),
    )


def test_grpo_hand_computed_group_ids_with_group_of_one_and_equal_scores():
    # ids 1: {3, 1} -> mean 2, std sqrt(2) -> [+0.70711, -0.70711]
    # ids 2: {10}   -> a group of one gets 0
    # ids 9: {7, 5} -> mean 6, std sqrt(2) -> [+0.70711, -0.70711]
    # ids 4: {8, 8} -> all equal: 0 (the eps keeps 0 / 0 away)
    scores = torch.tensor([3.0, 10.0, 1.0, 7.0, 5.0, 8.0, 8.0])
    group_ids = torch.tensor([1, 2, 1, 9, 9, 4, 4])
    advantages = grpo_advantages(scores, group_ids=group_ids)
    r = 1 / math.sqrt(2)
    torch.testing.assert_close(
        advantages, torch.tensor([r, 0.0, -r, r, -r, 0.0, 0.0]), rtol=0, atol=1e-5
    )
    assert advantages[1] == 0
    # group_size=1: every sample is alone
    assert torch.equal(grpo_advantages(scores, 1), torch.zeros(7))


def grpo_reference(scores, group_ids, eps):
    out = torch.zeros(len(scores), dtype=torch.float64)
    for gid in set(group_ids):
        members = [i for i, x in enumerate(group_ids) if x == gid]
        values = [float(scores[i]) for i in members]
        if len(values) == 1:
            continue
        mean, std = statistics.fmean(values), statistics.stdev(values)
        for i in members:
            out[i] = (float(scores[i]) - mean) / (std + eps)
    return out


def rloo_reference(scores, group_ids):
    out = torch.zeros(len(scores), dtype=torch.float64)
    for i, gid in enumerate(group_ids):
        others = [float(scores[j]) for j, x in enumerate(group_ids) if x == gid and j != i]
        out[i] = float(scores[i]) - sum(others) / len(others)
    return out


def test_grpo_and_rloo_match_float64_reference_on_shuffled_groups():
    g = torch.Generator().manual_seed(3)
    group_ids = [5, 0, 5, 2, 0, 2, 5, 2, 0, 7, 7, 2]  # ragged group sizes, any order
    scores = torch.randn(len(group_ids), generator=g, dtype=torch.float64)
    ids = torch.tensor(group_ids)
    grpo = grpo_advantages(scores, group_ids=ids)
    assert grpo.dtype == torch.float64
    torch.testing.assert_close(
        grpo, grpo_reference(scores, group_ids, 1e-6), rtol=1e-12, atol=1e-12
    )
    rloo = rloo_advantages(scores, group_ids=ids)
    torch.testing.assert_close(rloo, rloo_reference(scores, group_ids), rtol=1e-12, atol=1e-12)
    # contiguous group_size gives the same as the equivalent labels
    contiguous = [b // 4 for b in range(12)]
    torch.testing.assert_close(
        grpo_advantages(scores, 4), grpo_reference(scores, contiguous, 1e-6), rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(
        rloo_advantages(scores, 4), rloo_reference(scores, contiguous), rtol=1e-12, atol=1e-12
    )


def test_rloo_hand_computed():
    # group 0: [1, 2, 6] -> 1 - (2+6)/2 = -3 ; 2 - (1+6)/2 = -1.5 ; 6 - (1+2)/2 = 4.5
    # group 1: [0, 4, 4] -> 0 - (4+4)/2 = -4 ; 4 - (0+4)/2 =  2   ; 4 - (0+4)/2 = 2
    scores = torch.tensor([1.0, 2.0, 6.0, 0.0, 4.0, 4.0])
    torch.testing.assert_close(
        rloo_advantages(scores, 3), torch.tensor([-3.0, -1.5, 4.5, -4.0, 2.0, 2.0])
    )


def test_reinforce_pp_advantages_hand_computed():
    from nodes.rl.advantages import reinforce_pp_advantages, reinforce_pp_baseline_advantages

    # scores [1, 0 | 1, 1] in groups [0, 0 | 1, 1]
    scores, groups = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    # REINFORCE++: batch mean 0.75 -> [0.25, -0.75, 0.25, 0.25]; unbiased std sqrt(0.75 / 3) = 0.5
    torch.testing.assert_close(
        reinforce_pp_advantages(scores, group_ids=groups), torch.tensor([0.5, -1.5, 0.5, 0.5]),
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip
    # -baseline: group means [0.5, 1] -> [0.5, -0.5, 0, 0]; batch std sqrt(0.5 / 3)
    s = math.sqrt(0.5 / 3)
    torch.testing.assert_close(
        reinforce_pp_baseline_advantages(scores, group_ids=groups),
        torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0]), rtol=1e-5, atol=1e-5,
    )  # fmt: skip


@settings(max_examples=50, deadline=None)
@given(
    n_groups=st.integers(1, 4),
    group_size=st.integers(2, 5),
    seed=st.integers(0, 2**16),
)
def test_group_advantages_properties(n_groups, group_size, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n_groups * group_size, generator=g, dtype=torch.float64)
    grpo = grpo_advantages(scores, group_size, eps=0.0).view(n_groups, group_size)
    torch.testing.assert_close(grpo.mean(1), torch.zeros(n_groups, dtype=torch.float64))
    torch.testing.assert_close(grpo.std(1), torch.ones(n_groups, dtype=torch.float64))
    # RLOO sums to 0 in each group and equals G/(G-1) * (r - mean)
    rloo = rloo_advantages(scores, group_size).view(n_groups, group_size)
    torch.testing.assert_close(rloo.sum(1), torch.zeros(n_groups, dtype=torch.float64))
    centred = scores.view(n_groups, group_size) - scores.view(n_groups, group_size).mean(1, True)
    torch.testing.assert_close(rloo, centred * group_size / (group_size - 1))


def test_group_advantages_bad_input():
    scores = torch.tensor([1.0, 2.0, NAN, 4.0])
    with pytest.raises(ValueError, match=r"grpo_advantages: scores .*\(nan\) at sample 2"):
        grpo_advantages(scores, 2)
    with pytest.raises(ValueError, match=r"rloo_advantages: scores .*\(nan\) at sample 2"):
        rloo_advantages(scores, 2)
    scores = torch.arange(6.0)
    with pytest.raises(
        ValueError,
        match=r"grpo_advantages: scores has 6 samples, which is not a multiple of group_size 4",
    ):
        grpo_advantages(scores, 4)
    with pytest.raises(ValueError, match=r"grpo_advantages: pass exactly one of group_size"):
        grpo_advantages(scores)
    with pytest.raises(ValueError, match=r"grpo_advantages: pass exactly one of group_size"):
        grpo_advantages(scores, 2, group_ids=torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"grpo_advantages: group_size must be an int"):
        grpo_advantages(scores, torch.zeros(6, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"grpo_advantages: scores has shape \(6,\) but group_ids has shape \(5,\)"
    ):
        grpo_advantages(scores, group_ids=torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"grpo_advantages: group_ids has dtype torch.float32"):
        grpo_advantages(scores, group_ids=torch.zeros(6))
    with pytest.raises(ValueError, match=r"grpo_advantages: scores is empty"):
        grpo_advantages(torch.zeros(0), 1)
    with pytest.raises(
        ValueError, match=r"grpo_advantages: scores has shape \(2, 3\); it must be 1-D"
    ):
        grpo_advantages(torch.zeros(2, 3), 3)
    with pytest.raises(
        ValueError,
        match=r"rloo_advantages: group_size is 1; the leave-one-out baseline needs at least 2",
    ):
        rloo_advantages(scores, 1)
    with pytest.raises(
        ValueError,
        match=r"rloo_advantages: group_ids has 1 group\(s\) with a single sample \(labels \[7\]\)",
    ):
        rloo_advantages(scores, group_ids=torch.tensor([0, 0, 7, 1, 1, 1]))
    with pytest.raises(ValueError, match=r"rloo_advantages: scores is empty"):
        rloo_advantages(torch.zeros(0), 2)


def test_broadcast_to_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    per_sample = torch.tensor([2.0, -1.0, NAN])  # an empty row may hold anything
    expected = torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(broadcast_to_tokens(per_sample, mask), expected)
    with pytest.raises(
        ValueError,
        match=r"broadcast_to_tokens: per_sample has shape \(2,\) but mask has shape \(3, 3\)",
    ):
        broadcast_to_tokens(torch.zeros(2), mask)
    with pytest.raises(ValueError, match=r"broadcast_to_tokens: per_sample .*\(nan\) at sample 0"):
        broadcast_to_tokens(torch.tensor([NAN, 1.0, 1.0]), mask)


# ---------------------------------------------------------------------------------------------
# KL
# ---------------------------------------------------------------------------------------------


def test_kl_penalty_hand_computed():
    # log_ratio = logprobs - ref_logprobs = [0.5, -1.0]; the third token is padding.
    # k1 = [0.5, -1.0]; k2 = 0.5 * lr^2 = [0.125, 0.5]; abs = [0.5, 1.0]
    # k3 = exp(-lr) - 1 + lr = [exp(-0.5) - 0.5, exp(1) - 2] = [0.1065307, 0.7182818]
    logprobs = torch.tensor([[-1.0, -2.0, NAN]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, 3.0]])
    mask = torch.tensor([[True, True, False]])
    expected = {
        "k1": [0.5, -1.0, 0.0],
        "k2": [0.125, 0.5, 0.0],
        "k3": [math.exp(-0.5) - 0.5, math.e - 2, 0.0],
        "abs": [0.5, 1.0, 0.0],
    }
    for kind, values in expected.items():
        kl = kl_penalty(logprobs, ref_logprobs, mask, kind=kind)
        torch.testing.assert_close(kl, torch.tensor([values]), rtol=0, atol=1e-6)
    with pytest.raises(
        ValueError,
        match=r"kl_penalty: kind is 'k4': not a registered KL estimator; choose one of k1, k2, k3",
    ):
        kl_penalty(logprobs, ref_logprobs, mask, kind="k4")
    with pytest.raises(
        ValueError,
        match=r"kl_penalty: logprobs has shape \(1, 3\) but ref_logprobs has shape \(1, 2\)",
    ):
        kl_penalty(logprobs, ref_logprobs[:, :2], mask)
    with pytest.raises(ValueError, match=r"kl_penalty: logprobs .*\(nan\) at sample 0, token 2"):
        kl_penalty(logprobs, ref_logprobs, torch.ones(1, 3))


def test_apply_kl_to_rewards_hand_computed():
    # coef = 0.5: token rewards are -0.5 * kl, and each score goes on its row's last real token.
    # row 0: kl [0.1, 0.2, 0.3], 3 real -> [-0.05, -0.1, -0.15 + 2]
    # row 1: kl [0.4, 0.5, pad], 2 real -> [-0.2, -0.25 + 5, 0]
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    shaped = apply_kl_to_rewards(torch.tensor([2.0, 5.0]), kl, mask, coef=0.5)
    torch.testing.assert_close(shaped, torch.tensor([[-0.05, -0.1, 1.85], [-0.2, 4.75, 0.0]]))
    # (B, T) per-token rewards are added token by token
    token_rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, NAN]])
    shaped = apply_kl_to_rewards(token_rewards, kl, mask, coef=0.5)
    torch.testing.assert_close(shaped, torch.tensor([[0.95, -0.1, -0.15], [-0.2, 0.75, 0.0]]))


def test_apply_kl_to_rewards_bad_input():
    kl = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    with pytest.raises(
        ValueError, match=r"apply_kl_to_rewards: sample 1 has no real token in mask"
    ):
        apply_kl_to_rewards(torch.tensor([1.0, 2.0]), kl, mask, 0.1)
    with pytest.raises(ValueError, match=r"apply_kl_to_rewards: rewards .*\(nan\) at sample 1"):
        apply_kl_to_rewards(torch.tensor([1.0, NAN]), kl, torch.ones(2, 3), 0.1)
    with pytest.raises(
        ValueError, match=r"apply_kl_to_rewards: rewards has shape \(3,\) but kl has shape \(2, 3\)"
    ):
        apply_kl_to_rewards(torch.zeros(3), kl, mask, 0.1)
    with pytest.raises(
        ValueError,
        match=r"apply_kl_to_rewards: kl has shape \(2, 3\) but rewards has shape \(2, 4\)",
    ):
        apply_kl_to_rewards(torch.zeros(2, 4), kl, mask, 0.1)
    with pytest.raises(ValueError, match=r"apply_kl_to_rewards: coef is -1"):
        apply_kl_to_rewards(torch.zeros(2), kl, torch.ones(2, 3), -1)


def test_kl_shaped_rewards_feed_gae_end_to_end():
    # score on the last real token + gamma = lam = 1: every real token's return is the score
    # minus the KL penalties still ahead of it.
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    rewards = apply_kl_to_rewards(torch.tensor([1.0], dtype=torch.float64), kl, mask, coef=1.0)
    _, returns = compute_gae(rewards, torch.zeros_like(rewards), mask, 1.0, 1.0)
    torch.testing.assert_close(returns, torch.tensor([[0.4, 0.5, 0.7, 0.0]], dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# masked helpers
# ---------------------------------------------------------------------------------------------


def test_masked_helpers_hand_computed_and_padding_free():
    # real entries: 1, 2, 3, 6 -> sum 12, mean 3, unbiased var ((4 + 1 + 0 + 9) / 3) = 14/3
    x = torch.tensor([[1.0, 2.0, NAN], [3.0, 6.0, INF]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert masked_sum(x, mask).item() == 12.0
    assert masked_mean(x, mask).item() == 3.0
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 4.5]))
    torch.testing.assert_close(masked_var(x, mask), torch.tensor(14 / 3))
    torch.testing.assert_close(masked_var(x, mask, unbiased=False), torch.tensor(3.5))
    whitened = masked_whiten(x, mask)
    real = whitened[mask.bool()]
    torch.testing.assert_close(real, (torch.tensor([1.0, 2.0, 3.0, 6.0]) - 3) / math.sqrt(14 / 3))
    assert torch.all(whitened[~mask.bool()] == 0)
    torch.testing.assert_close(
        masked_whiten(x, mask, shift_mean=False)[mask.bool()].mean(), torch.tensor(3.0)
    )
    (masked_mean(x, mask) + masked_var(x, mask) + whitened.sum()).backward()
    assert torch.isfinite(x.grad).all() and torch.all(x.grad[~mask.bool()] == 0)
    # an empty slice has mean 0 when reducing over a dim
    torch.testing.assert_close(
        masked_mean(torch.ones(2, 2), torch.tensor([[1, 1], [0, 0]]), dim=1),
        torch.tensor([1.0, 0.0]),
    )


def test_masked_helpers_bad_input():
    with pytest.raises(
        ValueError, match=r"masked_mean: mask has 0 real \(mask=1\) token\(s\); need at least 1"
    ):
        masked_mean(torch.ones(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"masked_var: mask has 1 real .*need at least 2"):
        masked_var(torch.ones(2, 2), torch.tensor([[1, 0], [0, 0]]))
    with pytest.raises(
        ValueError, match=r"masked_mean: x has shape \(2, 2\) but mask has shape \(2, 3\)"
    ):
        masked_mean(torch.ones(2, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"masked_whiten: mask must hold only 0 and 1"):
        masked_whiten(torch.ones(2, 2), torch.full((2, 2), 2.0))
    with pytest.raises(ValueError, match=r"masked_sum: x must be a torch.Tensor, got list"):
        masked_sum([1.0], torch.ones(1))


def test_error_messages_name_the_function_first():
    # every message starts with "<function>: " so a graph node can pass it on unchanged
    with pytest.raises(ValueError) as info:
        rloo_advantages(torch.zeros(3), 3, group_ids=torch.zeros(3, dtype=torch.long))
    assert re.match(r"^rloo_advantages: ", str(info.value))
