"""How an update steps: its learning-rate schedule.

The schedule counts the update's calls (one a training step, whatever its epochs and
mini-batches): ``lr_warmup_steps`` steps rising linearly from ``lr / warmup`` to ``lr``, then
``constant``, or ``linear`` / ``cosine`` decay to 0 over ``lr_decay_steps`` more steps (and 0
after them). The count is the node's checkpointed ``updates``, so a resumed run goes on where it
stopped.
"""

from __future__ import annotations

import math

__all__ = ["LR_SCHEDULES", "lr_factor", "schedule_problem"]

LR_SCHEDULES = ("constant", "linear", "cosine")


def schedule_problem(schedule: str, warmup: int, decay: int) -> str | None:
    """What is wrong with a schedule's settings, or None."""
    if schedule not in LR_SCHEDULES:
        return f"lr_schedule={schedule!r}; choose one of {', '.join(LR_SCHEDULES)}"
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        return f"lr_warmup_steps={warmup!r}; it must be a whole number >= 0"
    if not isinstance(decay, int) or isinstance(decay, bool) or decay < 0:
        return f"lr_decay_steps={decay!r}; it must be a whole number >= 0"
    if schedule != "constant" and decay == 0:
        return f"lr_schedule={schedule!r} decays over lr_decay_steps steps: set it (> 0)"
    return None


def lr_factor(step: int, schedule: str, warmup: int, decay: int) -> float:
    """The share of the peak learning rate at training step ``step`` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    done = min(1.0, (step - warmup) / decay)
    return 1.0 - done if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
