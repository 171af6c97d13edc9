"""Moving cores between controllers part-way through a run changes float rounding only.

Adaptive partitioning (runtime/sched/adaptive.py) moves cores and threads between steps at
times that depend on measured step times, so a test cannot wait for it; it forces the same
move here with ``ZmqExecutor.set_resources``, the call the partitioner makes.
"""

from __future__ import annotations

import pytest
import torch
from zmq_graphs import in_process_run

from runtime.sched.devices import Resources, usable_core_ids
from runtime.zmq.driver import ZmqExecutor
from yatt_graph.refs import load_graph

CORES = usable_core_ids()


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores to move one between controllers")
def test_a_run_whose_cores_move_between_steps_equals_the_plain_run_up_to_rounding():
    # Exact: the sampled tokens and so the rewards (the rollout's draws are seeded per step and
    # a logit's last bit does not move a sample on this graph). Up to rounding: the losses and
    # statistics, whose reductions split by the thread count (a clip fraction within a sample
    # or two).
    want = in_process_run("graphs.mm_ppo", 6, len(CORES), batch_size=8)
    with ZmqExecutor(load_graph("graphs.mm_ppo", batch_size=8).plan(2), adaptive=False) as ex:
        got = ex.run(3)
        ex.set_resources([Resources(CORES[:1], 1), Resources(CORES[1:], len(CORES) - 1)])
        got += ex.run(3)
        assert ex.resources[0].threads == 1
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a.outputs["scores"], b.outputs["scores"]), a.step
        for key, value in a.outputs["metrics"].items():
            # a clip fraction counts samples past a threshold: rounding may move one of 32
            tol = {"abs": 1 / 16} if "fraction" in key else {"rel": 1e-3, "abs": 1e-5}
            assert b.outputs["metrics"][key] == pytest.approx(value, **tol), key
    first = [r.outputs["metrics"] for r in got[:3]]
    assert first == [r.outputs["metrics"] for r in want[:3]]  # before the move: bitwise
