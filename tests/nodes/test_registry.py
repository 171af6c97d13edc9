"""The extension points are registries (nodes/registry.py): an estimator, a KL estimator, a loss
aggregation or a reward kind is one registered entry, found by name by the nodes, the losses
and the ready graphs' options."""

import pytest
import torch

from graphs.config import GRPOConfig
from nodes.advantage import GAEAdvantage, GroupAdvantage
from nodes.registry import Registry
from nodes.rewards import reward_from_option
from nodes.rewards.base import RewardNode
from nodes.rewards.options import REWARD_KINDS, spellings
from nodes.rl.advantages import GROUP_ESTIMATORS, KL_ESTIMATORS, grpo_advantages, kl_penalty
from nodes.rl.aggregate import AGGREGATIONS, TokenMean, aggregate_token_loss
from yatt_graph.options import config_options


def test_a_registry_finds_by_name_and_refuses_others_naming_the_choices():
    things = Registry("thing")

    @things.register("a")
    def a():
        """The first thing."""

    things.register("b", "the second")(len)
    assert list(things) == ["a", "b"] and things["a"] is a and "b" in things
    assert things.help("a") == "The first thing." and things.help("b") == "the second"
    with pytest.raises(ValueError, match="thing 'c' is not registered; choose one of a, b"):
        things["c"]
    with pytest.raises(ValueError, match="node 'x': kind is 'c': not a registered thing"):
        things.check("c", "node 'x': kind")
    with pytest.raises(ValueError, match="registered already"):
        things.register("a")(len)
    assert things.literal().__args__ == ("a", "b")


@pytest.fixture
def registered(monkeypatch):
    """Register ``entry`` as ``name`` in ``registry`` for one test."""

    def add(registry, name, entry, help=""):
        monkeypatch.setitem(registry._entries, name, entry)
        monkeypatch.setitem(registry._help, name, help or name)
        return entry

    return add


def test_a_registered_group_estimator_is_what_group_advantage_runs(registered):
    def median_baseline(scores, *, group_ids):
        """Each score against its group's median."""
        medians = torch.stack([scores[group_ids == g].median() for g in group_ids])  # (B,)
        return scores - medians  # (B,)

    registered(GROUP_ESTIMATORS, "median", median_baseline)
    scores, groups = torch.tensor([1.0, 0.0, 3.0, 0.0, 1.0, 2.0]), torch.tensor([0, 0, 0, 1, 1, 1])
    out = GroupAdvantage("median").run(
        scores=scores, group_ids=groups, response_mask=torch.ones(6, 2)
    )
    torch.testing.assert_close(
        out["advantages"][:, 0], torch.tensor([0.0, -1.0, 2.0, -1.0, 0.0, 1.0])
    )


def test_dr_grpo_is_grpo_without_the_std():
    scores, groups = torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1])
    got = GROUP_ESTIMATORS["dr_grpo"](scores, group_ids=groups)
    assert torch.equal(got, grpo_advantages(scores, group_ids=groups, normalize_std=False))
    assert torch.equal(got, torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_the_grpo_config_takes_its_estimator_choices_from_the_registry():
    (option,) = [o for o in config_options(GRPOConfig) if o.name == "estimator"]
    assert option.label == "|".join(GROUP_ESTIMATORS)
    assert GRPOConfig(estimator="dr_grpo").estimator == "dr_grpo"
    with pytest.raises(ValueError, match="estimator"):
        GRPOConfig(estimator="nope")


def test_a_registered_kl_estimator_is_what_kl_penalty_and_gae_use(registered):
    registered(KL_ESTIMATORS, "square", lambda log_ratio: log_ratio**2)
    logprobs, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-2.0, -2.5]])
    mask = torch.tensor([[1.0, 0.0]])
    torch.testing.assert_close(
        kl_penalty(logprobs, ref, mask, kind="square"), torch.tensor([[1.0, 0.0]])
    )
    GAEAdvantage(kl_estimator="square", kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_estimator is 'k9': not a registered KL estimator"):
        GAEAdvantage(kl_estimator="k9")


def test_a_registered_aggregation_reduces_the_losses(registered):
    registered(
        AGGREGATIONS,
        "seq-sum",  # each sequence's summed loss, averaged over sequences
        TokenMean(
            total=lambda loss, real: loss.sum(), count=lambda real, horizon: real.any(1).sum()
        ),
    )
    loss = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(aggregate_token_loss(loss, mask, "seq-sum")) == pytest.approx(3.0)  # (3 + 3) / 2
    assert float(aggregate_token_loss(loss, mask, "token-mean")) == pytest.approx(2.0)


class ConstantReward(RewardNode):
    """Every response scores ``value``."""

    def __init__(self, value: float, **options):
        super().__init__(**options)
        self.value = float(value)

    def score_samples(self, texts, meta, prompts, images):
        return [self.value] * len(texts)


def test_a_registered_reward_kind_is_a_reward_spelling(registered):
    registered(
        REWARD_KINDS,
        "const",
        lambda rest, options: ConstantReward(float(rest), **options),
        "const:VALUE (every response scores VALUE)",
    )
    node = reward_from_option("const:0.25", name="r")
    assert node.name == "r" and node.run(texts=["a", "b"], meta=[{}, {}])["scores"].tolist() == [
        0.25,
        0.25,
    ]
    assert "const:VALUE (every response scores VALUE)" in spellings()
    with pytest.raises(ValueError, match=r"(?s)The spellings are:.*const:VALUE"):
        reward_from_option("nope")
