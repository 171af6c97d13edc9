"""What a run of a ready graph says before its first step: notes on its settings and its memory
plan, plain functions of the graph's config (and the graph). Each ready graph module exposes
:func:`run_notes` and :func:`memory_plan`, which ``yatt-graph run`` and ``yatt-graph show
--memory`` call.

:func:`run_notes`: the defaults chosen for a model of the user's, whether its chat template
formats the prompts, options set that do nothing with the others, and a learning rate that
reaches 0 before the last step. :func:`memory_plan`: the :class:`nodes.memory_plan.MemoryPlan`
of one step (:func:`step_load`).

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

import copy
import functools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from graphs.config import AUTO, RLConfig, fitted_new_tokens, users_model
from nodes.memory import HELD, Load, budget_tokens, prompt_tokens
from nodes.memory_plan import Copy, MemoryPlan, plan_memory
from nodes.models.families import has_chat_template
from yatt_graph import UsageError
from yatt_graph.errors import build_error

__all__ = ["memory_fixes", "memory_plan", "notes", "run_notes", "step_load"]


def notes(config: RLConfig, given: Collection[str] = ()) -> list[str]:
    """What a run should say about ``config`` before its first step: the defaults chosen for
    a model of the user's (of the options not in ``given``, those the user set), and whether
    its chat template formats the prompts."""
    if not users_model(config.policy):
        return []
    chosen = [f"{k}={getattr(config, k)}" for k in AUTO if hasattr(config, k) and k not in given]
    said = []
    if chosen:
        said.append(f"defaults for a model of your own (each --set overrides): {', '.join(chosen)}")
    fitted, why = fitted_new_tokens(config.policy, int(AUTO["max_new_tokens"][1]))
    if why and "max_new_tokens" not in given and config.max_new_tokens == fitted:
        said.append(why)
    path = config.policy["path"] if isinstance(config.policy, dict) else config.policy
    if has_chat_template(path):
        said.append(
            "prompts are formatted with the model's chat template"
            + ("" if config.chat_template else " (no: chat_template=false)")
        )
    return said


def run_notes(config: RLConfig, steps: int, given: Collection[str] = ()) -> list[str]:
    """What a run of ``steps`` steps (counted from 0, restored ones too) should say before
    its first: :func:`notes`, each option in ``given`` (those the user set) that does nothing
    with these settings, and a learning rate that reaches 0 before the last step."""
    said = notes(config, given)
    idle = config.idle_options()
    for name in sorted(set(given) & set(idle)):
        said.append(f"{name} does nothing with these settings: it needs {idle[name]}")
    end = config.lr_warmup_steps + config.lr_decay_steps
    if config.lr_schedule != "constant" and end < steps:
        still = f"step {end}" if end == steps - 1 else f"steps {end}-{steps - 1}"
        said.append(
            f"warning: lr_schedule={config.lr_schedule} brings the learning rate to 0 at step "
            f"{end} (lr_warmup_steps {config.lr_warmup_steps} + lr_decay_steps "
            f"{config.lr_decay_steps}), so {still} of this run will not train; set "
            f"lr_decay_steps={steps - config.lr_warmup_steps} to decay over the whole run, or "
            f"stop the run there with --steps {end}"
        )
    return said


def memory_plan(
    config: RLConfig,
    graph: Any,
    processes: dict[str, str] | None = None,
    copies: Mapping[str, Sequence[Copy]] | None = None,
    hosts: Mapping[str, str] | None = None,
) -> MemoryPlan:
    """The memory plan of ``graph`` (built from ``config``) for one step (:func:`step_load`);
    where a device does not fit, it says what to change (:func:`memory_fixes`). ``copies``
    and ``hosts``: where a run puts the copies of its nodes (:func:`nodes.memory_plan.plan_memory`)."""
    advice = functools.partial(memory_fixes, config)
    return plan_memory(graph, step_load(config, graph), processes, advice, copies, hosts)


def step_load(config: RLConfig, graph: Any) -> Load:
    """One step's :class:`nodes.memory.Load` for a ready graph built from ``config``: its
    batch, samples per prompt and response length, and its longest prompt:
    ``max_prompt_tokens`` or, without it, the longest of one batch that a copy of its data
    node draws (as the rollout's policy encodes it)."""
    rollout = graph.nodes["rollout"]
    data = copy.deepcopy(graph.nodes["data"])  # the run's own data node is not moved on
    try:
        batch = data.run()
    except UsageError:
        raise
    except Exception as exc:  # its data (a file with no rows): as the run's own build says it
        error = build_error(data, exc)
        if error is None:
            raise
        raise error from exc
    images = batch.get("images")
    # a prefix-VLM reads them as the vision tower's embeddings, an HF VLM (Qwen2-VL) itself:
    # either way they are positions of its prompts
    seen = any(e.dst_port in ("images", "image_embeds") for e in graph.inputs_of("rollout"))
    images = list(images) if images is not None and seen else None
    try:
        longest = prompt_tokens(rollout.policy_spec, list(batch["prompts"]), images)
    except UsageError as exc:  # prompts the policy cannot read: name the data they came from
        where = getattr(data, "file_label", None)
        if where is None:
            raise
        raise UsageError(f"{where}: {exc}") from exc
    if config.max_prompt_tokens is not None:
        longest = min(longest, config.max_prompt_tokens)
    pixels = max((im.width * im.height for im in images or []), default=0)
    return Load(
        prompts=config.prompts_drawn,  # (an upper bound for what trains, with dynamic sampling)
        responses=config.prompts_drawn * rollout.n,
        prompt_tokens=longest,
        response_tokens=config.max_new_tokens,
        image_pixels=pixels,
    )


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
