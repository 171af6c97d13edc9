"""Adaptive partitioning (runtime.sched.adaptive) on synthetic step timings. Pure logic, < 1 s.

A small simulator plays the machine: each controller has a fixed amount of work per step,
which runs ``cores ** 0.7`` times faster on more cores, and ``share_cost`` times slower while
the other controller runs on a core it shares (its threads wait for the one that shares);
the partitioner only sees the step timings it produces.
"""

from __future__ import annotations

import random

import pytest

from runtime.sched.adaptive import Partitioner, StepTiming, overlap_shares
from runtime.sched.devices import Resources


def _seconds(work: float, cores: tuple[int, ...], other: tuple[int, ...], beside: float,
             share_cost: float) -> float:  # fmt: skip
    """True busy time: ``beside`` of it runs while the other controller runs, ``share_cost``
    times slower when they share a core."""
    speed = len(cores) ** 0.7
    slower = share_cost if set(cores) & set(other) else 1.0
    return work * ((1 - beside) / speed + beside * slower / speed)


def turns(alloc, work=(0.02, 0.03), overhead=0.002):
    """Two controllers that take turns (an on-policy step): c0, then c1, never at once."""
    b0 = _seconds(work[0], alloc[0], alloc[1], 0.0, 2.0)
    b1 = _seconds(work[1], alloc[1], alloc[0], 0.0, 2.0)
    spans = [(0, 0.0, b0), (1, b0, b0 + b1)]
    return StepTiming(b0 + b1 + overhead, {0: b0, 1: b1}, spans)


def beside(alloc, work=(0.01, 0.05), share_cost=2.0, overhead=0.002):
    """A rollout side (c0) that always runs beside the trainer (c1), which is busier."""
    b1_guess = _seconds(work[1], alloc[1], alloc[0], 0.2, share_cost)
    b0 = _seconds(work[0], alloc[0], alloc[1], 1.0, share_cost)
    o1 = min(1.0, b0 / b1_guess)
    b1 = _seconds(work[1], alloc[1], alloc[0], o1, share_cost)
    spans = [(0, 0.0, b0), (1, 0.0, b1)]
    return StepTiming(max(b0, b1) + overhead, {0: b0, 1: b1}, spans)


def drive(part: Partitioner, sim, steps: int, noise: float = 0.0, seed: int = 0):
    rng = random.Random(seed)
    changes = []
    for step in range(steps):
        alloc = tuple(r.cores for r in part.resources)
        t = sim(alloc)
        if noise:
            t = StepTiming(t.wall_s * (1 + rng.uniform(-noise, noise)), t.busy_s, t.spans)
        new = part.observe(t)
        if new is not None:
            changes.append((step, tuple(r.cores for r in new)))
    return changes


def _partitioner(*args, **kw):
    """A Partitioner that measures from the first step (no warm-up), so steps are easy to count."""
    return Partitioner(*args, **{"warmup": 0, **kw})


def split(cores=(0, 1)):
    half = len(cores) // 2
    return [Resources(cores[:half], half), Resources(cores[half:], len(cores) - half)]


def test_overlap_shares_measures_time_beside_others():
    spans = [(0, 0.0, 1.0), (1, 0.5, 2.0), (1, 3.0, 4.0), (0, 0.2, 0.4)]
    got = overlap_shares(spans)
    assert got[0] == pytest.approx(0.5)  # c0 busy [0, 1]; c1 beside it in [0.5, 1]
    assert got[1] == pytest.approx(0.5 / 2.5)
    assert overlap_shares([(0, 0.0, 1.0)]) == {0: 0.0}


def test_controllers_that_take_turns_get_every_core():
    part = _partitioner(split(), (0, 1), window=4, settle=1)
    changes = drive(part, turns, 100)
    assert changes[0] == (4, ((0, 1), (0, 1)))  # after one window of 4 steps
    assert len(changes) == 1  # and kept: the shared allocation was measured faster
    assert part.metrics() == {
        "sched/threads/c0": 2.0, "sched/threads/c1": 2.0, "sched/rebalances": 1.0,
        "sched/reverts": 0.0,
    }  # fmt: skip
    assert [r.threads for r in part.resources] == [2, 2]


def test_already_shared_turns_change_nothing():
    every = [Resources((0, 1), 2), Resources((0, 1), 2)]
    part = _partitioner(every, (0, 1), window=4)
    assert drive(part, turns, 100, noise=0.05) == []


@pytest.mark.parametrize("share_cost", [2.0, 5.0])
def test_the_busier_side_gets_more_cores_and_the_step_gets_faster(share_cost):
    def sim(alloc):
        return beside(alloc, share_cost=share_cost)

    cores = (0, 1, 2, 3)
    part = _partitioner(split(cores), cores, window=4, settle=1)
    first = sim(part.alloc).wall_s
    changes = drive(part, sim, 200)
    # It ends on the fastest allocation there is: 3 of the 4 cores for the trainer (c1),
    # whether sharing is cheap (every core for both was measured a little slower) or not.
    assert part.alloc == ((0,), (1, 2, 3))
    assert sim(part.alloc).wall_s < first * 0.8
    assert len(changes) <= 4 and changes[-1][0] < 50  # it settles; no flapping


def test_a_change_measured_slower_is_undone_and_not_retried_soon():
    # Sharing costs far more than the model thinks (a controller beside one it shares a
    # core with runs 5x slower), so every allocation but the starting one is slower in truth.
    def harsh(alloc):
        return beside(alloc, share_cost=5.0)

    part = _partitioner(split(), (0, 1), window=4, settle=1, patience=10)
    changes = drive(part, harsh, 120)
    shared, start, lent = ((0, 1), (0, 1)), ((0,), (1,)), ((0,), (0, 1))
    assert [alloc for _, alloc in changes] == [shared, start, lent, start]  # each tried once
    for (tried, _), (undone, _) in zip(changes[::2], changes[1::2], strict=True):
        assert undone - tried == 1 + 2  # settle + 2 steps far slower: undone at once
    assert part.alloc == start and part.reverts == 2 and part.metrics()["sched/reverts"] == 2.0
    assert part.share_cost > 4.0  # learnt: sharing is dear here
    assert harsh(start).wall_s < min(harsh(shared).wall_s, harsh(lent).wall_s)  # the truth agrees


def test_a_change_a_little_slower_is_undone_after_its_window():
    # The trial is slower, but not by the abort factor: it runs its whole window first.
    part = _partitioner(split(), (0, 1), window=4, settle=1, abort=10.0)
    changes = drive(part, lambda a: beside(a, share_cost=5.0), 30)
    assert changes[1][0] - changes[0][0] == 1 + 4 and changes[1][1] == ((0,), (1,))


def test_a_look_that_is_not_faster_is_undone_and_waits_longer_each_time():
    # On 2 cores with cheap sharing, every core for both wins; the split it started from is
    # looked at again only when its measurement is old, and ever more rarely.
    part = _partitioner(split(), (0, 1), window=4, settle=1, patience=5)
    changes = drive(part, beside, 400)
    looks = [step for step, alloc in changes if alloc == ((0,), (1,))]
    assert changes[0] == (4, ((0, 1), (0, 1))) and part.alloc == ((0, 1), (0, 1))
    gaps = [b - a for a, b in zip(looks, looks[1:])]
    assert len(looks) >= 2 and all(b > a for a, b in zip(gaps, gaps[1:]))


def test_noise_does_not_make_it_flap():
    cores = (0, 1, 2, 3)
    part = _partitioner(split(cores), cores, window=8, settle=2)
    changes = drive(part, beside, 400, noise=0.08, seed=3)
    assert len(changes) <= 4
    late = [step for step, _ in changes if step > 200]
    assert late == []  # settled within the first half


def test_the_first_steps_of_a_run_are_not_measured():
    part = Partitioner(split(), (0, 1), window=4, settle=1, warmup=5)
    changes = drive(part, turns, 20)
    assert changes[0][0] == 5 + 1 + 4 - 1  # warm-up, settle, one window (steps count from 0)


def test_cuda_and_bad_arguments():
    part = _partitioner([Resources((0,), 1, (0,)), Resources((1,), 1, (1,))], (0, 1))
    assert [r.cuda for r in part.resources] == [(0,), (1,)]  # GPUs never move
    with pytest.raises(ValueError, match="window >= 1; settle, patience and warmup >= 0"):
        Partitioner(split(), (0, 1), window=0)
    with pytest.raises(ValueError, match="alpha"):
        Partitioner(split(), (0, 1), alpha=1.5)
    with pytest.raises(ValueError, match="no cores"):
        Partitioner(split(), ())
