"""Weight sync, the consumer's side: versions, partial updates, loading, and exact round trips
through the codec (what an update publishes: tests/nodes/test_update.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nodes.sync import WeightUpdate, apply_weights
from runtime.codec import decode_value, encode_value


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.norm = nn.BatchNorm1d(8)  # has a 0-d int64 buffer (num_batches_tracked)
        self.head = nn.Linear(8, 3)
        self.register_buffer("flags", torch.tensor([True, False, True]))

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids).mean(1)))


def make_net(seed: int) -> TinyNet:
    torch.manual_seed(seed)
    net = TinyNet()
    net.norm.running_mean.uniform_()  # non-default buffers, so that loading them is visible
    net.norm.num_batches_tracked.fill_(7)
    return net.eval()


def _exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


def _published(net: nn.Module, version: int = 1) -> WeightUpdate:
    """What an update node publishes of ``net``: a snapshot of its state dict."""
    return WeightUpdate({k: v.detach().clone() for k, v in net.state_dict().items()}, version)


def _across_controllers(value, **kw):
    """What a consumer on another controller receives: the data-plane codec, frames as bytes."""
    return decode_value([bytes(memoryview(f).cast("B")) for f in encode_value(value, **kw)])


def test_an_update_crosses_the_codec_exactly_for_all_dtypes():
    net = make_net(0)
    sd = dict(net.state_dict())
    sd["bf16"] = torch.randn(4, 5).to(torch.bfloat16)
    sd["f16"] = torch.randn(3).half()
    sd["nan"] = torch.tensor([float("nan"), float("inf"), -0.0])
    sd["strided"] = torch.randn(4, 6)[:, ::2]  # not contiguous
    sd["scalar"] = torch.tensor(3.5)
    sd["empty"] = torch.zeros(0, 4)
    sd["big"] = torch.randn(64, 64)  # past the inline limit: a frame of its own
    for inline in (0, 1024):
        back = _across_controllers(WeightUpdate(sd, 5, complete=False), inline=inline)
        assert isinstance(back, WeightUpdate) and back.version == 5 and back.complete is False
        assert list(back.weights) == list(sd)
        for k in sd:
            assert _exact(back.weights[k], sd[k]), k


def test_loading_the_round_trip_into_a_fresh_model_reproduces_outputs():
    trained, fresh = make_net(0), make_net(1)
    ids = torch.randint(0, 11, (4, 6))
    assert not torch.allclose(trained(ids), fresh(ids))
    update = _across_controllers(_published(trained))
    assert apply_weights(fresh, update) == 1
    assert torch.equal(fresh(ids), trained(ids))
    assert fresh.norm.num_batches_tracked.item() == 7


def test_bf16_model_round_trip_reproduces_outputs():
    trained, fresh = make_net(0).to(torch.bfloat16), make_net(1).to(torch.bfloat16)
    ids = torch.randint(0, 11, (2, 3))
    apply_weights(fresh, _across_controllers(_published(trained)))
    assert fresh.head.weight.dtype == torch.bfloat16
    assert torch.equal(fresh(ids), trained(ids))


def test_a_consumer_loads_newer_versions_only_and_a_partial_update_only_its_keys():
    net = make_net(0)
    first = _published(net, 1)
    with torch.no_grad():
        net.head.weight.add_(1.0)  # an optimizer step after publishing
    second = _published(net, 2)
    consumer = make_net(1)
    assert apply_weights(consumer, second) == 2
    assert apply_weights(consumer, first, last_version=2) == 2  # stale: skipped
    assert torch.equal(consumer.head.weight, net.head.weight)
    with torch.no_grad():
        net.embed.weight[0, 0] += 1.0
        consumer.embed.weight.zero_()
    delta = WeightUpdate({"embed.weight": net.embed.weight.clone()}, 3, complete=False)
    assert apply_weights(consumer, _across_controllers(delta)) == 3  # loads only its keys
    assert torch.equal(consumer.embed.weight, net.embed.weight)
    assert torch.equal(consumer.head.weight, net.head.weight)


def test_apply_weights_errors():
    with pytest.raises(TypeError, match="cannot read weights from a list"):
        apply_weights(make_net(0), [torch.ones(1)])
    with pytest.raises(ValueError, match="entry 'optimizer' is a dict; only tensors"):
        apply_weights(make_net(0), {"optimizer": {}})
    with pytest.raises(
        ValueError, match="1 weight name\\(s\\) not in this model, e.g. \\['extra'\\]"
    ):
        apply_weights(make_net(0), {**make_net(0).state_dict(), "extra": torch.ones(1)})
    incomplete = WeightUpdate({"head.bias": torch.zeros(3)}, version=1, complete=True)
    with pytest.raises(ValueError, match="a complete update lacks"):
        apply_weights(make_net(0), incomplete)


def test_a_rollout_loads_a_partial_update_that_crossed_the_codec():
    from nodes.models.policy import tiny_prefix_vlm
    from nodes.rollout import Rollout

    target = tiny_prefix_vlm(seed=4)
    node = Rollout(model=tiny_prefix_vlm(seed=0), max_new_tokens=4, seed=0)
    name = next(iter(target.state_dict()))
    update = WeightUpdate({name: target.state_dict()[name].clone()}, 1, complete=False)
    node.run(prompts=["hi"], image_embeds=torch.zeros(1, 32), weights=_across_controllers(update))
    assert node.weights_version == 1
    assert torch.equal(node.policy.state_dict()[name], target.state_dict()[name])


def test_a_loaded_update_is_not_held_after_it_is_loaded():
    """The payload is a copy of the weights (on the update's device); a rollout that kept it
    to recognize it again would hold that copy beside its own. The version recognizes it."""
    import gc
    import weakref

    from nodes.models.policy import tiny_prefix_vlm
    from nodes.rollout import Rollout

    node = Rollout(model=tiny_prefix_vlm(seed=0), max_new_tokens=2, seed=0)
    state = {k: v.clone() for k, v in tiny_prefix_vlm(seed=4).state_dict().items()}
    update = WeightUpdate(state, version=1)
    watched = weakref.ref(next(iter(state.values())))
    node.run(prompts=["hi"], image_embeds=torch.zeros(1, 32), weights=update)
    again = node.weights_in.newer(update, node.name)
    assert node.weights_version == 1 and again is None  # the same version: not loaded again
    del update, state, again
    gc.collect()
    assert watched() is None
    plain = {k: v.clone() for k, v in tiny_prefix_vlm(seed=5).state_dict().items()}
    node.run(prompts=["hi"], image_embeds=torch.zeros(1, 32), weights=plain)
    assert node.weights_in.newer(plain, node.name) is None  # an unversioned dict: by identity
