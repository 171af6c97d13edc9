import pytest
import torch

from runtime import LocalExecutor
from yatt_graph import Graph, NodeExecutionError
from yatt_graph.refs import load_graph


def test_runs_in_topological_order_and_carries_delayed_edges():
    from sample_nodes import loop_graph

    results = LocalExecutor(loop_graph()).run(3)
    # step 0: 3 ; step 1: 3 + 3 ; step 2: 3 + 6
    assert [r.outputs["out"].tolist() for r in results] == [[3.0, 3.0], [6.0, 6.0], [9.0, 9.0]]
    assert [r.step for r in results] == [0, 1, 2]
    assert set(results[0].node_seconds) == {"src", "sum", "loop"}


def test_node_failure_names_node_step_inputs_and_keeps_the_traceback():
    from sample_nodes import Source, Sum, boom

    with Graph("fails") as g:
        total = Sum(name="sum")(Source(rows=2, cols=3, name="src")().x)
        g.output("y", boom(total))
    with pytest.raises(NodeExecutionError) as err:
        LocalExecutor(g).step()
    msg = str(err.value)
    assert "node 'boom' (FunctionNode) failed at step 0 on controller 0" in msg
    assert "RuntimeError: exploded on purpose" in msg
    assert "inputs: x=float32[2]" in msg
    assert "sample_nodes.py" in err.value.remote_traceback and err.value.node == "boom"


def test_plan_with_several_controllers_gives_the_same_results_in_process():
    one = LocalExecutor(load_graph("graphs.toy")).run(4)
    three = LocalExecutor(load_graph("graphs.toy").plan(3)).run(4)
    for a, b in zip(one, three):
        assert torch.equal(a.outputs["scores"], b.outputs["scores"])
        assert a.outputs["metrics"] == b.outputs["metrics"]
