import msgspec
import pytest
from sample_nodes import Source, scaled_loop

from yatt_graph import Graph, Node, Plan
from yatt_graph.serialize import GraphSpec


def build() -> Graph:
    return scaled_loop(
        "round_trip", {"half": 0.5}, source={"rows": 3, "cols": 4}, placement="reward"
    )


def test_graph_json_round_trip_is_equal():
    g = build()
    data = g.to_json()
    back = Graph.from_json(data)
    assert back == g
    assert back.to_json() == data
    assert back.nodes["half"].params == {"factor": 0.5}
    assert back.nodes["src"].rows == 3 and back.nodes["sum"].placement == "reward"
    assert [e.delay for e in back.edges if e.dst_port == "back"] == [1]
    decoded = msgspec.json.decode(data, type=GraphSpec)
    assert [n.ref for n in decoded.nodes][:2] == ["sample_nodes:Source", "sample_nodes:Sum"]


def test_plan_json_round_trip_is_equal():
    plan = build().plan(2)
    back = Plan.from_json(plan.to_json())
    assert back == plan
    assert back.assignment == plan.assignment and back.channels == plan.channels


def test_a_graph_file_with_the_removed_node_field_still_loads():
    """Files written when nodes carried ``resources`` (nothing read it) load, ignoring it."""
    g = build()
    tree = msgspec.json.decode(g.to_json())
    for n in tree["nodes"]:
        n["resources"] = {"device": "any", "memory_gb": 2.0}
    back = Graph.from_json(msgspec.json.encode(tree))
    assert back == g
    assert "resources" not in back.to_json().decode()


def test_a_queue_delay_round_trips():
    """``BatchPolicy.max_queue_delay_s`` is read by the streamed consumers, so a graph file keeps it."""
    g = build()
    tree = msgspec.json.decode(g.to_json())
    for n in tree["nodes"]:
        n["batch_policy"] = {**n.get("batch_policy", {}), "max_queue_delay_s": 0.5}
    back = Graph.from_json(msgspec.json.encode(tree))
    assert all(n.batch_policy.max_queue_delay_s == 0.5 for n in back.nodes.values())
    assert Graph.from_json(back.to_json()) == back


def test_graph_differs_when_a_config_differs():
    a, b = build(), build()
    b.nodes["src"] = Source(rows=9, cols=4, name="src")
    assert a != b


def test_unwritable_config_is_refused_with_the_node_named():
    class Holder(Node):
        outputs = {"x": Source.outputs["x"]}

        def __init__(self, model, name=None):
            super().__init__(name=name)

    with Graph("g") as g:
        g.output("x", Holder(object(), name="holder")())
    with pytest.raises(
        TypeError, match=r"node 'holder' config\['model'\]: a object cannot be written"
    ):
        g.to_json()


def test_a_file_loads_under_the_name_that_leads_back_to_it(tmp_path, monkeypatch):
    from yatt_graph.refs import load_module

    # tmp/pkg_like/mod.py with tmp on sys.path but no package: "pkg_like.mod" is a
    # namespace import that works; a sibling sys.path root that is not its parent must not win.
    (tmp_path / "pkg_like").mkdir()
    (tmp_path / "pkg_like" / "mod.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = load_module(str(tmp_path / "pkg_like" / "mod.py"))
    assert module.VALUE == 7 and module.__name__ == "pkg_like.mod"
    shadow = tmp_path / "runtime"  # same name as the project's package: never used for the file
    shadow.mkdir()
    (shadow / "fake_graph.py").write_text("VALUE = 9\n")
    assert load_module(str(shadow / "fake_graph.py")).VALUE == 9
