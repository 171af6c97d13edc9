import warnings

import pytest
from sample_nodes import Five, Fixed, Loop, Source, Sum, TakesPrompt, add, as_int, scale

from yatt_graph import (
    CycleError,
    DuplicateNodeError,
    Graph,
    GraphLookupError,
    GraphValidationError,
    Handle,
    MissingInputError,
    PortTypeError,
    ShapeError,
    Tensor,
    UnusedOutputWarning,
    node,
)


def build_ok() -> Graph:
    with Graph("ok") as g:
        src = Source(name="src")()
        total = Sum(name="sum")(src.x)
        g.output("total", total)
        g.output("prompt", src.prompt)
    return g


def test_declaring_inside_a_context_returns_typed_handles():
    g = build_ok()
    assert list(g.nodes) == ["src", "sum"]
    assert g.graph_outputs["total"] == Handle("sum", "total", Tensor("float32", "B"))
    assert [(e.src, e.src_port, e.dst, e.dst_port) for e in g.edges] == [("src", "x", "sum", "x")]
    assert g.topological_order() == ["src", "sum"]


def only_problem(err: pytest.ExceptionInfo[GraphValidationError], kind: type) -> Exception:
    """The one error a GraphValidationError holds, checked to be of ``kind``."""
    assert len(err.value.problems) == 1, err.value.errors
    (problem,) = err.value.problems
    assert isinstance(problem, kind), problem
    return problem


def test_type_mismatch_names_both_nodes_ports_types_and_the_fix():
    with pytest.raises(GraphValidationError) as err, Graph("bad"):
        total = Sum(name="sum")(Source(name="src")().x)
        as_int(total)
    msg = str(only_problem(err, PortTypeError))
    assert msg.startswith("sum.total (float32[B]) -> as_int.x (int64[B]): dtype mismatch")
    assert "dtype float32 is not int64" in msg and "Fix:" in msg
    assert str(err.value) == f"graph 'bad' has 1 error:\n  1. {msg}"


def test_every_error_of_a_graph_is_reported_at_once():
    with pytest.raises(GraphValidationError) as err, Graph("three") as g:
        src = Source(name="src")()
        as_int(Sum(name="sum")(src.x))  # a dtype mismatch
        add(a=Sum(name="sum2")(src.x))  # add.b is required and fed by nothing
        first, second = Loop(name="first"), Loop(name="second")
        g.connect(second(first(Sum(name="sum3")(src.x))), first, "back")  # a cycle, no delay
        g.output("p", src.prompt)
    assert isinstance(err.value, ValueError)
    kinds = [type(p) for p in err.value.problems]
    assert kinds == [PortTypeError, CycleError, MissingInputError]
    mismatch, cycle, missing = err.value.errors
    assert mismatch.startswith("sum.total (float32[B]) -> as_int.x (int64[B]): dtype mismatch")
    assert cycle.startswith("first.b -> second.a, second.b -> first.back: cycle without a delay")
    assert "delay=1" in cycle
    assert missing.startswith("? -> add.b: missing required input")
    assert "e.g. add(b=sum.total)" in missing  # the fix names an output that fits
    text = str(err.value)
    assert text.startswith("graph 'three' has 3 errors:\n")
    for i, line in enumerate((mismatch, cycle, missing), 1):
        assert f"\n  {i}. {line}" in text
    # the refused edge is not in the graph, and does not also count as a missing input
    assert "as_int" not in {e.dst for e in g.edges}
    assert not any("as_int.x: missing" in e for e in err.value.errors)


def test_an_unknown_port_is_reported_with_the_others():
    with pytest.raises(GraphValidationError) as err, Graph("ports") as g:
        src = Source(name="src")()
        g.output("t", Sum(name="sum")(y=src.x))  # Sum has x, not y
        g.output("p", src.prompt)
    lookup, missing = err.value.problems
    assert isinstance(lookup, GraphLookupError) and isinstance(missing, MissingInputError)
    assert str(lookup).startswith("src.x -> sum.y: unknown port: node 'sum' has no input 'y'")
    assert "its inputs are ['x']" in str(lookup)
    assert str(missing).startswith("? -> sum.x: missing required input")


def test_struct_mismatch_is_refused_and_subclass_is_accepted():
    with Graph("structs") as g:
        src = Source(name="src")()
        g.output("n", TakesPrompt(name="takes")(src.prompt))  # ImagePrompt -> Prompt: fine
        g.output("x", src.x)
    assert "takes" in g.nodes

    @node(outputs={"p": Tensor("float32", "B")})
    def wants_tensor(p: Tensor("float32", "B")):
        return {"p": p}

    with (
        pytest.raises(
            GraphValidationError,
            match=r"src.prompt \(ImagePrompt\).*type mismatch: a struct port cannot feed a tensor",
        ) as err,
        Graph("g"),
    ):
        wants_tensor(Source(name="src")().prompt)
    only_problem(err, PortTypeError)


def test_cycle_is_printed_with_the_fix():
    g2 = Graph("cyc2")
    with pytest.raises(GraphValidationError) as err, g2:
        src = Source(name="src")()
        first = Loop(name="first")
        second = Loop(name="second")
        s = Sum(name="sum")(src.x)
        h1 = first(s)
        h2 = second(h1)
        g2.connect(h2, first, "back")
    cycle = only_problem(err, CycleError)
    assert cycle.cycle == ["first", "second", "first"]
    assert "first -> second -> first" in str(cycle) and "delay=1" in str(cycle)


def test_delayed_edge_breaks_the_cycle_and_needs_an_optional_input():
    with Graph("ok") as g:
        s = Sum(name="sum")(Source(name="src")().x)
        first = Loop(name="first")
        h1 = first(s)
        g.connect(h1, first, "back", delay=1)
        g.output("b", h1)
    assert g.topological_order() == ["src", "sum", "first"]
    message = r"delayed edge b.y -> b.b: the input is empty at step 0.*optional"
    with pytest.raises(GraphValidationError, match=message) as err, Graph("bad") as g:
        a = Sum(name="sum")(Source(name="src")().x)
        b = add.renamed("b")
        y = b(a=a)
        g.connect(y, b, "b", delay=1)
    only_problem(err, MissingInputError)


def test_unconnected_required_input_is_named():
    with (
        pytest.raises(
            GraphValidationError,
            match=r"node 'sum': required input 'x' \(float32\[B,T\]\) is not connected",
        ) as err,
        Graph("g"),
    ):
        Sum(name="sum")()
    only_problem(err, MissingInputError)


def test_duplicate_node_name_is_refused_with_a_fix():
    with (
        pytest.raises(
            DuplicateNodeError, match=r"'sum'.*same name as another node.*renamed\('sum_2'\)"
        ),
        Graph("g"),
    ):
        src = Source(name="src")()
        Sum(name="sum")(src.x)
        Sum(name="sum")(src.x)
    with pytest.raises(DuplicateNodeError, match="already in graph"), Graph("g"):
        src = Source(name="src")()
        s = Sum(name="sum")
        s(src.x)
        s(src.x)


def test_using_a_function_node_twice_needs_a_name():
    with Graph("g") as g:
        total = Sum(name="sum")(Source(name="src")().x)
        a = scale(total)
        b = scale(a, name="scale_again", factor=3.0)
        g.output("b", b)
    assert g.nodes["scale_again"].params == {"factor": 3.0}
    assert g.nodes["scale"].params == {}


def test_unused_output_is_a_warning_naming_the_port():
    with (
        pytest.warns(
            UnusedOutputWarning, match=r"output src.prompt \(ImagePrompt\) is consumed by nothing"
        ),
        Graph("g") as g,
    ):
        g.output("t", Sum(name="sum")(Source(name="src")().x))


def test_discarded_outputs_do_not_warn_and_survive_json():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedOutputWarning)
        with Graph("quiet") as g:
            src = Source(name="src")()
            g.output("t", Sum(name="sum")(src.x))
            g.discard(src.prompt)
    assert Graph.from_json(g.to_json()).discarded == [src.prompt]


def test_symbolic_dims_unify_across_the_graph():
    with Graph("fine") as g:  # Fixed wants 4 rows, Sum's B is free: B binds to 4
        src = Source(name="src")()
        g.output("t", Sum(name="sum")(Fixed(name="f")(src.x)))
        g.output("p", src.prompt)
    with pytest.raises(GraphValidationError) as err, Graph("conflict") as g:
        src = Source(name="src")()
        g.output("p", src.prompt)
        g.output("a", Fixed(name="four")(src.x))
        g.output("b", Five(name="five")(src.x))
    msg = str(only_problem(err, ShapeError))
    assert msg.startswith("src.x -> five.x: shape mismatch: dimension B of node 'src' is 5 here")
    assert "but 4 at src.x -> four.x" in msg


def test_lookup_errors_name_what_is_missing():
    g = build_ok()
    with pytest.raises(GraphLookupError, match="node 'nope' is not in graph 'ok'"):
        g.connect(Handle("nope", "x", Tensor("float32", "B")), "sum", "x")
    with pytest.raises(GraphLookupError, match="node 'sum' has no input 'y'"):
        g.connect(Handle("src", "x", Tensor("float32", "B", "T")), "sum", "y")
    with pytest.raises(PortTypeError, match="already fed by src.x"):
        g.connect(Handle("src", "x", Tensor("float32", "B", "T")), "sum", "x")
