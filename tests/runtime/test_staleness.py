"""``max_staleness`` as a bound (``staleness="bound"``) or a fixed lag (``"fixed"``): the read
rule, what each step reports, checkpoints and exact resume, and the ZeroMQ runtime.

The random-timing property tests are in test_staleness_props.py.
"""

from __future__ import annotations

import pytest
import torch
import zmq_graphs
from metrics_helpers import learning_values
from sample_nodes import loop_graph

from runtime import LocalExecutor
from runtime.engine.engine import DelayedValues, StepEngine
from runtime.train.loop import train
from runtime.train.metrics import read_metrics
from yatt_graph import Graph
from yatt_graph.refs import load_graph


def test_the_read_rule_of_each_mode():
    fixed, bound = DelayedValues(2, "fixed"), DelayedValues(2, "bound")
    for store in (fixed, bound):
        assert store.pick("u", "w", 0) == (True, None)  # nothing produced: None at once
    bound.put("u", "w", 0, "v0")
    fixed.put("u", "w", 0, "v0")
    assert bound.pick("u", "w", 1) == (True, 0)  # the newest there is, not None
    assert fixed.pick("u", "w", 1) == (True, None)  # exactly step 1-1-2 < 0: None
    assert fixed.pick("u", "w", 3) == (True, 0)
    assert bound.pick("u", "w", 4) == (False, None)  # window [1, 3] empty: wait
    bound.put("u", "w", 5, "v5")  # from the future of step 4: not read
    assert bound.pick("u", "w", 4) == (False, None)
    bound.put("u", "w", 2, "v2")
    assert bound.pick("u", "w", 4) == (True, 2)
    assert fixed.pick("u", "w", 4) == (False, 1)  # waits for exactly step 1
    bound.prune("u", "w", 2)
    assert not bound.has("u", "w", 0) and bound.count() == 2
    assert list(bound.window(4)) == [1, 2, 3] and list(bound.window(1)) == [0]


def test_a_bad_mode_is_one_clear_line():
    with pytest.raises(ValueError, match=r"LocalExecutor: staleness must be 'fixed' .* got 'lag'"):
        LocalExecutor(load_graph("graphs.toy"), max_staleness=1, staleness="lag")


def test_in_process_the_bound_reads_the_previous_step_and_reports_it():
    on_policy = LocalExecutor(loop_graph()).run(4)
    bound = LocalExecutor(loop_graph(), max_staleness=2, staleness="bound").run(4)
    fixed = LocalExecutor(loop_graph(), max_staleness=2).run(4)
    outs = [[r.outputs["out"].tolist() for r in rs] for rs in (on_policy, bound, fixed)]
    assert outs[0] == outs[1] == [[3.0] * 2, [6.0] * 2, [9.0] * 2, [12.0] * 2]
    assert outs[2] == [[3.0] * 2, [3.0] * 2, [3.0] * 2, [6.0] * 2]  # step 3 reads step 0
    assert [r.staleness for r in on_policy] == [{"loop.back": a} for a in (None, 0, 0, 0)]
    assert [r.staleness for r in bound] == [{"loop.back": a} for a in (None, 0, 0, 0)]
    assert [r.staleness for r in fixed] == [{"loop.back": a} for a in (None, None, None, 2)]


def _consumer_engine(K: int) -> tuple[StepEngine, Graph]:
    """Controller 1 of the feedback graph (acc), its inputs delivered by hand."""
    graph = zmq_graphs.build_graph("feedback")
    plan = graph.plan(2)
    engine = StepEngine(
        {"acc": graph.nodes["acc"]},
        graph.edges,
        graph.graph_outputs,
        graph.topological_order(),
        plan.assignment,
        here=1,
        max_staleness=K,
        staleness="bound",
        window=3,
    )
    return engine, graph


def test_a_reader_waits_only_for_a_value_within_the_bound_and_never_reads_ahead():
    engine, _ = _consumer_engine(K=1)
    engine.allow(5)

    def version(p: int) -> dict:
        return {"total": torch.full((4,), float(p + 1) * 10)}

    def run_step(k: int) -> tuple[float, dict]:
        engine.deliver(k, "source", "x", torch.zeros(4))
        assert engine.run_one()
        (result,) = engine.finished()
        assert result.step == k
        return float(result.outputs["total"][0]), result.staleness

    assert run_step(0) == (0.0, {"acc.prev": None})
    assert run_step(1) == (0.0, {"acc.prev": None})  # window [-1, 0]: nothing yet, no wait
    assert engine.deliver(0, "mirror", "out", version(0)) == []
    assert run_step(2) == (10.0, {"acc.prev": 1})  # window [0, 1]: step 0's value
    engine.deliver(3, "source", "x", torch.zeros(4))
    assert not engine.run_one()  # window [1, 2] is empty: step 0's value is too old
    engine.deliver(2, "mirror", "out", version(2))  # step 1's is late
    assert engine.run_one()
    (result,) = engine.finished()
    assert float(result.outputs["total"][0]) == 30.0 and result.staleness == {"acc.prev": 0}
    late = engine.deliver(1, "mirror", "out", version(1))
    assert late == ["data mirror.out of step 1 for its delayed edges: outside the steps being run"]
    engine.deliver(4, "mirror", "out", version(4))  # arrives before step 4 runs: the future
    assert run_step(4) == (30.0, {"acc.prev": 1})  # step 2's, not step 4's
    assert engine.delayed.count() == 1  # step 4's: step 5 reads from [3, 4], step 2's went


def test_state_waits_for_a_delayed_value_on_its_way():
    engine, _ = _consumer_engine(K=1)
    engine.allow(2)
    for k in range(2):
        engine.deliver(k, "source", "x", torch.zeros(4))
        assert engine.run_one()
    assert [r.step for r in engine.finished()] == [0, 1]
    engine.deliver(1, "mirror", "out", {"total": torch.ones(4)})
    assert engine.state(2) is None  # step 0's value, in the next steps' window, has not come
    engine.deliver(0, "mirror", "out", {"total": torch.zeros(4)})
    state = engine.state(2)
    assert [(s, p, k) for s, p, k, _ in state["delayed"]] == [
        ("mirror", "out", 0),
        ("mirror", "out", 1),
    ]


@pytest.mark.parametrize("mode", ["fixed", "bound"])
def test_a_resumed_async_run_ends_with_the_same_metrics(tmp_path, mode):
    def executor() -> LocalExecutor:
        return LocalExecutor(load_graph("graphs.toy", seed=3), max_staleness=1, staleness=mode)

    whole = train(executor(), 10, tmp_path / "whole", progress=False)
    part = tmp_path / "part"
    train(executor(), 5, part, checkpoint_every=5, progress=False)
    resumed = train(executor(), 10, part, checkpoint_every=5, resume=part, progress=False)
    assert [r["step"] for r in resumed] == [5, 6, 7, 8, 9]
    assert _learning(read_metrics(part)) == _learning(whole)
    on_policy = train(LocalExecutor(load_graph("graphs.toy", seed=3)), 10, None, progress=False)
    # In one process the bound reads the step before (on-policy); the fixed lag does not.
    assert (_learning(whole) == _learning(on_policy)) == (mode == "bound")


@pytest.mark.timeout(120)
def test_zmq_bound_reads_within_the_bound_and_reports_it():
    from runtime.zmq.driver import ZmqExecutor

    K, steps = 1, 8
    xs = [torch.randn(4, generator=zmq_graphs._gen(k)) for k in range(steps)]  # TinySource's x
    with ZmqExecutor(zmq_graphs.build_graph("feedback").plan(2), max_staleness=K, staleness="bound") as ex:  # fmt: skip
        results = ex.run(5)
        state = ex.state_dict()
        results += ex.run(steps - 5)
    assert state["executor"]["staleness"] == "bound"
    assert [(s, p, k) for s, p, k, _ in state["delayed"]] == [
        ("mirror", "out", 3),
        ("mirror", "out", 4),
    ]
    totals = [r.outputs["total"] for r in results]
    for k, r in enumerate(results):
        age = r.staleness["acc.prev"]
        assert age is None or 0 <= age <= K, f"step {k} read a value {age} versions old"
        assert age is not None or k - 1 - K < 0, f"step {k} read None with a full window"
        base = torch.zeros(4) if age is None else totals[k - 1 - age]
        torch.testing.assert_close(totals[k], base + xs[k], rtol=0, atol=1e-6)
    local = LocalExecutor(zmq_graphs.build_graph("feedback").plan(2), max_staleness=K, staleness="bound")  # fmt: skip
    local.load_state_dict(state)
    previous = totals[4]
    for k, r in enumerate(local.run(steps - 5), start=5):  # in process: always the step before
        assert r.staleness == {"acc.prev": 0}
        torch.testing.assert_close(r.outputs["total"], previous + xs[k], rtol=0, atol=1e-6)
        previous = r.outputs["total"]


@pytest.mark.timeout(300)
def test_fixed_staleness_with_fixed_threads_reruns_bitwise_on_controllers(tmp_path, capsys):
    """Partial placement, one step of staleness: the reads are fixed, and with adaptive
    partitioning off so are torch's thread counts, so a rerun is the same run to the bit,
    whatever the timing. With it on, the run says what a bitwise rerun needs."""
    from runtime.cli import main
    from runtime.train.metrics import read_metrics

    flags = ["run", "graphs.mm_grpo", "--controllers", "2", "--placement", "partial",
             "--max-staleness", "1", "--staleness", "fixed", "--steps", "6",
             "--set", "batch_size=8", "--quiet"]  # fmt: skip
    learned = []
    for i in range(2):
        assert main([*flags, "--no-adaptive", "--out", str(tmp_path / f"run{i}")]) == 0
        rows = read_metrics(tmp_path / f"run{i}")
        learned.append([learning_values(r) for r in rows])
    assert "bitwise only with fixed thread counts" not in capsys.readouterr().err
    assert learned[0] == learned[1]
    assert main([*flags, "--steps", "1", "--out", str(tmp_path / "adaptive")]) == 0
    assert "bitwise only with fixed thread counts (--no-adaptive" in capsys.readouterr().err


def _learning(rows: list[dict]) -> list[dict]:
    return [learning_values(r) for r in rows]
