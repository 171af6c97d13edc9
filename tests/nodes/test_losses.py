"""Tests for nodes.rl.losses: the formulas on crafted inputs (clipping active and not), float64
reference loops, padding that never leaks (values nor gradients), and clear errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from masked_helpers import fill_padding, ragged_mask

from nodes.rl.losses import (
    POLICY_LOSSES,
    aggregate_token_loss,
    entropy_from_logits,
    grpo_loss,
    gspo_policy_loss,
    importance_weights,
    kl_loss,
    logprobs_from_logits,
    ppo_policy_loss,
    token_entropy_from_logits,
    truncated_is_weights,
    value_loss,
)

NAN = float("nan")
INF = float("inf")


# ---------------------------------------------------------------------------------------------
# PPO policy loss
# ---------------------------------------------------------------------------------------------


def test_ppo_policy_loss_not_clipped():
    # ratio = [1.1, 0.9], inside [0.8, 1.2], A = [1, -1]:
    #   token 0: max(-1 * 1.1, -1 * 1.1) = -1.1 ; token 1: max(1 * 0.9, 1 * 0.9) = 0.9
    #   loss = (-1.1 + 0.9) / 2 = -0.1 ; nothing clipped
    # approx_kl = mean(r - 1 - log r) = ((0.1 - log 1.1) + (-0.1 - log 0.9)) / 2
    logprobs = torch.log(torch.tensor([[1.1, 0.9]])).requires_grad_()
    old_logprobs = torch.zeros(1, 2)
    advantages = torch.tensor([[1.0, -1.0]])
    loss, stats = ppo_policy_loss(logprobs, old_logprobs, advantages, torch.ones(1, 2))
    torch.testing.assert_close(loss, torch.tensor(-0.1))
    assert stats["clip_fraction"].item() == 0.0
    torch.testing.assert_close(stats["ratio_mean"], torch.tensor(1.0))
    expected_kl = ((0.1 - math.log(1.1)) + (-0.1 - math.log(0.9))) / 2
    torch.testing.assert_close(stats["approx_kl"], torch.tensor(expected_kl))
    # unclipped: d loss / d logprob_t = -A_t * ratio_t / n = [-0.55, 0.45]
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.55, 0.45]]))


def test_ppo_policy_loss_clipped():
    # ratio = [1.5, 0.5, 1.5, 0.5], A = [1, -1, -1, 1], clip to [0.8, 1.2]; 5th token is padding
    #   t0: max(-1.5, -1.2) = -1.2  clipped branch wins (gradient cut)
    #   t1: max( 0.5,  0.8) =  0.8  clipped branch wins
    #   t2: max( 1.5,  1.2) =  1.5  unclipped
    #   t3: max(-0.5, -0.8) = -0.5  unclipped
    #   loss = (-1.2 + 0.8 + 1.5 - 0.5) / 4 = 0.15 ; clip_fraction = 2/4 = 0.5
    # approx_kl = mean(r - 1 - log r) = ((0.5 - log 1.5) + (-0.5 + log 2)) / 2 = 0.1438410
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5, 1.0]])).requires_grad_()
    old_logprobs = torch.tensor([[0.0, 0.0, 0.0, 0.0, NAN]])
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0, INF]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = ppo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps=0.2)
    torch.testing.assert_close(loss, torch.tensor(0.15))
    assert stats["clip_fraction"].item() == 0.5
    torch.testing.assert_close(stats["ratio_mean"], torch.tensor(1.0))
    torch.testing.assert_close(
        stats["approx_kl"], torch.tensor(((0.5 - math.log(1.5)) + (-0.5 + math.log(2))) / 2)
    )
    # clipped tokens get no gradient; unclipped: -A_t * ratio_t / 4 = [1.5/4, -0.5/4]
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, 0.375, -0.125, 0.0]]))

    # DAPO clip-higher: upper bound 1.6, so t0 (ratio 1.5) is no longer clipped
    #   loss = (-1.5 + 0.8 + 1.5 - 0.5) / 4 = 0.075 ; clip_fraction = 1/4
    loss, stats = ppo_policy_loss(
        logprobs, old_logprobs, advantages, mask, clip_eps=0.2, clip_eps_high=0.6
    )
    torch.testing.assert_close(loss, torch.tensor(0.075))
    assert stats["clip_fraction"].item() == 0.25


def ppo_reference(logprobs, old_logprobs, advantages, mask, eps):
    """Per-token Python loop in float64: mean over real tokens of max(-A r, -A clip(r))."""
    total, n, clipped = 0.0, 0, 0
    for b in range(logprobs.shape[0]):
        for t in range(logprobs.shape[1]):
            if mask[b, t] == 0:
                continue
            r = math.exp(float(logprobs[b, t]) - float(old_logprobs[b, t]))
            a = float(advantages[b, t])
            unclipped, clipped_term = -a * r, -a * min(max(r, 1 - eps), 1 + eps)
            total += max(unclipped, clipped_term)
            clipped += clipped_term > unclipped
            n += 1
    return total / n, clipped / n


def test_ppo_policy_loss_matches_float64_reference_and_gradcheck():
    g = torch.Generator().manual_seed(0)
    mask = ragged_mask([6, 2, 5, 1], 6)
    logprobs = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 2
    old_logprobs = logprobs + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    advantages = torch.randn(4, 6, generator=g, dtype=torch.float64)
    loss, stats = ppo_policy_loss(logprobs, old_logprobs, advantages, mask)
    ref_loss, ref_clip_fraction = ppo_reference(logprobs, old_logprobs, advantages, mask, 0.2)
    assert loss.dtype == torch.float64
    assert 0 < ref_clip_fraction < 1  # the random case exercises both branches
    torch.testing.assert_close(loss, torch.tensor(ref_loss, dtype=torch.float64))
    torch.testing.assert_close(
        stats["clip_fraction"], torch.tensor(ref_clip_fraction, dtype=torch.float64)
    )
    assert torch.autograd.gradcheck(
        lambda lp: ppo_policy_loss(lp, old_logprobs, advantages, mask)[0],
        (logprobs.clone().requires_grad_(),),
    )


# ---------------------------------------------------------------------------------------------
# value loss
# ---------------------------------------------------------------------------------------------


def test_value_loss_clipped():
    # old = 0, clip_eps = 0.2, so V_clip = clip(V, -0.2, 0.2); 5th token is padding
    #   t0: V= 0.5, R= 1: (0.5-1)^2 = 0.25, (0.2-1)^2 = 0.64 -> 0.64 clipped error larger
    #   t1: V= 0.1, R= 1: 0.81, 0.81 (V inside the range)   -> 0.81
    #   t2: V=-0.5, R= 0: 0.25, (-0.2)^2 = 0.04             -> 0.25
    #   t3: V= 0.3, R=-1: 1.69, 1.44                        -> 1.69
    #   loss = 0.5 * (0.64 + 0.81 + 0.25 + 1.69) / 4 = 0.42375 ; value_clip_fraction = 1/4
    values = torch.tensor([[0.5, 0.1, -0.5, 0.3, NAN]], requires_grad=True)
    old_values = torch.tensor([[0.0, 0.0, 0.0, 0.0, INF]])
    returns = torch.tensor([[1.0, 1.0, 0.0, -1.0, -INF]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = value_loss(values, old_values, returns, mask, clip_eps=0.2)
    torch.testing.assert_close(loss, torch.tensor(0.42375))
    assert stats["value_clip_fraction"].item() == 0.25
    torch.testing.assert_close(stats["value_mean"], torch.tensor(0.1))
    # gradient 0.5 * 2 * (V - R) / 4 on unclipped tokens, 0 on t0 (clipped) and padding
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.225, -0.125, 0.325, 0.0]]))
    # without clipping: 0.5 * (0.25 + 0.81 + 0.25 + 1.69) / 4 = 0.375
    loss, stats = value_loss(values, old_values, returns, mask, clip_eps=None)
    torch.testing.assert_close(loss, torch.tensor(0.375))
    assert stats["value_clip_fraction"].item() == 0.0


def test_value_loss_not_clipped():
    # V within 0.2 of old: 0.5 * ((0.1 - 1)^2 + (-0.1 - 0)^2) / 2 = 0.5 * 0.82 / 2 = 0.205
    loss, stats = value_loss(
        torch.tensor([[0.1, -0.1]]), torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]), torch.ones(1, 2)
    )
    torch.testing.assert_close(loss, torch.tensor(0.205))
    assert stats["value_clip_fraction"].item() == 0.0


def test_value_loss_matches_float64_reference():
    g = torch.Generator().manual_seed(1)
    mask = ragged_mask([5, 3, 1], 5)
    values, old_values, returns = torch.randn(3, 3, 5, generator=g, dtype=torch.float64)
    loss, stats = value_loss(values, old_values, returns, mask, clip_eps=0.3)
    total, n, clipped = 0.0, 0, 0
    for b, t in mask.nonzero().tolist():
        v, v_old, r = float(values[b, t]), float(old_values[b, t]), float(returns[b, t])
        v_clip = v_old + min(max(v - v_old, -0.3), 0.3)
        total += 0.5 * max((v - r) ** 2, (v_clip - r) ** 2)
        clipped += (v_clip - r) ** 2 > (v - r) ** 2
        n += 1
    assert 0 < clipped < n
    torch.testing.assert_close(loss, torch.tensor(total / n, dtype=torch.float64))
    torch.testing.assert_close(
        stats["value_clip_fraction"], torch.tensor(clipped / n, dtype=torch.float64)
    )


# ---------------------------------------------------------------------------------------------
# log-probs, entropy, KL loss, aggregation
# ---------------------------------------------------------------------------------------------


def test_logprobs_from_logits():
    # probs [0.25, 0.5, 0.25] from logits log([1, 2, 1]): token 1 -> log 0.5, token 0 -> log 0.25
    logits = torch.log(torch.tensor([[[1.0, 2.0, 1.0], [1.0, 2.0, 1.0]]]))
    out = logprobs_from_logits(logits, torch.tensor([[1, 0]]))
    torch.testing.assert_close(out, torch.tensor([[math.log(0.5), math.log(0.25)]]))
    # equals the gather of log_softmax on random inputs, in float64
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 11, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 11, (3, 4), generator=g)
    expected = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    out = logprobs_from_logits(logits, ids)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    # bfloat16 logits are computed in float32
    assert logprobs_from_logits(logits.bfloat16(), ids).dtype == torch.float32


def test_logprobs_from_logits_masked_padding():
    g = torch.Generator().manual_seed(3)
    mask = ragged_mask([4, 2], 4)
    logits = torch.randn(2, 4, 5, generator=g)
    ids = torch.randint(0, 5, (2, 4), generator=g)
    clean = logprobs_from_logits(logits, ids, mask)
    dirty_logits = torch.where(mask.bool()[..., None], logits, NAN).requires_grad_()
    dirty_ids = torch.where(mask.bool(), ids, -100)  # the usual ignore index
    out = logprobs_from_logits(dirty_logits, dirty_ids, mask)
    assert torch.equal(out, clean) and torch.all(out[mask == 0] == 0)
    out.sum().backward()
    assert torch.isfinite(dirty_logits.grad).all()
    assert torch.all(dirty_logits.grad[mask == 0] == 0)


def test_entropy_from_logits_hand_computed():
    # row token 0: uniform over 4 -> log 4 ; token 1: uniform over 2 (others -inf) -> log 2
    # token 2 is padding (NaN logits). mean over real tokens = (log 4 + log 2) / 2 = 1.5 log 2
    logits = torch.tensor(
        [[[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -INF, -INF], [NAN, NAN, NAN, NAN]]], requires_grad=True
    )
    mask = torch.tensor([[1, 1, 0]])
    entropy = entropy_from_logits(logits, mask)
    torch.testing.assert_close(entropy, torch.tensor(1.5 * math.log(2)))
    torch.testing.assert_close(
        token_entropy_from_logits(logits, mask), torch.tensor([[math.log(4), math.log(2), 0.0]])
    )
    entropy.backward()
    assert torch.isfinite(logits.grad).all() and torch.all(logits.grad[0, 2] == 0)


def test_kl_loss_is_the_masked_mean_of_k3():
    # log_ratio = [0.5, -1.0]; k3 = [exp(-0.5) - 0.5, e - 2]; padding holds NaN
    logprobs = torch.tensor([[-1.0, -2.0, NAN]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, NAN]])
    mask = torch.tensor([[1, 1, 0]])
    expected = ((math.exp(-0.5) - 0.5) + (math.e - 2)) / 2
    torch.testing.assert_close(kl_loss(logprobs, ref_logprobs, mask), torch.tensor(expected))
    torch.testing.assert_close(
        kl_loss(logprobs, ref_logprobs, mask, kind="k1"), torch.tensor(-0.25)
    )
    # k3 >= 0 and is 0 (with zero gradient) when the policy equals the reference
    same = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss = kl_loss(same, same.detach(), torch.ones(1, 2))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(same.grad == 0)


def test_aggregation_modes_hand_computed():
    # token losses [[1, 2, 3], [4, pad, pad], [pad, pad, pad]]
    #   token-mean          = (1 + 2 + 3 + 4) / 4 = 2.5
    #   seq-mean-token-mean = (mean(1, 2, 3) + mean(4)) / 2 = (2 + 4) / 2 = 3 (empty row left out)
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, INF], [NAN, NAN, NAN]])
    mask = ragged_mask([3, 1, 0], 3)
    assert aggregate_token_loss(token_loss, mask, "token-mean").item() == 2.5
    assert aggregate_token_loss(token_loss, mask, "seq-mean-token-mean").item() == 3.0
    #   seq-mean-token-sum  = (sum(1, 2, 3) + sum(4)) / 2 = (6 + 4) / 2 = 5 (empty row left out)
    assert aggregate_token_loss(token_loss, mask, "seq-mean-token-sum").item() == 5.0
    #   seq-mean-token-sum-norm, horizon 8 = (6 + 4) / (2 * 8) = 0.625; default horizon T = 3
    norm = "seq-mean-token-sum-norm"
    assert aggregate_token_loss(token_loss, mask, norm, horizon=8).item() == 0.625
    assert aggregate_token_loss(token_loss, mask, norm).item() == pytest.approx(10 / 6)


def test_the_constant_normaliser_ignores_the_padded_width():
    """Dr.GRPO: the same responses weigh the same whatever the batch's padding."""
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = ragged_mask([3, 1], 3)
    wide_loss = torch.cat([token_loss, torch.zeros(2, 5)], 1)  # (2, 8) the same, more padding
    wide_mask = torch.cat([mask, torch.zeros(2, 5)], 1)
    norm = "seq-mean-token-sum-norm"
    narrow = aggregate_token_loss(token_loss, mask, norm, horizon=16)
    assert aggregate_token_loss(wide_loss, wide_mask, norm, horizon=16) == narrow
    assert aggregate_token_loss(wide_loss, wide_mask, "seq-mean-token-mean") == 3.0  # as narrow


@pytest.mark.parametrize("horizon", [2, 0, 2.5, True])
def test_a_horizon_shorter_than_a_response_is_refused(horizon):
    token_loss = torch.ones(2, 3)
    mask = ragged_mask([3, 1], 3)
    with pytest.raises(ValueError, match=r"horizon is .*longest response \(3 tokens\)"):
        aggregate_token_loss(token_loss, mask, "seq-mean-token-sum-norm", horizon=horizon)


# ---------------------------------------------------------------------------------------------
# GRPO loss
# ---------------------------------------------------------------------------------------------


def test_grpo_loss_hand_computed_single_update():
    # old_logprobs=None -> ratio 1, nothing clipped; beta=0 -> no KL term.
    # A = [1, -2] over rows of 2 and 1 real tokens:
    #   seq-mean-token-mean: loss = -(1 + (-2)) / 2 = 0.5 ; grad = -A_i / (|o_i| * G)
    #       row 0: -1 / (2 * 2) = -0.25 per token ; row 1: 2 / (1 * 2) = 1.0
    #   token-mean: loss = -(1 + 1 - 2) / 3 = 0 ; grad = -A_i / 3 = [-1/3, -1/3 | 2/3]
    mask = torch.tensor([[1, 1], [1, 0]])
    advantages = torch.tensor([1.0, -2.0])
    logprobs = torch.tensor([[-1.0, -0.5], [-2.0, NAN]], requires_grad=True)
    loss, stats = grpo_loss(logprobs, None, None, advantages, mask, beta=0.0)
    torch.testing.assert_close(loss, torch.tensor(0.5))
    assert stats["clip_fraction"].item() == 0.0 and stats["ref_kl"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, -0.25], [1.0, 0.0]]))

    logprobs.grad = None
    loss, _ = grpo_loss(logprobs, None, None, advantages, mask, beta=0.0, aggregation="token-mean")
    torch.testing.assert_close(loss, torch.tensor(0.0))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1 / 3, -1 / 3], [2 / 3, 0.0]]))


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_grpo_loss_is_clipped_surrogate_plus_beta_k3(aggregation):
    g = torch.Generator().manual_seed(4)
    mask = ragged_mask([5, 3, 4, 1], 5)
    logprobs = -torch.rand(4, 5, generator=g, dtype=torch.float64)
    old_logprobs = logprobs + 0.3 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    ref_logprobs = logprobs + 0.2 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    advantages = torch.randn(4, generator=g, dtype=torch.float64)
    loss, stats = grpo_loss(
        logprobs, old_logprobs, ref_logprobs, advantages, mask, beta=0.1, aggregation=aggregation
    )
    # reference: per-row token means (or one global mean) of the per-token objective
    rows, total, n = [], 0.0, 0
    for b in range(4):
        terms = []
        for t in range(int(mask[b].sum())):
            r = math.exp(float(logprobs[b, t] - old_logprobs[b, t]))
            a = float(advantages[b])
            pg = max(-a * r, -a * min(max(r, 0.8), 1.2))
            lr = float(logprobs[b, t] - ref_logprobs[b, t])
            terms.append(pg + 0.1 * (math.exp(-lr) - 1 + lr))
        rows.append(sum(terms) / len(terms))
        total, n = total + sum(terms), n + len(terms)
    expected = total / n if aggregation == "token-mean" else sum(rows) / len(rows)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(
        stats["ref_kl"], kl_loss(logprobs, ref_logprobs, mask, aggregation=aggregation)
    )
    # (B,) advantages are the same as their (B, T) broadcast
    loss_bt, _ = grpo_loss(
        logprobs,
        old_logprobs,
        ref_logprobs,
        advantages[:, None].expand(4, 5),
        mask,
        beta=0.1,
        aggregation=aggregation,
    )
    torch.testing.assert_close(loss_bt, loss)


# ---------------------------------------------------------------------------------------------
# padding never leaks, for every loss at once
# ---------------------------------------------------------------------------------------------


def _all_losses(lp, old_lp, ref_lp, adv, values, old_values, returns, logits, mask):
    return {
        "ppo": ppo_policy_loss(lp, old_lp, adv, mask)[0],
        "ppo_seq": ppo_policy_loss(lp, old_lp, adv, mask, aggregation="seq-mean-token-mean")[0],
        "value": value_loss(values, old_values, returns, mask)[0],
        "entropy": entropy_from_logits(logits, mask),
        **{f"kl_{k}": kl_loss(lp, ref_lp, mask, kind=k) for k in ("k1", "k2", "k3", "abs")},
        "grpo_token": grpo_loss(lp, old_lp, ref_lp, adv, mask, aggregation="token-mean")[0],
        "grpo_seq": grpo_loss(lp, old_lp, ref_lp, adv, mask)[0],
    }


@pytest.mark.parametrize("junk", [NAN, INF, -INF, 1e30, -1e30])
def test_padding_never_leaks_into_losses_or_gradients(junk):
    g = torch.Generator().manual_seed(5)
    B, T, V = 3, 6, 7
    mask = ragged_mask([6, 2, 4], T)
    tensors = {
        "lp": -torch.rand(B, T, generator=g),
        "old_lp": -torch.rand(B, T, generator=g),
        "ref_lp": -torch.rand(B, T, generator=g),
        "adv": torch.randn(B, T, generator=g),
        "values": torch.randn(B, T, generator=g),
        "old_values": torch.randn(B, T, generator=g),
        "returns": torch.randn(B, T, generator=g),
    }
    logits = torch.randn(B, T, V, generator=g)
    clean = _all_losses(**tensors, logits=logits, mask=mask)

    dirty = {k: fill_padding(x, mask, junk).requires_grad_() for k, x in tensors.items()}
    dirty_logits = torch.where(mask.bool()[..., None], logits, junk).requires_grad_()
    losses = _all_losses(**dirty, logits=dirty_logits, mask=mask)
    for name, loss in losses.items():
        assert torch.equal(loss, clean[name]), name
    sum(losses.values()).backward()
    for name, x in [*dirty.items(), ("logits", dirty_logits)]:
        assert x.grad is not None, name
        assert torch.isfinite(x.grad).all(), name
        assert torch.all(x.grad[mask == 0] == 0), name
    # the stats ignore padding too
    _, stats = ppo_policy_loss(dirty["lp"], dirty["old_lp"], dirty["adv"], mask)
    _, clean_stats = ppo_policy_loss(tensors["lp"], tensors["old_lp"], tensors["adv"], mask)
    assert all(torch.equal(stats[k], clean_stats[k]) for k in stats)


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_ppo_loss_padding_width_does_not_matter(lengths, seed):
    # appending extra padding columns (holding garbage) never changes the loss
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), 5
    mask = ragged_mask(lengths, T)
    lp, old_lp, adv = torch.randn(3, B, T, generator=g, dtype=torch.float64)
    loss, stats = ppo_policy_loss(lp, old_lp, adv, mask)
    pad = torch.full((B, 3), 1e300, dtype=torch.float64)
    wide = [torch.cat([x, pad], dim=1) for x in (lp, old_lp, adv)]
    wide_mask = torch.cat([mask, torch.zeros(B, 3)], dim=1)
    wide_loss, wide_stats = ppo_policy_loss(*wide, wide_mask)
    torch.testing.assert_close(wide_loss, loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(wide_stats["clip_fraction"], stats["clip_fraction"])


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


def test_losses_bad_input():
    ok = torch.zeros(4, 7)
    mask = torch.ones(4, 7)
    with pytest.raises(ValueError) as info:
        ppo_policy_loss(ok, ok, torch.zeros(4, 6), mask)
    assert str(info.value) == (
        "ppo_policy_loss: logprobs has shape (4, 7) but advantages has shape (4, 6); "
        "both must be (B, T)"
    )
    bad = ok.clone()
    bad[1, 3] = NAN
    with pytest.raises(
        ValueError, match=r"ppo_policy_loss: advantages .*\(nan\) at sample 1, token 3"
    ):
        ppo_policy_loss(ok, ok, bad, mask)
    with pytest.raises(ValueError, match=r"ppo_policy_loss: logprobs is empty \(shape \(0, 7\)\)"):
        ppo_policy_loss(torch.zeros(0, 7), torch.zeros(0, 7), torch.zeros(0, 7), torch.ones(0, 7))
    with pytest.raises(ValueError, match=r"ppo_policy_loss: mask has 0 real \(mask=1\) token"):
        ppo_policy_loss(ok, ok, ok, torch.zeros(4, 7))
    with pytest.raises(ValueError, match=r"ppo_policy_loss: mask must hold only 0 and 1"):
        ppo_policy_loss(ok, ok, ok, mask * 0.5)
    with pytest.raises(ValueError, match=r"ppo_policy_loss: clip_eps is 0"):
        ppo_policy_loss(ok, ok, ok, mask, clip_eps=0)
    with pytest.raises(ValueError, match=r"ppo_policy_loss: aggregation is 'sum'"):
        ppo_policy_loss(ok, ok, ok, mask, aggregation="sum")
    with pytest.raises(
        ValueError, match=r"value_loss: values has shape \(4, 7\) but returns has shape \(4, 7, 1\)"
    ):
        value_loss(ok, ok, ok[..., None], mask)
    with pytest.raises(ValueError, match=r"value_loss: returns .*\(inf\) at sample 0, token 0"):
        value_loss(ok, ok, torch.full((4, 7), INF), mask)
    with pytest.raises(ValueError, match=r"kl_loss: kind is 'k5'"):
        kl_loss(ok, ok, mask, kind="k5")
    with pytest.raises(
        ValueError, match=r"grpo_loss: logprobs has shape \(4, 7\) but advantages has shape \(3,\)"
    ):
        grpo_loss(ok, None, ok, torch.zeros(3), mask)
    with pytest.raises(ValueError, match=r"grpo_loss: ref_logprobs is None but beta is 0.04"):
        grpo_loss(ok, None, None, torch.zeros(4), mask)
    with pytest.raises(ValueError, match=r"grpo_loss: advantages .*\(nan\) at sample 2"):
        grpo_loss(ok, None, ok, torch.tensor([0.0, 0.0, NAN, 0.0]), mask)
    with pytest.raises(
        ValueError,
        match=r"logprobs_from_logits: logits has shape \(4, 7, 3\) but token_ids has shape \(4, 6\)",
    ):
        logprobs_from_logits(torch.zeros(4, 7, 3), torch.zeros(4, 6, dtype=torch.long))
    with pytest.raises(
        ValueError,
        match=r"logprobs_from_logits: token_ids\[1, 2\] is 3, outside the vocabulary \[0, 3\)",
    ):
        ids = torch.zeros(4, 7, dtype=torch.long)
        ids[1, 2] = 3
        logprobs_from_logits(torch.zeros(4, 7, 3), ids)
    with pytest.raises(
        ValueError, match=r"logprobs_from_logits: token_ids has dtype torch.float32"
    ):
        logprobs_from_logits(torch.zeros(4, 7, 3), torch.zeros(4, 7))
    with pytest.raises(
        ValueError, match=r"entropy_from_logits: logits has shape \(0, 7, 3\); it must be non-empty"
    ):
        entropy_from_logits(torch.zeros(0, 7, 3), torch.ones(0, 7))
    with pytest.raises(
        ValueError,
        match=r"entropy_from_logits: logits has shape \(4, 7, 3\) but mask has shape \(4, 6\); they must be \(B, T, V\) and \(B, T\)",
    ):
        entropy_from_logits(torch.zeros(4, 7, 3), torch.ones(4, 6))


def test_dual_clip_caps_a_negative_advantage_tokens_loss():
    # token 0: A = -1, ratio e^2 = 7.39 -> max(7.39, -A * clip(r) = 1.2) = 7.39, capped at c = 3
    # token 1: A = +1, ratio 1 -> -1 (a positive advantage is never capped)
    logprobs = torch.tensor([[2.0, 0.0]], requires_grad=True)
    old, adv, mask = torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2)
    plain, _ = ppo_policy_loss(logprobs, old, adv, mask)
    torch.testing.assert_close(plain, torch.tensor((math.exp(2.0) - 1.0) / 2))
    capped, _ = ppo_policy_loss(logprobs, old, adv, mask, dual_clip=3.0)
    torch.testing.assert_close(capped, torch.tensor((3.0 - 1.0) / 2))
    capped.backward()  # the capped token's loss is a constant: no gradient through it
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5]]))
    with pytest.raises(ValueError, match="dual_clip is 0.5"):
        ppo_policy_loss(logprobs, old, adv, mask, dual_clip=0.5)


def test_grpo_loss_takes_any_registered_kl_estimator():
    # one token, advantage 0: the loss is beta times the KL term; log_ratio = -1 - (-1.5) = 0.5
    lp, ref, adv, mask = (
        torch.tensor([[-1.0]]),
        torch.tensor([[-1.5]]),
        torch.zeros(1),
        torch.ones(1, 1),
    )
    k3, _ = grpo_loss(lp, None, ref, adv, mask, beta=1.0)
    torch.testing.assert_close(k3, torch.tensor(math.exp(-0.5) - 1 + 0.5))
    k1, _ = grpo_loss(lp, None, ref, adv, mask, beta=1.0, kl_estimator="k1")
    torch.testing.assert_close(k1, torch.tensor(0.5))
    with pytest.raises(ValueError, match="kl_estimator"):
        grpo_loss(lp, None, ref, adv, mask, kl_estimator="k9")


def test_truncated_is_weights_are_the_capped_trainer_to_sampler_ratio():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    sampled = torch.tensor([[-1.5, -1.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = truncated_is_weights(old, sampled, mask, cap=1.5)
    # exp(0.5) = 1.65 capped at 1.5; exp(-1) kept; padding 0 (whatever its logprobs)
    torch.testing.assert_close(w, torch.tensor([[1.5, math.exp(-1.0), 0.0]]))
    # each token's loss is scaled: at ratio 1 the token-mean loss is -mean(w * A)
    lp = old.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = ppo_policy_loss(lp, old, adv, mask, is_weights=w)
    torch.testing.assert_close(loss, torch.tensor(-(1.5 + math.exp(-1.0)) / 2))
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.75, -math.exp(-1.0) / 2, 0.0]]))
    g, _ = grpo_loss(old, old, None, adv, mask, beta=0.0, is_weights=w)
    torch.testing.assert_close(g, torch.tensor(-(1.5 + math.exp(-1.0)) / 2))  # seq-mean = token
    with pytest.raises(ValueError, match="cap is 0"):
        truncated_is_weights(old, sampled, mask, cap=0)
    with pytest.raises(ValueError, match="is_weights"):
        grpo_loss(old, old, None, adv, mask, beta=0.0, is_weights=torch.ones(2, 3))


# ---------------------------------------------------------------------------------------------
# the policy-loss registry and GSPO
# ---------------------------------------------------------------------------------------------


def _gspo_reference(logprobs, old, advantages, lengths, eps_low, eps_high):
    """GSPO written out in float64 loops: the loss (seq-mean-token-mean) and d loss / d logprobs.

    s_i = exp(1/|o_i| sum_t (lp - old)); the token loss is max(-A s_i, -A clip(s_i)); its
    gradient is -A_t * s_i / |o_i| per token where the unclipped branch wins, else 0; the
    loss is the mean over responses of the mean over their tokens."""
    B = len(lengths)
    loss, grad = 0.0, [[0.0] * logprobs.shape[1] for _ in range(B)]
    for i, n in enumerate(lengths):
        s = math.exp(sum(float(logprobs[i, t] - old[i, t]) for t in range(n)) / n)
        clipped_s = min(max(s, 1 - eps_low), 1 + eps_high)
        row = 0.0
        for t in range(n):
            a = float(advantages[i, t])
            unclipped, clipped = -a * s, -a * clipped_s
            row += max(unclipped, clipped)
            if not clipped > unclipped:
                grad[i][t] = -a * s / n / B
        loss += row / n / B
    return loss, torch.tensor(grad, dtype=torch.float64)


@pytest.mark.parametrize("junk", [0.0, NAN, INF])
def test_gspo_matches_a_float64_reference_with_ragged_lengths_and_padding(junk):
    lengths, T = [3, 1, 4, 2], 5
    mask = ragged_mask(lengths, T)
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(4, T, generator=gen, dtype=torch.float64) * 2  # (B, T)
    # the sequence ratios land on both sides of the clip range and inside it
    shift = torch.tensor([[0.002], [-0.0001], [-0.003], [0.0]], dtype=torch.float64)
    noise = torch.randn(4, T, generator=gen, dtype=torch.float64) * 1e-3
    logprobs = old + shift + noise  # (B, T)
    advantages = torch.tensor([[1.0], [-1.0], [-1.0], [1.0]], dtype=torch.float64).expand(4, T)
    expected_loss, expected_grad = _gspo_reference(logprobs, old, advantages, lengths, 3e-4, 4e-4)
    lp = fill_padding(logprobs, mask, junk).requires_grad_()
    loss, stats = gspo_policy_loss(
        lp, fill_padding(old, mask, junk), fill_padding(advantages, mask, junk), mask
    )
    torch.testing.assert_close(loss, torch.tensor(expected_loss, dtype=torch.float64))
    loss.backward()
    torch.testing.assert_close(lp.grad, expected_grad)
    # each response's tokens are clipped together: the first and third are, the others not
    assert stats["clip_fraction"].item() == pytest.approx((3 + 4) / 10)
    seq = [math.exp(float((logprobs[i, :n] - old[i, :n]).mean())) for i, n in enumerate(lengths)]
    ratio_mean = sum(s * n for s, n in zip(seq, lengths, strict=True)) / sum(lengths)
    assert stats["ratio_mean"].item() == pytest.approx(ratio_mean, rel=1e-12)


def test_gspo_of_one_token_responses_is_ppo():
    """With one token per response the sequence ratio is the token ratio: the same loss,
    gradient and stats as PPO's, clipped or not."""
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    old = torch.tensor([[-1.0, 0.0], [-2.0, 0.0], [-0.5, 0.0]])
    logprobs = old + torch.tensor([[0.5, 0.0], [-0.05, 0.0], [-0.5, 0.0]])
    adv = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [-1.0, 0.0]])
    results = []
    for fn in (ppo_policy_loss, gspo_policy_loss):
        lp = logprobs.clone().requires_grad_()
        loss, stats = fn(lp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.2)
        loss.backward()
        results.append((loss, lp.grad, stats))
    (loss_p, grad_p, stats_p), (loss_g, grad_g, stats_g) = results
    torch.testing.assert_close(loss_g, loss_p)
    torch.testing.assert_close(grad_g, grad_p)
    # e^0.5 with A = 1 and e^-0.5 with A = -1 are clipped, e^-0.05 is inside
    assert (
        stats_p["clip_fraction"].item() == stats_g["clip_fraction"].item() == pytest.approx(2 / 3)
    )


def test_the_policy_losses_are_registered_and_grpo_takes_them_by_name():
    assert list(POLICY_LOSSES)[:2] == ["ppo", "gspo"]
    mask = ragged_mask([2, 3], 3)
    old = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -2.0, -3.0]])
    lp = old + torch.tensor([[0.3, 0.3, 0.0], [0.1, 0.2, 0.3]])
    adv = torch.tensor([1.0, -1.0])
    ppo, _ = grpo_loss(lp, old, None, adv, mask, beta=0.0)
    assert torch.equal(ppo, grpo_loss(lp, old, None, adv, mask, beta=0.0, policy_loss="ppo")[0])
    gspo, stats = grpo_loss(lp, old, None, adv, mask, 3e-4, 4e-4, beta=0.0, policy_loss="gspo")
    # s = (e^0.3, e^0.2), both above 1 + 4e-4: -A clip(s) = -(1 + 4e-4) and +(1 + 4e-4) ...
    # ... and max(1 * e^0.2, 1 * 1.0004) = e^0.2 for the negative advantage
    torch.testing.assert_close(gspo, torch.tensor((-(1 + 4e-4) + math.exp(0.2)) / 2))
    assert stats["clip_fraction"].item() == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="policy_loss is 'cispo'.*choose one of ppo, gspo"):
        grpo_loss(lp, old, None, adv, mask, beta=0.0, policy_loss="cispo")


# ---------------------------------------------------------------------------------------------
# importance weights: token or sequence level, truncated or masked
# ---------------------------------------------------------------------------------------------


def _is_reference(old, sampled, lengths, cap, level, mode):
    """The weights written out in float64 loops: per token exp(old - sampled), or per sequence
    exp of the mean gap over the response's real tokens on each of them; then min(w, cap), or
    w inside [1/cap, cap] and 0 outside; 0 at padding."""
    B, T = old.shape
    out = [[0.0] * T for _ in range(B)]
    for i, n in enumerate(lengths):
        seq = math.exp(sum(float(old[i, t] - sampled[i, t]) for t in range(n)) / n)
        for t in range(n):
            w = seq if level == "sequence" else math.exp(float(old[i, t] - sampled[i, t]))
            if mode == "truncate":
                out[i][t] = min(w, cap)
            else:
                out[i][t] = w if 1 / cap <= w <= cap else 0.0
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("junk", [0.0, NAN, -INF])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_weights_match_a_float64_reference(level, mode, junk):
    lengths, T = [4, 1, 3, 2, 5], 5
    mask = ragged_mask(lengths, T)
    gen = torch.Generator().manual_seed(7)
    old = -torch.rand(5, T, generator=gen, dtype=torch.float64) * 3  # (B, T)
    sampled = old + torch.randn(5, T, generator=gen, dtype=torch.float64) * 0.8  # (B, T)
    expected = _is_reference(old, sampled, lengths, 1.5, level, mode)
    w = importance_weights(
        fill_padding(old, mask, junk), fill_padding(sampled, mask, junk), mask, 1.5, level, mode
    )
    torch.testing.assert_close(w, expected.float())
    capped = expected[mask.bool()]
    # the draw has weights on both sides of the cap (and, masked, dropped ones)
    assert (capped == 1.5).any() if mode == "truncate" else (capped == 0).any()
    assert ((capped > 0) & (capped < 1.5)).any()


def test_sequence_weights_are_one_per_response_and_padding_does_not_shift_them():
    # gaps (old - sampled) 0.2 and -0.6 on response 0: geometric mean exp(-0.2); response 1's
    # single gap 1.0 is e = 2.72 > cap 2: truncated to 2, masked to 0
    old = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, 0.0, 0.0]])
    sampled = torch.tensor([[-1.2, -1.4, 5.0], [-2.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    w = importance_weights(old, sampled, mask, 2.0, "sequence", "truncate")
    e = math.exp(-0.2)
    torch.testing.assert_close(w, torch.tensor([[e, e, 0.0], [2.0, 0.0, 0.0]]))
    w = importance_weights(old, sampled, mask, 2.0, "sequence", "mask")
    torch.testing.assert_close(w, torch.tensor([[e, e, 0.0], [0.0, 0.0, 0.0]]))
    # per token: exp(0.2), exp(-0.6) kept (both in [1/2, 2]); e dropped
    w = importance_weights(old, sampled, mask, 2.0, "token", "mask")
    torch.testing.assert_close(
        w, torch.tensor([[math.exp(0.2), math.exp(-0.6), 0.0], [0.0, 0.0, 0.0]])
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cap": 1.0, "mode": "mask"}, "cap is 1.0; it must be a finite number > 1"),
        ({"cap": INF}, "cap is inf"),
        ({"level": "sentence"}, "level is 'sentence'; choose one of token, sequence"),
        ({"mode": "clip"}, "mode is 'clip'; choose one of truncate, mask"),
    ],
)
def test_importance_weights_refuse_bad_settings_in_one_line(kwargs, match):
    one = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=match) as info:
        importance_weights(one, one, torch.ones(1, 2), **kwargs)
    assert "\n" not in str(info.value)
