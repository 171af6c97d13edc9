"""A ``--placement partial`` run moves inference nodes to the less busy side once its first
steps are measured (runtime/sched/placement.py ``PartialCut``): the run goes on from its
state on the new cut, exactly as it would have on the old one (runtime/train/loop.py
``train_with_restarts``)."""

from __future__ import annotations

import json

import pytest

from runtime.sched.placement import PartialCut, controller_assignment, partial_sides
from runtime.train.loop import REPLAN_AFTER, train_with_restarts
from runtime.zmq.driver import ZmqExecutor
from yatt_graph.refs import load_graph


def _factory(graph, sides):
    def make():
        hints = controller_assignment(graph, 2, "partial", sides=sides[0])
        return ZmqExecutor(graph.plan(2, placement=hints), placement="partial", adaptive=False)

    return make


@pytest.mark.timeout(180)
def test_a_run_moved_to_a_new_cut_goes_on_exactly(tmp_path):
    graph = load_graph("graphs.toy", seed=0)
    before = partial_sides(graph)
    assert before["reward"] == "train"
    plain, _ = train_with_restarts(
        _factory(graph, [before]), 10, tmp_path / "plain", progress=False
    )

    sides = [before]
    moved = _factory(graph, sides)

    def replan(rows):
        assert len(rows) == REPLAN_AFTER  # the measured steps
        sides[0] = {**before, "reward": "rollout"}
        return "moved reward to the rollout side"

    rows, restarts = train_with_restarts(
        moved, 10, tmp_path / "moved", progress=False, replan=replan
    )
    assert restarts == 0 and [r["step"] for r in rows] == list(range(10))
    assert [r["scores/mean"] for r in rows] == [r["scores/mean"] for r in plain]
    assert [r["loss"] for r in rows] == [r["loss"] for r in plain]
    events = [json.loads(line) for line in (tmp_path / "moved" / "events.jsonl").open()]
    assert [(e["event"], e["step"]) for e in events] == [("replan", REPLAN_AFTER)]


def test_the_cut_moves_what_balances_the_measured_time_and_keeps_pins():
    graph = load_graph("graphs.mm_grpo", batch_size=2)
    cut = PartialCut(graph, {"reference": "train"})
    step = {"time/rollout": 0.05, "time/vision": 0.01, "time/data": 0.001}
    step |= {"time/grpo": 0.06, "time/reference": 0.04, "time/reward": 0.03}
    why = cut.replan([step] * 6)
    # the reference is pinned to the training side; the reward moves
    assert cut.sides["reward"] == "rollout" and cut.sides["reference"] == "train"
    assert why.startswith("partial placement: moved reward to the rollout side")
    assert "train side 130 -> 100 ms" in why
    assert cut.replan([step] * 6) is None  # balanced now: nothing moves again
