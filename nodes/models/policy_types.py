"""What a policy (:mod:`nodes.models.policy_base`) takes and gives: prompts, forwards, samples."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Generation", "PromptBatch", "ResponseForward"]


@dataclass
class PromptBatch:
    """Tokenized prompts plus whatever else the model needs to read them (image inputs)."""

    prompt_ids: Tensor
    """int64[B, P], left-padded with the pad id."""
    prompt_mask: Tensor
    """int64[B, P], 1 on real prompt tokens."""
    model_inputs: dict[str, Tensor] = field(default_factory=dict)
    """Model-specific extras: ``image_embeds`` (PrefixVLM) or ``pixel_values``,
    ``image_grid_thw``, ``mm_token_type_ids`` (HF VLMs)."""

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def to(self, device: torch.device | str) -> PromptBatch:
        return PromptBatch(
            self.prompt_ids.to(device),
            self.prompt_mask.to(device),
            {k: v.to(device) for k, v in self.model_inputs.items()},
        )


class ResponseForward(NamedTuple):
    """Teacher-forced outputs at the response positions."""

    logits: Tensor | None
    """float[B, R, V]: ``logits[:, t]`` is the next-token distribution that scores
    ``response_ids[:, t]``; None when not asked for."""
    hidden: Tensor | None
    """float[B, R, H]: the trunk's last hidden state at the same positions; None unless asked."""


class Generation(NamedTuple):
    """Finished responses, following the rollout's data conventions."""

    response_ids: Tensor
    """int64[B, R], right-padded with the pad id."""
    response_mask: Tensor
    """float32[B, R], 1.0 on real tokens including the EOS/stop token."""
    logprobs: Tensor
    """float32[B, R], log-prob of each sampled token under the temperature-scaled policy; 0 at
    padding."""
    response_lengths: Tensor
    """int64[B]."""
    texts: list[str]
    """Decoded responses (special tokens skipped; a stop string is kept)."""
    truncated: Tensor
    """bool[B]: the response was cut at ``max_new_tokens`` (it met no end token or stop string)."""
