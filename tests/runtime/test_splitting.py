"""Executors cut splittable nodes' calls across CPU slots (runtime/sched/fanout.py)."""

from __future__ import annotations

import pytest
import torch
from sample_nodes import Rows, RowWork, row_sum

from runtime.engine.engine import LocalExecutor
from runtime.sched.batching import cut_pieces
from runtime.sched.fanout import shared_ports, slot_pool
from runtime.zmq.driver import ZmqExecutor
from yatt_graph import BatchPolicy, Graph, Node, NodeExecutionError, Tensor


def rows_graph(n: int = 12, fail_at: float = 0.0) -> Graph:
    with Graph("rows") as g:
        x, mask = Rows(n, placement=0, name="rows")()
        out = RowWork(fail_at, placement=1, name="work")(x, mask)
        g.output("y", out["y"])
        g.output("n", out["n"])
        g.output("s", row_sum(out["y"]))
    return g


def test_a_splittable_node_is_cut_across_the_slots_and_put_back_in_order():
    with LocalExecutor(rows_graph(12).plan(2)) as whole:
        want = whole.run(3)
    with LocalExecutor(rows_graph(12).plan(2), slots=2) as split:
        got = split.run(3)
        assert split.fanouts.split_nodes == ["work"]  # the source and row_sum run whole
        work = split.graph.nodes["work"]
        # The cut is a pure function of the batch (12 rows of cost 1), the device count and the
        # budget (8 per call): at least one micro-batch per device, none above 8. Which worker
        # thread takes which micro-batch is up to the machine, so only the cut is asserted.
        parts = cut_pieces([1.0] * 12, workers=2, max_batch_size=8)
        assert len(parts) >= 2 and max(len(p) for p in parts) <= 8
        assert sorted(work.seen) == sorted([len(p) for p in parts] * 3)  # 3 steps
        summary = split.fanouts.summary()
        assert len(summary["nodes"]["work"]["workers"]) == 2  # both slots serve the node
        assert summary["nodes"]["work"]["pieces"] == 3 * len(parts)
    for a, b in zip(want, got, strict=True):
        assert torch.allclose(a.outputs["y"], b.outputs["y"], atol=1e-6)
        assert torch.equal(a.outputs["n"], b.outputs["n"])  # row order restored exactly
        assert torch.allclose(a.outputs["s"], b.outputs["s"], atol=1e-5)


@pytest.mark.timeout(120)
def test_zeromq_controllers_split_the_same_way_as_the_in_process_executor():
    with LocalExecutor(rows_graph(10).plan(2), slots=2) as local:
        want = local.run(3)
    with ZmqExecutor(rows_graph(10).plan(2), slots=2) as zmq_run:
        got = zmq_run.run(3)
    for a, b in zip(want, got, strict=True):
        for key in ("y", "n", "s"):
            assert torch.equal(a.outputs[key], b.outputs[key]), key


def test_a_failure_inside_a_split_call_names_the_node_and_step():
    with (
        LocalExecutor(rows_graph(12, fail_at=1.5).plan(2), slots=2) as ex,
        pytest.raises(NodeExecutionError, match="node 'work'.*failed at step 0.*a row above 1.5"),
    ):
        ex.step()


class PerPrompt(Node):
    """Per-response rows next to per-prompt rows (N divides B), like the reference's images."""

    inputs = {"x": Tensor("float32", "B", "W"), "prompt": Tensor("float32", "N", "W")}  # noqa: RUF012
    outputs = {"y": Tensor("float32", "B", "W")}  # noqa: RUF012
    batch_policy = BatchPolicy(max_batch_size=8)

    def forward(self, x, prompt):
        self.calls = getattr(self, "calls", 0) + 1
        return {"y": x + prompt.repeat_interleave(len(x) // len(prompt), 0)}  # (B, W)


def test_per_sample_values_of_different_lengths_run_whole():
    with Graph("per_prompt") as g:
        x, _ = Rows(4, name="rows")()
        prompts, _ = Rows(2, name="prompts")()
        g.output("y", PerPrompt(name="pp")(x, prompts))
    with LocalExecutor(g.plan(1), slots=2) as ex:
        assert ex.fanouts.split_nodes == ["pp"]
        y = ex.step().outputs["y"]
        assert ex.graph.nodes["pp"].calls == 1  # not cut: a part could lose its prompt's row
        assert y.shape == (4, 16)
    assert shared_ports(PerPrompt()) == frozenset()


def test_bad_device_requests_are_refused_with_the_fix():
    assert slot_pool(None) is None and slot_pool(0) is None
    assert len(slot_pool(3)) == 3
    with pytest.raises(ValueError, match="positive int"):
        slot_pool(-2)
    with pytest.raises(ValueError, match="slots must be"):
        ZmqExecutor(rows_graph().plan(2), slots="many")


def test_in_the_ppo_graph_only_the_per_sample_nodes_are_split():
    from yatt_graph.refs import load_graph

    with LocalExecutor(load_graph("graphs.mm_ppo", batch_size=4).plan(1), slots=2) as ex:
        assert ex.fanouts.split_nodes == ["critic", "reference", "reward", "vision"]
        # The rollout (one random stream per call), GAE (whitening) and the update are whole.
        for name in ("rollout", "gae", "ppo"):
            assert not ex.graph.nodes[name].batch_policy.splittable, name


@pytest.mark.timeout(120)
def test_a_hung_split_call_is_reported_with_the_device_workers_stacks():
    from runtime.zmq.driver import NodeTimeoutError

    with Graph("hung") as g:
        x, mask = Rows(12, name="rows")()
        policy = BatchPolicy(max_batch_size=8, timeout_s=1.0)
        out = RowWork(hang_s=30.0, batch_policy=policy, name="work")(x, mask)
        g.output("y", out["y"])
        g.discard(out["n"])
    with ZmqExecutor(g.plan(1), slots=2) as ex, pytest.raises(NodeTimeoutError) as info:
        ex.step()
    text = str(info.value)
    assert "node 'work'" in text and "--- worker cpu:" in text and "time.sleep" in text
