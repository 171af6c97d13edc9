"""Property tests of the staleness rule over random graphs and random timings (no processes).

Two step engines are wired by hand (tests/runtime/staleness_sim.py) and every message between
them (RUN, values, stream pieces and ends) is delivered in an order a seeded random choice
draws. Whatever the timing: no delayed read is older than ``max_staleness`` versions or from
the future, each step runs every node exactly once, the staleness each step reports is what
the node read, memory stays bounded, and in fixed mode (or with K=0) the results equal the
in-process run.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from staleness_sim import Spec, build, simulate

from runtime import LocalExecutor

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    n = draw(st.integers(2, 5))
    inputs: list[tuple[int, ...]] = [()]
    for i in range(1, n):
        earlier = draw(st.lists(st.integers(0, i - 1), max_size=2, unique=True))
        inputs.append(tuple(sorted(earlier)))  # () makes another source
    streaming = tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    place = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    if len(set(place)) == 1:
        place[-1] = 1 - place[0]  # both engines hold a node
    dsts = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2, unique=True))
    delayed = tuple((draw(st.integers(0, n - 1)), d) for d in dsts)  # feedback or forward
    return Spec(tuple(inputs), streaming, tuple(place), delayed)


def check_reads(spec: Spec, run, K: int, mode: str, start: int, stop: int) -> None:
    """Every delayed read within the bound, none from the future, each one what was reported,
    and the value read the producer's value of that step."""
    last: dict[int, int] = {}
    for k in range(start, stop):
        out = run.outputs[k]
        for i in range(len(spec.inputs)):
            assert all(s == k for s in out[f"n{i}"][0]["ins"]), "a same-step input of another step"
        for src, dst in spec.delayed:
            row = out[f"n{dst}"][0]
            read, low = row["read"], k - 1 - K
            if mode == "fixed":
                assert read == (low if low >= 0 else None)
            elif read is None:
                assert low < 0, f"step {k} read None although its window [{low}, {k - 1}] is full"
            else:
                assert low <= read <= k - 1, f"step {k} read version {read}, outside the bound"
                assert read >= last.get(dst, -1), "a newer version was followed by an older one"
                last[dst] = read
            if read is not None:
                producer = run.outputs[read][f"n{src}"][0]
                assert row["read_val"] == producer["val"], "the value read is not that step's"
            assert run.staleness[k][f"n{dst}.prev"] == (None if read is None else k - 1 - read)


def check_once(spec: Spec, run, start: int, stop: int) -> None:
    steps = list(range(start, stop))
    assert run.reported == [steps, steps], "a step reported twice, out of order, or not at all"
    for i in range(len(spec.inputs)):
        assert run.calls[f"n{i}"] == steps, f"node n{i} did not run each step exactly once"
    delayed_only = all("for its delayed edges: outside the steps being run" in d for d in run.drops)
    assert delayed_only, run.drops  # only values no reader's window reaches any more


RUNS = {
    "spec": specs(),
    "K": st.integers(0, 2),
    "mode": st.sampled_from(["fixed", "bound"]),
    "seed": st.integers(0, 2**32 - 1),
}
"""What every property draws: a graph, the staleness bound, the read mode, the timing seed."""


def reference(spec: Spec, K: int, steps: int) -> list[dict]:
    return [r.outputs for r in LocalExecutor(build(spec), max_staleness=K).run(steps)]


@PROPS
@given(**RUNS, extra_depth=st.integers(0, 2))
def test_random_timings_keep_the_bound_and_run_every_step_once(spec, K, mode, extra_depth, seed):
    depth = K + 1 + extra_depth  # the driver's pipeline_depth is at least K + 1
    steps = 8
    bound = len(spec.delayed) * (K + 1 + depth)
    run = simulate(spec, K, mode, depth, random.Random(seed), stop=steps, memory_bound=bound)
    check_once(spec, run, 0, steps)
    check_reads(spec, run, K, mode, 0, steps)
    if mode == "fixed" or K == 0:  # a read that does not depend on timing: as in-process
        want = reference(spec, K, steps)
        assert [run.outputs[k] for k in range(steps)] == want


@PROPS
@given(**RUNS, cut=st.integers(1, 7))
def test_state_and_restore_between_steps_at_random_timings(spec, K, mode, cut, seed):
    steps, depth, rng = 8, K + 2, random.Random(seed)
    first = simulate(spec, K, mode, depth, rng, stop=cut)
    window = {(src, port, k) for src, port, k, _ in first.state["delayed"]}
    keys = {(f"n{s}", "out") for s, _ in spec.delayed}
    assert window == {(*key, p) for key in keys for p in range(max(0, cut - 1 - K), cut)}
    rest = simulate(spec, K, mode, depth, rng, start=cut, stop=steps, state=first.state)
    check_once(spec, rest, cut, steps)
    joined = first
    joined.outputs.update(rest.outputs)
    joined.staleness.update(rest.staleness)
    check_reads(spec, joined, K, mode, 0, steps)
    if mode == "fixed" or K == 0:
        assert [joined.outputs[k] for k in range(steps)] == reference(spec, K, steps)


@pytest.mark.parametrize("mode", ["fixed", "bound"])
def test_memory_stays_flat_over_a_long_run(mode):
    """300 steps of a feedback edge across the engines and a forward one that may run ahead:
    the delayed values held never exceed the window, whatever the timing."""
    spec = Spec(((), (0,), (1,), (2,)), (False, True, False, False), (0, 1, 1, 0), ((3, 1), (0, 2)))
    K, depth = 2, 3
    run = simulate(
        spec, K, mode, depth, random.Random(7), stop=300, memory_bound=2 * (K + 1 + depth)
    )
    check_once(spec, run, 0, 300)
    check_reads(spec, run, K, mode, 0, 300)
    assert run.most_delayed >= K + 1  # the bound was approached, not vacuous
