"""Toy nodes with the shape of an RLHF step, small enough to run in seconds on a CPU.

Source -> fake encoder -> rollout -> reward -> advantage -> update, with the updated
weights fed back to the rollout at the next step. The policy is a tiny MLP that emits
``T`` tokens per sample from the image embedding; the reward is the share of tokens
equal to the target token of the image's colour. Used by ``graphs/toy.py``, the first
notebook and the tests; the real node library lives beside this module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nodes.models.offload import Offload
from nodes.seeding import seeded
from yatt_graph import ANY, Node, Port, Tensor, node
from yatt_graph.node import Built

__all__ = [
    "FakeEncoder",
    "ToyPolicy",
    "ToyRollout",
    "ToySource",
    "ToyUpdate",
    "MatchReward",
    "normalize",
]


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


class ToySource(Node):
    """Per step, ``batch_size`` noisy single-colour 'images' and their colour labels."""

    kind = "data"
    outputs = {"images": Tensor("float32", "B", 3, "H", "W"), "labels": Tensor("int64", "B")}

    def __init__(
        self,
        batch_size: int = 16,
        classes: int = 4,
        size: int = 8,
        seed: int = 0,
        name: str | None = None,
    ):
        super().__init__(name=name)
        self.batch_size, self.classes, self.size, self.seed = batch_size, classes, size, seed
        self.palette = torch.rand(classes, 3, generator=_generator(seed, -1))  # (K, 3)

    def forward(self) -> dict[str, Any]:
        g = _generator(self.seed, self.step)
        labels = torch.randint(0, self.classes, (self.batch_size,), generator=g)  # (B,)
        images = self.palette[labels][:, :, None, None].expand(
            -1, -1, self.size, self.size
        )  # (B, 3, H, W)
        noise = 0.1 * torch.randn(images.shape, generator=g)  # (B, 3, H, W)
        return {"images": (images + noise).contiguous(), "labels": labels}


class FakeEncoder(Node):
    """A fixed random projection of the pixels: stands in for a frozen vision tower."""

    kind = "encoder"
    inputs = {"images": Tensor("float32", "B", 3, "H", "W")}
    outputs = {"image_embeds": Tensor("float32", "B", "D")}

    def __init__(self, size: int = 8, dim: int = 16, seed: int = 0, name: str | None = None):
        super().__init__(name=name)
        self.proj = (
            torch.randn(3 * size * size, dim, generator=_generator(seed, -2)) / size
        )  # (3HW, D)

    def forward(self, images: torch.Tensor) -> dict[str, Any]:
        return {"image_embeds": images.flatten(1) @ self.proj}  # (B, D)


class ToyPolicy(nn.Module):
    """Embedding -> logits over a small vocabulary, the same for every token position."""

    def __init__(self, dim: int = 16, vocab: int = 8, seed: int = 0):
        super().__init__()
        with seeded(seed):  # the same weights whatever ran before
            self.net = nn.Sequential(nn.Linear(dim, 32), nn.Tanh(), nn.Linear(32, vocab))

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        return self.net(emb)  # (B, V)


class ToyRollout(Offload, Node):
    """Sample ``length`` tokens per sample from the policy; loads new weights when given."""

    kind = "rollout"
    inputs = {"image_embeds": Tensor("float32", "B", "D"), "weights": Port(ANY, required=False)}
    outputs = {"tokens": Tensor("int64", "B", "T"), "logprobs": Tensor("float32", "B", "T")}
    policy = Built("the ToyPolicy, built by setup()")

    def __init__(
        self, dim: int = 16, vocab: int = 8, length: int = 6, seed: int = 0, name: str | None = None
    ):
        super().__init__(name=name)
        self.dim, self.vocab, self.length, self.seed = dim, vocab, length, seed

    def build(self) -> None:
        self.policy = ToyPolicy(self.dim, self.vocab, self.seed)

    @torch.no_grad()
    def forward(
        self, image_embeds: torch.Tensor, weights: dict[str, torch.Tensor] | None
    ) -> dict[str, Any]:
        if weights is not None:
            self.policy.load_state_dict(weights)
        logp = torch.log_softmax(self.policy(image_embeds), -1)  # (B, V)
        g = _generator(self.seed + 1, self.step)
        tokens = torch.multinomial(logp.exp(), self.length, replacement=True, generator=g)  # (B, T)
        return {"tokens": tokens, "logprobs": logp.gather(1, tokens)}  # (B, T)

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])


class MatchReward(Node):
    """Share of tokens equal to ``label % vocab``: the answer needs the image's colour."""

    kind = "reward"
    inputs = {"tokens": Tensor("int64", "B", "T"), "labels": Tensor("int64", "B")}
    outputs = {"scores": Tensor("float32", "B")}

    def __init__(self, vocab: int = 8, name: str | None = None):
        super().__init__(name=name)
        self.vocab = vocab

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        target = (labels % self.vocab)[:, None]  # (B, 1)
        return {"scores": (tokens == target).float().mean(1)}  # (B,)


@node(outputs={"advantages": Tensor("float32", "B")}, kind="advantage")
def normalize(scores: Tensor("float32", "B"), eps: float = 1e-6) -> dict[str, Any]:
    """Group-normalized advantages over the whole batch (one group)."""
    return {"advantages": (scores - scores.mean()) / (scores.std(unbiased=False) + eps)}  # (B,)


class ToyUpdate(Offload, Node):
    """A PPO-clip step on the policy; emits the new weights and the step's metrics."""

    kind = "update"
    inputs = {
        "image_embeds": Tensor("float32", "B", "D"),
        "tokens": Tensor("int64", "B", "T"),
        "logprobs": Tensor("float32", "B", "T"),
        "advantages": Tensor("float32", "B"),
    }
    outputs = {"weights": ANY, "metrics": ANY}
    policy = Built("the ToyPolicy it trains, built by setup()")
    optimizer = Built("its Adam")

    def __init__(
        self,
        dim: int = 16,
        vocab: int = 8,
        lr: float = 0.05,
        clip: float = 0.2,
        epochs: int = 2,
        seed: int = 0,
        name: str | None = None,
    ):
        super().__init__(name=name)
        self.dim, self.vocab, self.lr, self.seed = dim, vocab, lr, seed
        self.clip, self.epochs = clip, epochs

    def build(self) -> None:
        self.policy = ToyPolicy(self.dim, self.vocab, self.seed)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=self.lr)

    def forward(self, image_embeds, tokens, logprobs, advantages) -> dict[str, Any]:
        for _ in range(self.epochs):
            logp = torch.log_softmax(self.policy(image_embeds), -1).gather(1, tokens)  # (B, T)
            ratio = (logp - logprobs).exp()  # (B, T)
            adv = advantages[:, None]  # (B, 1)
            loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - self.clip, 1 + self.clip)).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
        weights = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
        return {"weights": weights, "metrics": {"loss": loss.item()}}

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
