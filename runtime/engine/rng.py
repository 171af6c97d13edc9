"""The random state of one process, as the executors save and restore it with a step."""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch's CPU generator and Python's ``random``)."""
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(rng: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned; a missing key leaves that generator alone."""
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "python" in rng:
        random.setstate(rng["python"])
