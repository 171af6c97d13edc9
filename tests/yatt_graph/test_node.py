import pytest
import torch
from sample_nodes import Source, Sum, scale

from yatt_graph import BatchPolicy, NodeInputError, NodeOutputError, Tensor
from yatt_graph.node import Node


def test_class_node_runs_alone_with_no_graph():
    out = Sum().run({"x": torch.tensor([[1.0, 2.0], [3.0, 4.0]])})
    assert torch.equal(out["total"], torch.tensor([3.0, 7.0]))


def test_function_node_runs_alone_and_params_apply():
    assert torch.equal(scale.run(x=torch.tensor([1.0, 2.0]))["y"], torch.tensor([2.0, 4.0]))
    tripled = scale.with_params(factor=3.0)
    assert torch.equal(tripled.run(x=torch.tensor([1.0]))["y"], torch.tensor([3.0]))
    assert scale.params == {}  # the original is unchanged


def test_run_checks_inputs_and_names_the_node_and_port():
    with pytest.raises(NodeInputError, match="node 'sum': required input 'x'"):
        Sum().run({})
    with pytest.raises(NodeInputError, match="node 'sum': unknown input"):
        Sum().run({"x": torch.ones(1, 1), "y": 1})
    with pytest.raises(NodeInputError, match="input 'x': expected dtype float32, got int64"):
        Sum().run({"x": torch.ones(2, 2, dtype=torch.int64)})
    with pytest.raises(NodeInputError, match="input 'x': expected 2 dims"):
        Sum().run({"x": torch.ones(2)})


def test_symbolic_dims_must_agree_across_ports_of_one_call():
    from sample_nodes import add

    with pytest.raises(NodeInputError, match="input 'b': dimension B=3 disagrees with B=2"):
        add.run(a=torch.ones(2), b=torch.ones(3))


def test_forward_returning_wrong_keys_is_an_output_error():
    class Bad(Node):
        inputs = {"x": Tensor("float32", "B")}
        outputs = {"y": Tensor("float32", "B"), "z": Tensor("float32", "B")}

        def forward(self, x):
            return {"y": x}

    with pytest.raises(NodeOutputError, match=r"node 'bad'.*missing \['z'\]"):
        Bad().run(x=torch.ones(1))


def test_config_records_constructor_arguments():
    src = Source(5, cols=7, name="src")
    assert src.config() == {"rows": 5, "cols": 7, "name": "src"}


def test_policies_verify():
    with pytest.raises(ValueError, match="max_batch_size must be >= 0"):
        BatchPolicy(max_batch_size=-1).verify()
    with pytest.raises(ValueError, match="timeout_s must be >= 0"):
        Sum(batch_policy=BatchPolicy(timeout_s=-1.0))
    n = Sum(batch_policy=BatchPolicy(max_batch_size=8))
    assert n.batch_policy.max_batch_size == 8


def test_calling_a_node_outside_a_graph_says_what_to_do():
    with pytest.raises(RuntimeError, match=r"outside a graph.*node.run"):
        Sum()(None)


def test_default_names_are_snake_case_and_errors_inside_forward_name_the_node():
    class GAEThing(Node):
        inputs = {"x": Tensor("float32", "B")}
        outputs = {"y": Tensor("float32", "B")}

        def forward(self, x):
            raise ValueError("helper: x is bad at sample 0")

    assert GAEThing().name == "gae_thing" and Sum().name == "sum"
    with pytest.raises(ValueError, match=r"^node 'gae_thing': helper: x is bad at sample 0$"):
        GAEThing().run(x=torch.ones(1))
