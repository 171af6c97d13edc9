"""ReferenceLogprobs and Critic over rollout outputs (tiny PrefixVLM and tiny Qwen2-VL)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from nodes.models.policy import tiny_prefix_vlm
from nodes.models.value import ValueModel
from nodes.reference import Critic, ReferenceLogprobs
from nodes.rollout import Rollout

PROMPTS = ["hi", "what colour is it?", "x"]
ATOL = 1e-4  # cached generation vs teacher-forced forward, float32 on CPU


@pytest.fixture(scope="module")
def embeds():
    return torch.randn(3, 32, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def rollout_out(embeds):
    """n = 2 samples per prompt, ragged lengths (stop tokens), from the seed-0 tiny policy."""
    policy = tiny_prefix_vlm(seed=0)
    stops = policy.tokenizer.convert_tokens_to_ids(list("aeiou"))
    node = Rollout(model=policy, n=2, max_new_tokens=10, stop_token_ids=stops, seed=0)
    return node.run(prompts=PROMPTS, image_embeds=embeds)


def _ports(out, **extra):
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    return {**{k: out[k] for k in keys}, **extra}


def test_reference_equals_policy_logprobs_at_init(rollout_out, embeds):
    ref = ReferenceLogprobs(policy="tiny-prefix-vlm")  # built like the rollout's policy
    out = ref.run(_ports(rollout_out, image_embeds=embeds))  # N = 3 rows for B = 6: repeated
    ref_lp = out["ref_logprobs"]
    mask = rollout_out["response_mask"]
    assert ref_lp.shape == mask.shape and ref_lp.dtype == torch.float32
    assert (ref_lp[mask == 0] == 0).all()
    assert (ref_lp - rollout_out["logprobs"]).abs().max() <= ATOL
    assert ref.kind == "reference"
    assert not any(p.requires_grad for p in ref.policy.parameters())
    # one embedding row per response gives the same answer
    per_row = ref.run(_ports(rollout_out, image_embeds=embeds.repeat_interleave(2, 0)))
    assert torch.equal(per_row["ref_logprobs"], ref_lp)


def test_reference_is_a_frozen_copy(rollout_out, embeds):
    live = tiny_prefix_vlm(seed=0)
    ref = ReferenceLogprobs(model=live)
    before = ref.run(_ports(rollout_out, image_embeds=embeds))["ref_logprobs"]
    with torch.no_grad():
        live.projector.weight.add_(1.0)  # "training" the live policy
    after = ref.run(_ports(rollout_out, image_embeds=embeds))["ref_logprobs"]
    assert torch.equal(before, after)
    assert ref.policy is not live


def test_reference_temperature(rollout_out, embeds):
    cold = ReferenceLogprobs(temperature=0.5).run(_ports(rollout_out, image_embeds=embeds))
    warm = ReferenceLogprobs(temperature=1.0).run(_ports(rollout_out, image_embeds=embeds))
    mask = rollout_out["response_mask"] > 0
    assert not torch.allclose(cold["ref_logprobs"][mask], warm["ref_logprobs"][mask])
    with pytest.raises(ValueError, match="temperature=0"):
        ReferenceLogprobs(temperature=0)


def test_reference_rows_must_divide(rollout_out):
    ref = ReferenceLogprobs()
    with pytest.raises(
        ValueError, match="'reference_logprobs': input 'image_embeds' has 4 rows for 6"
    ):
        ref.run(_ports(rollout_out, image_embeds=torch.zeros(4, 32)))


def test_critic_values_zero_at_padding_and_grad_to_head(rollout_out, embeds):
    critic = Critic(critic={"name": "tiny-prefix-vlm", "seed": 1})
    out = critic.run(_ports(rollout_out, image_embeds=embeds))
    values, mask = out["values"], rollout_out["response_mask"]
    assert critic.kind == "critic"
    assert values.shape == mask.shape and values.dtype == torch.float32
    assert (mask == 0).any() and (values[mask == 0] == 0).all()
    assert (values[mask > 0] != 0).all()
    assert not values.requires_grad  # the node's output is for advantages, not training

    vm = critic.value_model
    batch = vm.trunk.prepare(
        rollout_out["prompt_ids"],
        rollout_out["prompt_mask"],
        image_embeds=embeds.repeat_interleave(2, 0),
    )
    trained = vm(batch, rollout_out["response_ids"], mask)
    assert torch.allclose(trained.detach(), values, atol=1e-6)
    trained.pow(2).sum().backward()
    assert vm.head.weight.grad is not None and vm.head.weight.grad.abs().sum() > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in vm.trunk.parameters())


def test_padding_gets_no_value_gradient(rollout_out, embeds):
    vm = ValueModel(tiny_prefix_vlm(seed=2))
    batch = vm.trunk.prepare(
        rollout_out["prompt_ids"],
        rollout_out["prompt_mask"],
        image_embeds=embeds.repeat_interleave(2, 0),
    )
    hidden = (
        vm.trunk.response_hidden_states(
            batch, rollout_out["response_ids"], rollout_out["response_mask"]
        )
        .detach()
        .requires_grad_()
    )
    vm.trunk.response_hidden_states = lambda *a, **k: hidden  # observe d values / d hidden
    vm(batch, rollout_out["response_ids"], rollout_out["response_mask"]).sum().backward()
    pad = rollout_out["response_mask"] == 0
    assert (hidden.grad[pad] == 0).all() and (hidden.grad[~pad] != 0).any()


def test_shared_trunk_and_detach(rollout_out, embeds):
    policy = tiny_prefix_vlm(seed=0)
    critic = Critic(model=policy, detach_trunk=True)
    assert critic.value_model.trunk is policy and critic.shared
    assert set(critic.state_dict()) == {"head"}
    vm = critic.value_model
    batch = policy.prepare(
        rollout_out["prompt_ids"],
        rollout_out["prompt_mask"],
        image_embeds=embeds.repeat_interleave(2, 0),
    )
    vm(batch, rollout_out["response_ids"], rollout_out["response_mask"]).sum().backward()
    assert vm.head.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in policy.parameters())  # only the head learns


def test_critic_state_roundtrip(rollout_out, embeds):
    a = Critic(critic={"name": "tiny-prefix-vlm", "seed": 1}, head_seed=0)
    b = Critic(critic={"name": "tiny-prefix-vlm", "seed": 3}, head_seed=5)
    ports = _ports(rollout_out, image_embeds=embeds)
    assert not torch.allclose(a.run(ports)["values"], b.run(ports)["values"])
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.run(ports)["values"], b.run(ports)["values"])
    with pytest.raises(ValueError, match="expected state keys"):
        b.load_state_dict({"head": {}})


def test_qwen2_vl_reference_and_critic_with_images():
    images = [Image.new("RGB", (32, 32), (200, 10, 10)), Image.new("RGB", (24, 40), (10, 200, 10))]
    out = Rollout(policy="tiny-qwen2-vl", n=2, max_new_tokens=8, seed=0).run(
        prompts=PROMPTS[:2], images=images
    )
    ref = ReferenceLogprobs(policy="tiny-qwen2-vl").run(_ports(out, images=images))
    assert (ref["ref_logprobs"] - out["logprobs"]).abs().max() <= ATOL
    values = Critic(critic="tiny-qwen2-vl").run(_ports(out, images=images))["values"]
    mask = out["response_mask"]
    assert values.shape == mask.shape and (values[mask == 0] == 0).all()


def test_critic_weights_input_loads_newer_versions_only(rollout_out, embeds):
    from nodes.sync import WeightUpdate

    ports = _ports(rollout_out, image_embeds=embeds)
    source = Critic(critic={"name": "tiny-prefix-vlm", "seed": 1}, head_seed=3)
    other = Critic(critic={"name": "tiny-prefix-vlm", "seed": 2}, head_seed=4)
    want, other_values = source.run(ports)["values"], other.run(ports)["values"]
    critic = Critic()
    assert not torch.equal(critic.run(ports)["values"], want)

    def payload(node, version):
        state = {k: v.clone() for k, v in node.value_model.state_dict().items()}
        return WeightUpdate(state, version)

    assert torch.equal(critic.run(ports, weights=payload(source, 2))["values"], want)
    assert critic.weights_version == 2
    # a stale version is skipped; an unversioned state dict (version 0) always loads
    assert torch.equal(critic.run(ports, weights=payload(other, 1))["values"], want)
    plain = payload(other, 0).weights
    assert torch.equal(critic.run(ports, weights=plain)["values"], other_values)
    with pytest.raises(
        ValueError, match=r"node 'critic': input 'weights'.*weight name\(s\) not in this model"
    ):
        critic.run(ports, weights=WeightUpdate({"head.nope": torch.zeros(1)}, 3))
    wrong = WeightUpdate({"head.weight": torch.zeros(2, 2)}, 4, complete=False)
    with pytest.raises(
        ValueError,
        match=r"(?s)node 'critic': input 'weights'.*weight 'head.weight' is \(2, 2\); expected shape",
    ):
        critic.run(ports, weights=wrong)
    critic.load_state_dict(source.state_dict())  # a restore accepts the next version again
    assert critic.weights_version == 0


def test_a_token_budget_gives_the_whole_batch_values_in_its_order():
    from nodes.rollout import Rollout

    embeds = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    out = Rollout(n=4, max_new_tokens=8, seed=1).run(
        prompts=["a", "what is it?", "xy"], image_embeds=embeds
    )
    ports = {k: out[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
    for node in (ReferenceLogprobs, Critic):
        whole = node().run(ports, image_embeds=embeds)
        parts = node(micro_batch_tokens=40).run(ports, image_embeds=embeds)  # several parts
        (key,) = whole
        torch.testing.assert_close(parts[key], whole[key], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="micro_batch_tokens=-1"):
        Critic(micro_batch_tokens=-1)
