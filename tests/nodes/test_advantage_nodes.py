import pytest
import torch

from nodes.advantage import GAEAdvantage, GroupAdvantage
from nodes.rl.advantages import compute_gae, grpo_advantages, rloo_advantages
from yatt_graph import NodeInputError

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def test_gae_node_puts_the_score_on_the_last_token_and_matches_the_formula():
    scores = torch.tensor([1.0, -1.0])
    values = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.5, 0.4, 9.0, 9.0]])
    out = GAEAdvantage(gamma=1.0, lam=1.0, whiten=False).run(
        scores=scores, values=values, response_mask=MASK
    )
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, -1.0, 0.0, 0.0]])
    adv, ret = compute_gae(rewards, values, MASK, 1.0, 1.0)
    assert torch.allclose(out["advantages"], adv) and torch.allclose(out["returns"], ret)
    # gamma = lam = 1: return is the reward-to-go, the score, at every real token
    assert torch.allclose(
        out["returns"], torch.tensor([[1.0, 1.0, 1.0, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    )


def test_gae_node_kl_penalty_lowers_the_return_and_needs_the_logprobs():
    scores = torch.tensor([1.0, 1.0])
    values = torch.zeros(2, 4)
    logprobs, ref = torch.full((2, 4), -1.0), torch.full((2, 4), -2.0)  # k1 kl = 1 per token
    node = GAEAdvantage(gamma=1.0, lam=1.0, kl_coef=0.1, whiten=False)
    out = node.run(
        scores=scores, values=values, response_mask=MASK, logprobs=logprobs, ref_logprobs=ref
    )
    assert out["stats"]["kl"] == pytest.approx(1.0)
    assert out["returns"][0, 0] == pytest.approx(1.0 - 0.3)  # three tokens of -0.1 each
    with pytest.raises(ValueError, match="kl_coef=0.1 needs the logprobs and ref_logprobs"):
        node.run(scores=scores, values=values, response_mask=MASK)


def test_gae_node_whitening_ignores_padding():
    out = GAEAdvantage().run(
        scores=torch.tensor([1.0, 0.0]), values=torch.zeros(2, 4), response_mask=MASK
    )
    real = out["advantages"][MASK.bool()]
    assert real.mean().abs() < 1e-5 and (out["advantages"][~MASK.bool()] == 0).all()


def test_group_advantage_nodes_match_the_formulas():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 3)
    grpo = GroupAdvantage("grpo").run(scores=scores, group_ids=groups, response_mask=mask)
    assert torch.allclose(grpo["advantages"][:, 0], grpo_advantages(scores, group_ids=groups))
    assert grpo["stats"]["flat_group_share"] == 0.5
    rloo = GroupAdvantage("rloo").run(scores=scores, group_ids=groups, response_mask=mask)
    assert torch.allclose(rloo["advantages"][:, 2], rloo_advantages(scores, group_ids=groups))


def test_group_advantage_refuses_bad_input():
    with pytest.raises(ValueError, match="estimator is 'ppo': not a registered group advantage"):
        GroupAdvantage("ppo")
    with pytest.raises(NodeInputError, match="input 'group_ids': dimension B=3 disagrees with B=4"):
        GroupAdvantage().run(
            scores=torch.zeros(4),
            group_ids=torch.zeros(3, dtype=torch.int64),
            response_mask=torch.ones(4, 2),
        )


def test_nan_scores_are_refused_naming_the_node_and_the_sample():
    with pytest.raises(
        ValueError,
        match=r"node .gae_advantage.: apply_kl_to_rewards: rewards has a non-finite value \(nan\) at sample 1",
    ):
        GAEAdvantage().run(
            scores=torch.tensor([1.0, float("nan")]), values=torch.zeros(2, 4), response_mask=MASK
        )


def test_gae_node_reports_the_kl_to_reference_even_without_a_penalty():
    logprobs, ref = torch.full((2, 4), -1.0), torch.full((2, 4), -1.5)
    out = GAEAdvantage(lam=1.0, whiten=False).run(
        scores=torch.tensor([1.0, 0.0]),
        values=torch.zeros(2, 4),
        response_mask=MASK,
        logprobs=logprobs,
        ref_logprobs=ref,
    )
    assert out["stats"]["kl"] == pytest.approx(0.5)
    assert out["returns"][0, 0] == pytest.approx(1.0)  # kl_coef=0: the reward is untouched


def test_the_overlong_penalty_takes_score_from_responses_near_the_limit():
    # max_new_tokens 10, buffer 4: lengths 6 (free), 8 (loses 2/4 * 0.5), 10 (loses 0.5)
    mask = (torch.arange(10)[None, :] < torch.tensor([6, 8, 10])[:, None]).float()
    node = GroupAdvantage("dr_grpo", overlong_buffer=4, max_new_tokens=10, overlong_penalty=0.5)
    out = node.run(scores=torch.ones(3), group_ids=torch.zeros(3, dtype=torch.int64), response_mask=mask)  # fmt: skip
    penalized = torch.tensor([1.0, 0.75, 0.5])
    want = penalized - penalized.mean()  # dr_grpo: the group mean removed
    torch.testing.assert_close(out["advantages"][:, 0], want)
    assert out["stats"]["overlong_penalty_mean"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="overlong_buffer=12"):
        GroupAdvantage(overlong_buffer=12, max_new_tokens=10)
