import pytest
import torch
from sample_nodes import Source, Sum, scale

from yatt_graph import BatchPolicy, NodeInputError, NodeOutputError, Tensor
from yatt_graph.node import Built, Node


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


class _Counted(Node):
    """A node whose build() counts its calls and can be told to fail once."""

    inputs = {"x": Tensor("float32", "B")}
    outputs = {"y": Tensor("float32", "B")}
    table = Built("what build() makes")

    def __init__(self, fail_once: bool = False, name: str | None = None):
        super().__init__(name)
        self.builds, self.fail_once = 0, fail_once

    def build(self):
        self.builds += 1
        if self.fail_once:
            self.fail_once = False
            raise ValueError("node '_counted': the weights file is corrupt")
        self.table = {"factor": 2.0}

    def forward(self, x):
        return {"y": x * self.table["factor"]}


def test_setup_builds_once_and_run_sets_the_node_up():
    n = _Counted()
    assert n.builds == 0 and not n.is_set_up and "table" not in n.__dict__
    n.setup()
    n.setup()
    assert n.builds == 1 and n.is_set_up
    fresh = _Counted()
    assert torch.equal(fresh.run(x=torch.ones(2))["y"], torch.full((2,), 2.0))
    fresh.run(x=torch.ones(2))
    assert fresh.builds == 1


def test_reading_a_built_attribute_sets_the_node_up():
    n = _Counted()
    assert n.table == {"factor": 2.0} and n.builds == 1
    assert isinstance(_Counted.table, Built)  # the class attribute is the declaration


def test_a_failed_build_raises_and_the_next_setup_tries_again():
    n = _Counted(fail_once=True)
    with pytest.raises(ValueError, match="weights file is corrupt"):
        n.setup()
    assert not n.is_set_up and "_building" not in n.__dict__
    n.setup()
    assert n.is_set_up and n.builds == 2


def test_nodes_without_models_set_up_as_a_no_op():
    s = Sum()
    s.setup()
    assert s.is_set_up and set(vars(s)) >= {"name", "inputs", "outputs"}


def test_build_reading_an_attribute_it_has_not_set_is_named():
    class Broken(_Counted):
        def build(self):
            self.table = self.table  # reads before it sets

    with pytest.raises(AttributeError, match="build\\(\\) read 'table' before setting it"):
        Broken().setup()
