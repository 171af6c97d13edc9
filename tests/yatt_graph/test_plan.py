import pytest
from sample_nodes import scaled_loop

from yatt_graph import Graph


def chain() -> Graph:
    return scaled_loop("chain", {"a": 2.0, "b": 2.0})


def test_default_plan_cuts_the_topological_order_into_runs():
    plan = chain().plan(2)
    assert plan.assignment == {"src": 0, "sum": 0, "a": 0, "b": 1, "loop": 1}
    assert [s.nodes for s in plan.subgraphs] == [["src", "sum", "a"], ["b", "loop"]]
    assert [
        (c.edge.src, c.edge.dst, c.src_controller, c.dst_controller) for c in plan.channels
    ] == [("a", "b", 0, 1)]


def test_hints_place_nodes_and_neighbours_follow_their_producers():
    g = chain()
    plan = g.plan(3, placement={"sum": 2, "b": "tail"})
    assert plan.assignment["sum"] == 2 and plan.assignment["a"] == 2  # a follows its producer
    assert plan.assignment["src"] == 2  # a source joins its consumer
    assert plan.assignment["b"] == 0 and plan.groups == {0: "tail"}
    assert plan.assignment["loop"] == 0
    assert {(c.src_controller, c.dst_controller) for c in plan.channels} == {(2, 0)}


def test_node_attribute_hints_are_used():
    g = chain()
    g.nodes["loop"].placement = 1
    assert g.plan(2).assignment["loop"] == 1


def test_bad_plans_are_refused_clearly():
    g = chain()
    with pytest.raises(ValueError, match="controllers must be an int >= 1"):
        g.plan(0)
    with pytest.raises(ValueError, match="6 controllers for 5 nodes"):
        g.plan(6)
    with pytest.raises(ValueError, match=r"node 'sum' is placed on controller 4.*controllers 0..1"):
        g.plan(2, placement={"sum": 4})
    with pytest.raises(ValueError, match=r"unknown node\(s\) \['nope'\]"):
        g.plan(2, placement={"nope": 0})
    with pytest.raises(ValueError, match="group 'y'.*needs a controller of its own"):
        g.plan(1, placement={"sum": "x", "a": "y"})
