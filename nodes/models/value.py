"""The value model of the critic and of PPO's update: a linear value head on a policy trunk."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from nodes.models.policy import Policy, PromptBatch, build_policy
from nodes.seeding import seeded

__all__ = ["ValueModel", "build_value_model"]


class ValueModel(nn.Module):
    """``V(s_t)`` per response token: a Linear(H, 1) head on a trunk's last hidden states.

    ``values[:, t]`` reads the hidden state at the position that predicts ``response_ids[:, t]``
    (the state before token t is emitted), the usual PPO convention. With
    ``detach_trunk=True`` the value loss trains only the head (useful when the trunk is the
    policy itself and the policy loss should be its only teacher).
    """

    def __init__(self, trunk: Policy, detach_trunk: bool = False, seed: int = 0) -> None:
        super().__init__()
        self.trunk = trunk
        self.detach_trunk = bool(detach_trunk)
        self.head = nn.Linear(trunk.hidden_size, 1)
        with seeded(seed):
            nn.init.normal_(self.head.weight, std=1.0 / (trunk.hidden_size + 1) ** 0.5)
        nn.init.zeros_(self.head.bias)
        self.head.to(trunk.device)

    def forward(self, batch: PromptBatch, response_ids: Tensor, response_mask: Tensor) -> Tensor:
        """float32[B, R] values, exactly 0 (and no gradient) at padding."""
        hidden = self.trunk.response_hidden_states(batch, response_ids, response_mask)  # (B, R, H)
        if self.detach_trunk:
            hidden = hidden.detach()
        values = self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()  # (B, R)
        real = response_mask.to(values.device) > 0  # (B, R)
        return torch.where(real, values, 0.0)  # (B, R)


def build_value_model(
    critic: str | Mapping[str, Any],
    *,
    detach_trunk: bool = False,
    head_seed: int = 0,
    device: torch.device | str = "cpu",
    trunk: Policy | None = None,
) -> ValueModel:
    """The value model of a :class:`nodes.reference.Critic` (and of :class:`nodes.update.PPOUpdate`'s copy):
    a trunk from the ``critic`` spec (or the live ``trunk``) and a head seeded with
    ``head_seed``. The same arguments give the same weights, whatever the global RNG holds."""
    with seeded(head_seed):
        if trunk is None:
            trunk = build_policy(critic).to(device)
        return ValueModel(trunk, detach_trunk=detach_trunk, seed=head_seed)
