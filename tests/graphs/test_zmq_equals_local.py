"""The ready multimodal graphs on 2 controllers give the in-process run's metrics, step by step.

Bitwise: each node runs the same code on the same inputs in both runtimes (the step engine
decides the order, values cross controllers through a lossless codec, RNG states are per node
call), and each process computes with one torch thread, so float reductions happen in the
same order. 20 steps of each graph, with the plan's default cut ("colocated") and with the
rollout side and the training side on separate controllers ("partial").
"""

from __future__ import annotations

import pytest
import torch

from runtime.engine.engine import LocalExecutor
from runtime.sched.placement import controller_assignment
from runtime.zmq.driver import ZmqExecutor
from yatt_graph.refs import load_graph

STEPS = 20
OPTIONS = {"batch_size": 8}


def _metrics(results):
    """Each step's graph outputs, flat: scores and lengths (tensors), and every metric (the
    update's loss, KL, entropy, ...; the advantage node's figures) as ``output/name``, less
    the wall times (the rollout's weight loads: ``weight_sync/seconds``, ...)."""
    rows = []
    for r in results:
        row = {}
        for key, value in r.outputs.items():
            if isinstance(value, dict):
                row.update({f"{key}/{k}": v for k, v in value.items() if "seconds" not in k})
            else:
                row[key] = value
        rows.append(row)
    return rows


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return type(a) is type(b) and a == b


@pytest.fixture(scope="module", params=["graphs.mm_ppo", "graphs.mm_grpo"])
def reference(request):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in each controller
    try:
        graph = load_graph(request.param, **OPTIONS)
        return request.param, _metrics(LocalExecutor(graph).run(STEPS))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("placement", ["colocated", "partial"])
def test_two_controllers_give_the_in_process_metrics_bitwise(reference, placement):
    name, expected = reference
    graph = load_graph(name, **OPTIONS)
    plan = graph.plan(2, placement=controller_assignment(graph, 2, placement))
    assert set(plan.assignment.values()) == {0, 1}  # both controllers hold nodes
    with ZmqExecutor(plan, num_threads=1) as ex:
        got = _metrics(ex.run(STEPS))
    assert len(got) == len(expected) == STEPS
    assert {"scores", "metrics/loss", "metrics/approx_kl"} <= expected[0].keys()
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert want.keys() == have.keys(), step
        for key in want:
            assert _same(want[key], have[key]), f"{name} {placement}: {key} at step {step}"
