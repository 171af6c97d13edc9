"""Mask helpers shared by the RL maths tests."""

import torch


def ragged_mask(lengths: list[int], T: int) -> torch.Tensor:
    """(B, T) right-padded 0/1 float mask with the given number of real tokens per row."""
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()  # (B, T)


def fill_padding(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """``x`` with every padded position set to ``value`` (to show padding never leaks)."""
    return torch.where(mask.bool(), x, torch.full_like(x, value))
