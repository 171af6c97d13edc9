"""What a ready graph's options can change to make its memory plan fit a device.

:func:`memory_fixes` is the advice a :class:`nodes.memory_plan.MemoryPlan` prints after "WILL
NOT FIT": only changes that would lower this device's peak under the config's settings, the
part that weighs most first. Each call too large to fit beside the rest says what bounds it:
an update or a forward without gradients (reference, critic, reward model, judge) is bounded by
``micro_batch_tokens`` (turned on with a value that fits, or lowered, never below one row);
the rollout holds every response's KV cache, so its batch and response length decide. What
stays between calls (weights, AdamW state, snapshots) shrinks with ``lora_r``, with FSDP
across ranks, or in bfloat16. A fix with a value to give is worded ``set key=value``
(``yatt-graph`` shows it as ``use --set key=value``), one to lower names the value it has.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from nodes.memory import HELD, budget_tokens

if TYPE_CHECKING:
    from graphs.config import RLConfig
    from nodes.memory_plan import MemoryPlan

__all__ = ["memory_fixes"]


def _kind(parts: dict[str, int]) -> str:
    """What a node's call does, from what it holds: train, sample, images or read."""
    if parts.get("optimizer"):
        return "train"
    if parts.get("kv_cache"):
        return "sample"
    if parts.get("images"):
        return "images"
    return "read"


def memory_fixes(config: RLConfig, plan: MemoryPlan, device: str) -> list[str]:
    """The changes of ``config`` that would lower the peak of ``device`` in ``plan``, for a
    device that does not fit, the part that weighs most first: for each call too large to
    fit beside the rest, what bounds it; for what stays between calls, what shrinks it where
    that is at least half of what is over. Empty if none would."""
    room, total = plan.room.get(device, 0), plan.device_totals().get(device, 0)
    peaks = {p: v for (p, d), v in plan.peaks().items() if d == device}
    held = sum(h for h, _, _ in peaks.values())
    calls = sum(w for _, w, _ in peaks.values())
    over: dict[str, list[tuple[int, int]]] = {}  # kind -> (call bytes, bytes it may take)
    trained = False
    for _, process, d, parts in plan.rows:
        if d != device:
            continue
        kind = _kind(parts)
        trained |= kind == "train"
        call = sum(v for k, v in parts.items() if k not in HELD)
        allowed = room - (total - peaks[process][1])  # the room of the process's largest call
        if call > max(allowed, 0):
            over.setdefault(kind, []).append((call, allowed))
    step: list[str] = []  # what shrinks the calls too large to fit
    budgeted = sorted(over.get("train", []) + over.get("read", []), reverse=True)
    if budgeted:
        kind = "train" if over.get("train") and max(over["train"]) == budgeted[0] else "read"
        step += _micro_batches(config, plan, kind, *budgeted[0])
    if "train" in over and not config.gradient_checkpointing:
        step.append("set gradient_checkpointing=true (the update keeps a layer's input, not "
                    "its activations)")  # fmt: skip
    if "sample" in over:
        step.append(_responses(config, plan.load.responses))
    elif over:
        step.append(f"lower batch_size (now {config.batch_size})")
    state: list[str] = []  # what shrinks what stays between calls
    if 2 * held >= total - room:
        if trained and config.lora_r == 0:
            state.append("set lora_r=16 (adapters train instead of every weight: less AdamW "
                         "state)")  # fmt: skip
        if trained and config.train_ranks > 1 and config.train_backend == "ddp":
            state.append("set train_backend=fsdp (each rank holds 1/train_ranks of the state)")
        if config.dtype == "float32":
            state.append("set dtype=bfloat16 (half the weights)")
    return state + step if held > calls else step + state


def _micro_batches(
    config: RLConfig, plan: MemoryPlan, kind: str, call: int, allowed: int
) -> list[str]:
    """``micro_batch_tokens`` turned on, or lowered, to what lets the largest call (``call``
    bytes, of an update or a forward) take at most ``allowed`` bytes; one row at the least."""
    budget, load = config.micro_batch_tokens, plan.load
    longest = load.prompt_tokens + load.response_tokens
    if 0 < budget <= longest:
        return []  # one row a forward already
    if kind == "train":  # the update forwards a mini-batch at a time
        load = replace(load, responses=max(load.responses // max(config.mini_batches, 1), 1))
    tokens, _ = budget_tokens(budget, load)
    rows = tokens * allowed // call // longest if call > 0 and allowed > 0 else 0
    value = max(_two_digits(rows), 1) * longest  # whole rows, a round count of them
    if budget == 0:
        return [f"set micro_batch_tokens={value} (off now: one forward takes its whole batch)"]
    return [f"set micro_batch_tokens={value} (now {budget})"] if value < budget else []


def _two_digits(n: int) -> int:
    """``n`` rounded down to two significant digits (108562: 100000, 37: 37)."""
    unit = 10 ** max(len(str(n)) - 2, 0)
    return n // unit * unit


def _responses(config: RLConfig, responses: int) -> str:
    """The rollout's fix: fewer responses a step, or shorter ones."""
    group = getattr(config, "group_size", 0)
    names = [f"batch_size (now {config.batch_size})"]
    names += [f"group_size (now {group})"] if group > 1 else []
    names += [f"max_new_tokens (now {config.max_new_tokens})"]
    return (
        f"lower {', '.join(names[:-1])} or {names[-1]} (the rollout holds the KV cache of all "
        f"{responses} responses)"
    )
