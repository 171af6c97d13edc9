"""Seeded draws from torch's global random generators, with their state restored after."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["seeded", "step_seed"]


@contextlib.contextmanager
def seeded(seed: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """Inside the block, torch's CPU generator (and ``device``'s, when it is a GPU) starts from
    ``seed``; after it, every generator is as it was.

    Unlike ``torch.manual_seed``, it touches only the generators the block draws from: that one
    also queues a seed for every backend not initialized yet (CUDA, XPU, MTIA), recording a
    stack trace for each, about 1 ms a call on a CPU, and leaves the CUDA state changed."""
    device = torch.device(device)
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.random.default_generator.manual_seed(int(seed))
        for d in cuda:
            with torch.cuda.device(d):
                torch.cuda.manual_seed(int(seed))
        yield


def step_seed(seed: int, step: int) -> int:
    """The seed of call ``step`` of a node seeded with ``seed`` (rollouts, updates)."""
    return (seed * 1_000_003 + step) % (2**63 - 1)
