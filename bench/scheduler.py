"""Benchmark: the dynamic batching scheduler against static batching, and placement modes.

    .venv/bin/python -m bench.scheduler            # about 2 min on a 2-core machine
    .venv/bin/python -m bench.scheduler --quick    # a smaller smoke run
    .venv/bin/python -m bench.scheduler --part a --slots 8   # (a) alone, on 8 cores
    .venv/bin/python -m bench.scheduler --json out.json

(a) Long tail. 2048 samples whose costs are drawn from a lognormal (sigma 2, capped at 150
    units like a max response length), arriving as requests of 4 samples from 2 producers.
    One unit of cost is ``ITERS_PER_UNIT`` real 128x128 float32 matmuls (no sleeping), with
    ``torch.set_num_threads(1)`` in each of ``--slots`` CPU worker slots (default 2, at
    most one a core).
    *static*: batches of one request per slot (8 samples on 2 slots), split by count, 4
    samples a slot, a barrier after each batch.
    *scheduler*: :class:`bench.sim.scheduler.Scheduler`, fusing up to as many samples per call,
    splitting by cost with Karmarkar-Karp, no barrier. The lower bound is total work / slots,
    with the work timed while all slots run (so that sharing the cores is not counted as
    waste).

(b) Rollout + generative reward. Each step generates responses for 64 prompts with ragged
    lengths (lognormal, median 96 tokens, capped at 384): a real decode loop, one
    ``[active, D] @ [D, D]`` matmul per token over the rows still generating. A generative
    reward then reads each response (a ``[L, D] @ [D, D]`` prefill) and decodes a critique
    of C tokens with its own weights. *colocated*: both roles on both slots, the group
    switching role together, each switch a measured offload/reload (memcpy) of what the
    role keeps on the device: its weights and 60 MB of other state (KV cache). *partial*:
    rollout on slot 0, reward on slot 1, samples streamed to the reward as they finish,
    the rollout of step t+1 overlapping the reward of step t (one step of staleness).
    Reported: the rollout-phase wall time (first prompt in, last score out).
    Partial placement gives each side one slot, so it is bound by the busier side: the
    bench sweeps C (``--critiques``), which moves the work from the rollout side to the
    reward side, and names the C where the two partial slots are the most evenly busy.
    ``--layers K`` gives each role K weight matrices, token t using matrix t % K: with K=32
    (the default: 128 MB a role) every decode step reads its weights from memory, as a real
    model's decode does, so a long tail of a few rows costs what it costs on real hardware,
    and a switch moves 188 MB each way. With K=1 a role's 4 MB of weights stay in this CPU's
    cache, a decode step over a few rows is cheap, and a switch moves 64 MB.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from bench._util import machine
from bench.sim.placement import colocated, partial
from bench.sim.scheduler import Scheduler
from runtime.sched.devices import Slot, SlotPool, usable_cores
from yatt_graph import BatchPolicy
from yatt_graph.partition import karmarkar_karp, lpt

__all__ = ["long_tail", "main", "rollout_reward"]

ITERS_PER_UNIT = 24
MATMUL = 128
SLOTS = 2


# --- (a) long tail ---------------------------------------------------------------------------


def _mm_operands() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(MATMUL, MATMUL, generator=g)  # [M, M]
    b = torch.randn(MATMUL, MATMUL, generator=g) / MATMUL**0.5  # [M, M]
    return a, b


_local = threading.local()


def _spin(iters: int) -> float:
    """Real work: ``iters`` matmuls; returns a number so that nothing is optimized away."""
    ops = getattr(_local, "ops", None)
    if ops is None:
        ops = _local.ops = _mm_operands()
    a, b = ops
    c = a
    for _ in range(iters):
        c = torch.mm(a, b)  # [M, M]
    return float(c[0, 0])


def _iters(cost: float) -> int:
    return max(1, round(cost * ITERS_PER_UNIT))


def _calibrate(slots: int, iters: int = 8000) -> tuple[float, float]:
    """Seconds per matmul alone, and with ``slots`` threads running at once."""
    torch.set_num_threads(1)
    _spin(50)
    t = time.perf_counter()
    _spin(iters)
    alone = (time.perf_counter() - t) / iters

    def run() -> float:
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        _spin(iters)
        return time.perf_counter() - t0

    with ThreadPoolExecutor(slots) as ex:
        t = time.perf_counter()
        list(ex.map(lambda _: run(), range(slots)))
        wall = time.perf_counter() - t
    return alone, wall / iters  # per matmul, per slot, when all slots are busy


def _draw_costs(n: int, sigma: float, cap: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [min(cap, rng.lognormvariate(0.0, sigma)) for _ in range(n)]


def _count_split(
    requests: list[list[float]], per_batch: int, slots: int
) -> Iterator[list[list[float]]]:
    """Static batching's batches of ``per_batch`` requests, each split by count over the slots."""
    for b in range(0, len(requests), per_batch):
        batch = [c for r in requests[b : b + per_batch] for c in r]
        size = math.ceil(len(batch) / slots)
        yield [batch[s * size : (s + 1) * size] for s in range(slots)]


def _static(requests: list[list[float]], per_batch: int, slots: int) -> dict[str, Any]:
    """Barrier per batch of ``per_batch`` requests; each batch split by count over the slots."""
    busy = [0.0] * slots

    def chunk(slot: int, costs: list[float]) -> None:
        t = time.perf_counter()
        for c in costs:
            _spin(_iters(c))
        busy[slot] += time.perf_counter() - t

    with ThreadPoolExecutor(slots, initializer=torch.set_num_threads, initargs=(1,)) as ex:
        list(ex.map(lambda _: _spin(10), range(slots)))  # warm the threads
        t0 = time.perf_counter()
        for parts in _count_split(requests, per_batch, slots):
            futures = [ex.submit(chunk, s, part) for s, part in enumerate(parts)]
            for f in futures:  # the barrier
                f.result()
        makespan = time.perf_counter() - t0
    return {"makespan_s": makespan, "busy_s": busy}


def _dynamic(
    requests: list[list[float]], max_batch: int, method: str, slots: int
) -> dict[str, Any]:
    def work(inputs: dict[str, Any], device: Slot) -> dict[str, Any]:
        return {"done": [_spin(_iters(c)) for c in inputs["cost"]]}

    sched = Scheduler(SlotPool.cpu(slots), partition=method, threads_per_worker=1)
    sched.add(
        "work",
        work,
        policy=BatchPolicy(max_batch_size=max_batch),
        max_queue_delay_s=0.002,
        cost=lambda batch: batch["cost"],
    )
    with sched:
        t0 = time.perf_counter()
        tickets: list[Any] = []

        def producer(k: int) -> None:
            for r in requests[k::2]:
                tickets.append(sched.submit("work", {"cost": r}))

        producers = [threading.Thread(target=producer, args=(k,)) for k in range(2)]
        for p in producers:
            p.start()
        for p in producers:
            p.join()
        for t in tickets:
            t.result(timeout=600)
        makespan = time.perf_counter() - t0
        summary = sched.summary()
    return {
        "makespan_s": makespan,
        "busy_s": [d["busy_s"] for d in summary["slots"].values()],
        "calls": summary["nodes"]["work"]["calls"],
        "queue_wait_s": summary["nodes"]["work"]["mean_queue_wait_s"],
    }


def _partition_quality(requests: list[list[float]], per_batch: int, slots: int) -> dict[str, float]:
    """Mean heaviest-part / ideal over the static batches, for three ways to split them."""
    out = {"count": 0.0, "lpt": 0.0, "kk": 0.0}
    n = 0
    for parts in _count_split(requests, per_batch, slots):
        costs = [c for part in parts for c in part]
        ideal = sum(costs) / slots
        out["count"] += max(sum(part) for part in parts) / ideal
        out["lpt"] += max(sum(costs[i] for i in p) for p in lpt(costs, slots)) / ideal
        out["kk"] += max(sum(costs[i] for i in p) for p in karmarkar_karp(costs, slots)) / ideal
        n += 1
    return {k: v / n for k, v in out.items()}


def _barrier_bound(requests: list[list[float]], per_batch: int, slots: int) -> float:
    """What static batching costs on idle cores, in units: the heaviest part of every batch."""
    return sum(
        max(sum(part) for part in parts) for parts in _count_split(requests, per_batch, slots)
    )


def long_tail(
    samples: int = 2048, sigma: float = 2.0, cap: float = 150.0, rounds: int = 4, slots: int = SLOTS
) -> dict[str, Any]:
    """Static vs scheduler on the same samples, interleaved in ``rounds`` so that both see the
    same background load (this machine is shared); the lower bound is re-measured each round.
    A static batch gives each of the ``slots`` 4 samples (one request)."""
    per_request, per_batch = 4, slots  # static batch = one request per slot
    max_batch = per_request * per_batch  # the scheduler fuses up to as many samples a call
    costs = _draw_costs(samples, sigma, cap, seed=0)
    requests = [costs[i : i + per_request] for i in range(0, samples, per_request)]
    chunk = math.ceil(len(requests) / rounds)
    totals = {"static": [0.0, [0.0] * slots], "scheduler": [0.0, [0.0] * slots]}
    lower, alone_sum, shared_sum, calls, waits, busy_lb = 0.0, 0.0, 0.0, 0, [], 0.0
    for k in range(rounds):
        part = requests[k * chunk : (k + 1) * chunk]
        alone, shared = _calibrate(slots)
        alone_sum, shared_sum = alone_sum + alone, shared_sum + shared
        lower += sum(_iters(c) for r in part for c in r) * shared / slots
        runs = [("static", lambda p=part: _static(p, per_batch, slots))]
        runs.append(("scheduler", lambda p=part: _dynamic(p, max_batch, "kk", slots)))
        for name, run in runs if k % 2 == 0 else runs[::-1]:
            r = run()
            totals[name][0] += r["makespan_s"]
            totals[name][1] = [a + b for a, b in zip(totals[name][1], r["busy_s"])]
            if name == "scheduler":
                busy_lb += sum(r["busy_s"]) / slots
                calls += r["calls"]
                waits.append(r["queue_wait_s"])

    def figures(name: str) -> dict[str, Any]:
        makespan, busy = totals[name]
        return {
            "makespan_s": makespan,
            "over_lower_bound": makespan / lower,
            "utilization": [b / makespan for b in busy],
        }

    static, dynamic = figures("static"), figures("scheduler")
    dynamic.update(calls=calls, mean_queue_wait_s=sum(waits) / len(waits))
    return {
        "samples": samples,
        "slots": slots,
        "cost": f"lognormal(0, {sigma}) capped at {cap}",
        "total_units": sum(costs),
        "largest_sample_units": max(costs),
        "matmuls": sum(_iters(c) for c in costs),
        "matmul_s_alone": alone_sum / rounds,
        "matmul_s_all_slots_busy": shared_sum / rounds,
        "lower_bound_s": lower,
        "lower_bound_from_scheduler_busy_s": busy_lb,
        "static": static,
        "scheduler": dynamic,
        "speedup": static["makespan_s"] / dynamic["makespan_s"],
        "static_over_lb_on_idle_cores": _barrier_bound(requests, per_batch, slots)
        / (sum(costs) / slots),
        "partition_heaviest_over_ideal": _partition_quality(requests, per_batch, slots),
    }


# --- (b) rollout + generative reward -------------------------------------------------------


class _Models:
    """Per-slot weights for the two roles, plus the offload buffers a switch copies through."""

    def __init__(self, dim: int, role_mb: int, slots: int, layers: int):
        g = torch.Generator().manual_seed(1)
        # Each role: ``layers`` [D, D] matrices; token t uses matrix t % layers.
        self.policy = [torch.randn(dim, dim, generator=g) / dim**0.5 for _ in range(layers)]
        self.reward = [torch.randn(dim, dim, generator=g) / dim**0.5 for _ in range(layers)]
        # What a role keeps resident on a device, its weights and role_mb of other state
        # (KV cache, activations), and its host copy: a switch moves all of it.
        n = (role_mb * 2**20 + layers * dim * dim * 4) // 4
        self.resident = [torch.zeros(n) for _ in range(slots)]  # [n] per slot
        self.host = {r: torch.ones(n) for r in ("rollout", "reward")}  # [n] per role

    def switch(self, device: Slot, old: str, new: str) -> None:
        slot = self.resident[device.index]
        self.host[old].copy_(slot)  # offload the old role
        slot.copy_(self.host[new])  # reload the new one


def _generate(models: _Models, lengths: list[int], dim: int) -> Any:
    """Decode until each row reaches its length; yield rows as they finish (streaming)."""
    n = len(lengths)
    h = torch.randn(n, dim, generator=torch.Generator().manual_seed(n)) / dim**0.5  # [n, D]
    active = list(range(n))
    for t in range(max(lengths)):
        idx = torch.tensor(active)  # [a]
        w = models.policy[t % len(models.policy)]  # [D, D]
        h[idx] = torch.tanh(h[idx] @ w)  # [a, D]
        done = [i for i in active if lengths[i] == t + 1]
        if done:
            active = [i for i in active if lengths[i] > t + 1]
            yield done, {"length": [lengths[i] for i in done], "state": h[done].clone()}


def _judge(models: _Models, lengths: list[int], state: torch.Tensor, critique: int) -> list[float]:
    """A generative reward: read each response (prefill), then decode a critique for all rows."""
    dim = state.shape[1]
    g = torch.Generator().manual_seed(len(lengths))
    ws = models.reward
    for i, length in enumerate(lengths):
        x = torch.randn(length, dim, generator=g)  # [L, D]: the response's token states
        torch.tanh(x @ ws[i % len(ws)])  # [L, D]
    h = state  # [n, D]
    for t in range(critique):
        h = torch.tanh(h @ ws[t % len(ws)])  # [n, D]
    return h[:, 0].tolist()


def _rollout_run(
    mode: str, steps: list[list[int]], models: _Models, dim: int, critique: int
) -> dict[str, Any]:
    pool = SlotPool.cpu(SLOTS)
    if mode == "colocated":
        placement = colocated(["rollout", "reward"], SLOTS, barrier=True)
    else:
        placement = partial({"rollout": "rollout", "reward": "reward"}, SLOTS)
    sched = Scheduler(pool, placement=placement, on_switch=models.switch)

    def rollout(inputs: dict[str, Any], device: Slot) -> Any:
        yield from _generate(models, inputs["length"], dim)

    def reward(inputs: dict[str, Any], device: Slot) -> dict[str, Any]:
        return {"score": _judge(models, inputs["length"], inputs["state"], critique)}

    # Response lengths are unknown before generation: the rollout splits by count (cost 1).
    sched.add(
        "rollout", rollout, streaming=True, keep=True, cost=lambda b: [1.0] * len(b["length"])
    )
    sched.add(
        "reward",
        reward,
        policy=BatchPolicy(max_batch_size=16),
        max_queue_delay_s=0.05,
        cost=lambda b: [float(x) for x in b["length"]],
    )
    sched.connect("rollout", "reward")
    with sched:
        t0 = time.perf_counter()
        rollout_done, tickets = [], []
        for lengths in steps:
            if mode == "colocated" and tickets:
                tickets[-1].result("reward", timeout=600)  # synchronous steps
            if mode == "partial" and len(tickets) >= 2:
                tickets[-2].result("reward", timeout=600)  # at most one step of staleness
            if mode == "partial" and tickets:
                tickets[-1].result("rollout", timeout=600)
            tickets.append(sched.submit("rollout", {"length": lengths}))
        for t in tickets:
            t.result("reward", timeout=600)
            rollout_done.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t0
        s = sched.summary()
    return {
        "wall_s": wall,
        "utilization": {k: v["utilization"] for k, v in s["slots"].items()},
        "switch_s": sum(v["switch_s"] for v in s["slots"].values()),
        "switches": sum(v["switches"] for v in s["slots"].values()),
        "reward_mean_queue_wait_s": s["nodes"]["reward"]["mean_queue_wait_s"],
        "reward_mean_batch": s["nodes"]["reward"]["mean_batch_samples"],
    }


def rollout_reward(
    n_steps: int = 6,
    prompts: int = 64,
    dim: int = 1024,
    median_len: int = 96,
    max_len: int = 384,
    critique: int = 48,
    role_mb: int = 60,
    reps: int = 3,
    layers: int = 32,
) -> dict[str, Any]:
    rng = random.Random(1)
    steps = [
        [
            max(1, min(max_len, round(rng.lognormvariate(math.log(median_len), 0.7))))
            for _ in range(prompts)
        ]
        for _ in range(n_steps)
    ]
    torch.set_num_threads(1)
    models = _Models(dim, role_mb, SLOTS, layers)
    # Interleaved repeats (C P, P C, C P ...) so that both modes see the same background load.
    runs: dict[str, list[dict[str, Any]]] = {"colocated": [], "partial": []}
    for k in range(reps):
        for mode in ("colocated", "partial") if k % 2 == 0 else ("partial", "colocated"):
            runs[mode].append(_rollout_run(mode, steps, models, dim, critique))

    def total(mode: str) -> dict[str, Any]:
        rs = runs[mode]
        wall = sum(r["wall_s"] for r in rs)
        return {
            "wall_s": wall,
            "wall_s_per_repeat": [r["wall_s"] for r in rs],
            # Busy share of each slot over all repeats (weighted by each repeat's wall time).
            "utilization": {
                d: sum(r["utilization"][d] * r["wall_s"] for r in rs) / wall
                for d in rs[0]["utilization"]
            },
            "switch_s": sum(r["switch_s"] for r in rs),
            "switches": sum(r["switches"] for r in rs),
            "reward_mean_queue_wait_s": sum(r["reward_mean_queue_wait_s"] for r in rs) / len(rs),
            "reward_mean_batch": sum(r["reward_mean_batch"] for r in rs) / len(rs),
        }

    colo, part = total("colocated"), total("partial")
    savings = [1 - p / c for p, c in zip(part["wall_s_per_repeat"], colo["wall_s_per_repeat"])]
    busy = list(part["utilization"].values())
    return {
        "partial_imbalance": abs(busy[0] - busy[1]),
        "repeats": reps,
        "partial_saving_per_repeat": savings,
        "steps": n_steps,
        "prompts_per_step": prompts,
        "dim": dim,
        "weights_mb_per_role": layers * dim * dim * 4 / 2**20,
        "response_lengths": f"lognormal(median {median_len}, sigma 0.7) capped at {max_len}; "
        f"mean {sum(map(sum, steps)) / (n_steps * prompts):.0f}, max {max(map(max, steps))}",
        "critique_tokens": critique,
        "switch_memcpy_mb": 2 * (role_mb + layers * dim * dim * 4 / 2**20),
        "colocated": colo,
        "partial": part,
        "partial_saving": 1 - part["wall_s"] / colo["wall_s"],
    }


def sweep(critiques: list[int], **options: Any) -> dict[str, Any]:
    """:func:`rollout_reward` for each critique length; ``balanced``: the one whose partial
    slots are the most evenly busy (the regime partial placement is for)."""
    runs = {c: rollout_reward(critique=c, **options) for c in critiques}
    balanced = min(runs, key=lambda c: runs[c]["partial_imbalance"])
    return {"by_critique": runs, "balanced_critique": balanced}


# --- report --------------------------------------------------------------------------------


def _utl(xs: list[float] | dict[str, float]) -> str:
    vals = xs.values() if isinstance(xs, dict) else xs
    return " / ".join(f"{x:.0%}" for x in vals)


def _report_a(a: dict[str, Any]) -> list[str]:
    st, dy, n = a["static"], a["scheduler"], a["slots"]
    lines = [
        f"(a) long tail: {a['samples']} samples, cost {a['cost']}, {a['matmuls']} matmuls "
        f"{MATMUL}x{MATMUL}; largest sample {a['largest_sample_units']:.0f} of "
        f"{a['total_units']:.0f} units",
        f"    matmul {a['matmul_s_alone'] * 1e6:.1f} us alone, "
        f"{a['matmul_s_all_slots_busy'] * 1e6:.1f} us per slot with all {n} slots busy",
        f"    lower bound (work / {n} slots, work timed with all slots busy): "
        f"{a['lower_bound_s']:.2f} s (the scheduler's own busy time / {n}: "
        f"{a['lower_bound_from_scheduler_busy_s']:.2f} s)",
        f"    static    : {st['makespan_s']:6.2f} s  {st['over_lower_bound']:.2f}x LB  "
        f"utilization {_utl(st['utilization'])}",
        f"    scheduler : {dy['makespan_s']:6.2f} s  {dy['over_lower_bound']:.2f}x LB  "
        f"utilization {_utl(dy['utilization'])}  ({dy['calls']} calls)",
        f"    speedup {a['speedup']:.2f}x (static on idle cores would be "
        f"{a['static_over_lb_on_idle_cores']:.2f}x LB); heaviest part / ideal per static batch: "
        + ", ".join(f"{k} {v:.3f}" for k, v in a["partition_heaviest_over_ideal"].items()),
    ]
    return lines


def _report_b(b: dict[str, Any]) -> list[str]:
    first = next(iter(b["by_critique"].values()))
    lines = [
        f"(b) rollout + generative reward: {first['repeats']} x {first['steps']} steps x "
        f"{first['prompts_per_step']} prompts, D={first['dim']}, "
        f"{first['weights_mb_per_role']:.0f} MB of weights a role, lengths "
        f"{first['response_lengths']}; critique C tokens"
    ]
    for c, r in b["by_critique"].items():
        mark = "  <- the most balanced" if c == b["balanced_critique"] else ""
        lines.append(
            f"    C={c:<3d} colocated {r['colocated']['wall_s']:6.2f} s (utilization "
            f"{_utl(r['colocated']['utilization'])}, {r['colocated']['switches']} switches, "
            f"{r['colocated']['switch_s']:.2f} s)  partial {r['partial']['wall_s']:6.2f} s "
            f"(utilization {_utl(r['partial']['utilization'])}, reward batch "
            f"{r['partial']['reward_mean_batch']:.1f})  partial saves {r['partial_saving']:.0%} "
            f"(per repeat {', '.join(f'{x:.0%}' for x in r['partial_saving_per_repeat'])}){mark}"
        )
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run (smoke test)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument(
        "--critiques",
        type=int,
        nargs="+",
        default=[0, 16, 32, 48],
        help="(b): the reward's critique lengths to measure",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=32,
        help="(b): weight matrices per role, token t using t %% K (1: weights in the cache)",
    )
    parser.add_argument(
        "--part", choices=["a", "b", "all"], default="all", help="run only (a) or only (b)"
    )
    parser.add_argument(
        "--slots",
        type=int,
        default=SLOTS,
        help="(a): CPU worker slots, at most one per core (static batches give each 4 samples)",
    )
    args = parser.parse_args(argv)
    cores = usable_cores()
    if not 1 <= args.slots <= cores:
        parser.error(
            f"--slots {args.slots}: give 1 to {cores}, one slot per core this process may use "
            "(slots sharing a core would measure time-sharing, not devices)"
        )
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    result: dict[str, Any] = {"machine": machine(), "load_average_before_after": [load0]}
    lines: list[str] = []
    if args.part in ("a", "all"):
        a = long_tail(samples=256, slots=args.slots) if args.quick else long_tail(slots=args.slots)
        result["long_tail"] = a
        lines += _report_a(a)
    if args.part in ("b", "all"):
        if args.quick:
            b = sweep(args.critiques[:2], n_steps=2, prompts=32, reps=2, layers=args.layers)
        else:
            b = sweep(args.critiques, layers=args.layers)
        result["rollout_reward"] = b
        lines += _report_b(b)
    result["load_average_before_after"].append(os.getloadavg()[0])
    result["bench_wall_s"] = time.perf_counter() - t0
    print("\n".join(lines))
    print(
        f"machine: {result['machine']}; 1-min load average {load0:.2f} -> {os.getloadavg()[0]:.2f}; "
        f"bench took {result['bench_wall_s']:.0f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
