"""The ZeroMQ executor against the in-process one: same results, errors named, deaths noticed.

Every test starts controller processes (about 2-3 s each on 2 cores, mostly importing
torch), so each has a hard timeout and closes its executor in ``finally``. ~60 s in all.
"""

from __future__ import annotations

import glob
import os
import time

import msgspec
import pytest
import torch
import zmq
import zmq_graphs
from zmq_graphs import assert_gone, assert_same

from runtime.engine.engine import LocalExecutor
from runtime.zmq import messages as m
from runtime.zmq.driver import ControllerError, HandshakeError, ZmqExecutor
from yatt_graph import NodeExecutionError
from yatt_graph.refs import load_graph

STEPS = 4


@pytest.fixture(scope="module")
def toy_reference():
    return LocalExecutor(load_graph("graphs.toy").plan(1)).run(STEPS)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("controllers", "spin_s"),
    [(1, 0.001), (2, 0.001), (3, 0.001), (1, 0.0)],
    ids=["1", "2", "3", "1-no-spin"],
)
def test_toy_graph_equals_in_process_bitwise(controllers, spin_s, toy_reference):
    plan = load_graph("graphs.toy").plan(controllers)
    ex = ZmqExecutor(plan, spin_s=spin_s)
    try:
        assert len(ex.pids) == controllers
        results = ex.run(STEPS - 1) + [ex.step()]  # pipelined run, then a single step
    finally:
        ex.close()
    assert_gone(ex.pids, ex.run_dir)
    for ref, got in zip(toy_reference, results, strict=True):
        assert got.step == ref.step
        assert list(got.outputs) == list(ref.outputs) == ["scores", "metrics"]
        assert torch.equal(got.outputs["scores"], ref.outputs["scores"])
        assert got.outputs["metrics"] == ref.outputs["metrics"]
        assert list(got.node_seconds) == list(ref.node_seconds)
        assert all(s >= 0 for s in got.node_seconds.values())
        assert list(got.node_start) == list(ref.node_start)
        assert got.node_controller == plan.assignment


@pytest.mark.timeout(60)
def test_run_pipelines_steps_across_controllers():
    # The sink's 1 s call leaves step k+1's source a wide margin to start inside it; how much
    # faster the run is than a serial one is a speed figure, for bench/, not asserted here.
    graph = zmq_graphs.build_graph("slow", sleep_s=0.1, sink_sleep_s=1.0)
    with ZmqExecutor(graph.plan(2), pipeline_depth=2) as ex:
        results = ex.run(3)
    for prev, cur in zip(results, results[1:]):
        sink_end = prev.node_start["double"] + prev.node_seconds["double"]
        assert cur.node_start["source"] < sink_end, "step k+1's source should overlap step k's sink"


@pytest.mark.timeout(60)
def test_every_value_type_crosses_controllers_and_big_tensors_use_shared_memory():
    graph = zmq_graphs.build_graph("rich")
    reference = LocalExecutor(zmq_graphs.build_graph("rich").plan(2)).run(2)
    ex = ZmqExecutor(graph.plan(2))
    try:
        results = ex.run(2)
        segments = glob.glob(f"/dev/shm/{os.path.basename(ex.run_dir)}-c0-*")
    finally:
        ex.close()
    assert_gone(ex.pids, ex.run_dir)
    assert len(segments) >= 1, "the 2.4 MB tensor should have gone through shared memory"
    for ref, got in zip(reference, results):
        assert_same(ref.outputs, got.outputs, "outputs")


@pytest.mark.timeout(60)
def test_frames_only_when_shared_memory_is_off():
    graph = zmq_graphs.build_graph("rich", big=300_000)
    reference = LocalExecutor(zmq_graphs.build_graph("rich", big=300_000).plan(2)).run(1)
    with ZmqExecutor(graph.plan(2), shm_threshold=0) as ex:
        got = ex.run(1)
        assert not glob.glob(f"/dev/shm/{os.path.basename(ex.run_dir)}-*")
    assert_same(reference[0].outputs, got[0].outputs, "outputs")


@pytest.mark.timeout(60)
def test_delayed_edge_between_controllers_and_max_staleness():
    reference = LocalExecutor(zmq_graphs.build_graph("feedback").plan(2)).run(5)
    xs = [
        r.outputs["y"]
        for r in LocalExecutor(zmq_graphs.build_graph("boom", fail_at=-1).plan(2)).run(5)
    ]
    with ZmqExecutor(zmq_graphs.build_graph("feedback").plan(2)) as ex:
        on_policy = ex.run(5)
    with ZmqExecutor(zmq_graphs.build_graph("feedback").plan(2), max_staleness=1) as ex:
        assert ex.pipeline_depth == 2
        stale = ex.run(5)
    for ref, got in zip(reference, on_policy):
        assert torch.equal(ref.outputs["total"], got.outputs["total"])
    # Lag 2: step k sees the total of step k-2, so even and odd steps accumulate apart.
    x = [v / 2 for v in xs]  # the boom graph doubles the same source
    expected = [x[0], x[1], x[0] + x[2], x[1] + x[3], x[0] + x[2] + x[4]]
    for k, got in enumerate(stale):
        torch.testing.assert_close(got.outputs["total"], expected[k], rtol=0, atol=1e-6)


@pytest.mark.timeout(60)
def test_graph_ref_rebuild_when_the_plan_does_not_serialize():
    graph = zmq_graphs.build_graph("tensor_arg", factor=3.0)
    with pytest.raises(TypeError, match="graph_ref"):
        ZmqExecutor(graph.plan(2))
    reference = LocalExecutor(zmq_graphs.build_graph("tensor_arg", factor=3.0).plan(2)).run(2)
    options = {"kind": "tensor_arg", "factor": 3.0}
    with ZmqExecutor(graph.plan(2), graph_ref="zmq_graphs", graph_options=options) as ex:
        results = ex.run(2)
    for ref, got in zip(reference, results):
        assert torch.equal(ref.outputs["y"], got.outputs["y"])
    with pytest.raises(ControllerError, match="wired differently"):
        other = {"kind": "boom"}
        ZmqExecutor(
            graph.plan(2), graph_ref="zmq_graphs", graph_options=other, startup_timeout_s=30
        )


@pytest.mark.timeout(60)
def test_node_error_arrives_with_node_step_controller_and_remote_traceback():
    ex = ZmqExecutor(zmq_graphs.build_graph("boom", fail_at=2).plan(2))
    pids, run_dir = ex.pids, ex.run_dir
    try:
        with pytest.raises(NodeExecutionError) as info:
            ex.run(5)
        err = info.value
        assert err.node == "boom"
        assert err.context["step"] == 2 and err.context["controller"] == 1
        assert "boom at step 2" in str(err) and "on controller 1" in str(err)
        assert "zmq_graphs.py" in err.remote_traceback and "ValueError" in err.remote_traceback
        assert ex.next_step == 2  # steps 0 and 1 completed
        with pytest.raises(RuntimeError, match="closed"):
            ex.step()
    finally:
        ex.close()
    assert_gone(pids, run_dir)


@pytest.mark.timeout(60)
def test_unsendable_value_names_node_and_port():
    with ZmqExecutor(zmq_graphs.build_graph("unsendable").plan(2)) as ex:
        with pytest.raises(NodeExecutionError) as info:
            ex.step()
        assert info.value.node == "set_source"
        assert "node 'set_source' output 'tags'" in str(info.value)
        assert "['bad'][1]" in str(info.value) and "set" in str(info.value)
    assert_gone(ex.pids, ex.run_dir)


@pytest.mark.timeout(60)
def test_node_that_cannot_be_built_fails_start_up_clearly():
    graph = zmq_graphs.build_graph("bad_init", home_pid=os.getpid())
    with pytest.raises(NodeExecutionError) as info:
        ZmqExecutor(graph.plan(2))
    assert info.value.node == "bad_init"
    assert "could not be built on controller 1" in str(info.value)
    assert "pretend" in str(info.value)
    assert not zmq_graphs.controller_processes()


@pytest.mark.timeout(60)
def test_dead_controller_is_named_with_its_nodes():
    with ZmqExecutor(zmq_graphs.build_graph("boom", fail_at=1, mode="exit").plan(2)) as ex:
        t0 = time.monotonic()
        with pytest.raises(ControllerError) as info:
            ex.run(3)
        assert time.monotonic() - t0 < 30  # named, not hung (start-up included, on any load)
        assert info.value.controller == 1 and info.value.nodes == ["boom"]
        assert "exited with code 7" in str(info.value) and "['boom']" in str(info.value)
    assert_gone(ex.pids, ex.run_dir)


@pytest.mark.timeout(60)
def test_hung_controller_is_caught_by_heartbeat():
    graph = zmq_graphs.build_graph("boom", fail_at=1, mode="stop")  # SIGSTOP: alive but silent
    ex = ZmqExecutor(
        graph.plan(2), heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0, shutdown_grace_s=0.5
    )
    try:
        t0 = time.monotonic()
        with pytest.raises(ControllerError) as info:
            ex.run(3)
        assert time.monotonic() - t0 > 1.5  # not before heartbeat_timeout_s could pass
        assert info.value.controller == 1 and info.value.nodes == ["boom"]
        assert "has sent nothing for" in str(info.value)
    finally:
        ex.close()
    assert_gone(ex.pids, ex.run_dir)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("version", [999, 2])
def test_protocol_mismatch_is_refused_clearly(tmp_path, version):
    address = f"ipc://{tmp_path}/driver"
    ctx = zmq.Context()
    fake = ctx.socket(zmq.DEALER)
    fake.setsockopt(zmq.LINGER, 0)
    fake.connect(address)
    if version == 2:  # protocol 2 sent the kind byte and the header as two frames
        header = msgspec.msgpack.encode([2, 0, os.getpid(), "elsewhere", "ipc://nowhere"])
        fake.send_multipart([m.Kind.HELLO.frame, header])
    else:
        fake.send_multipart(m.encode_header(m.Hello(version, 0, os.getpid(), "elsewhere", "x")))
    try:
        with pytest.raises(
            HandshakeError, match=f"protocol {version}, the driver speaks {m.PROTOCOL_VERSION}"
        ):
            ZmqExecutor(
                load_graph("graphs.toy").plan(1), spawn=False, address=address, startup_timeout_s=10
            )
        assert fake.poll(2000)
        reply = fake.recv_multipart()
        if version == 2:  # answered in the form that peer reads: kind, header
            assert reply[0] == m.Kind.REFUSED.frame and len(reply) == 2
            reply = [reply[0] + reply[1]]
        assert m.decode_header(reply[0])[0] is m.Kind.REFUSED
    finally:
        ctx.destroy(linger=0)


def test_bad_arguments_fail_before_any_process_starts():
    plan = load_graph("graphs.toy").plan(2)
    with pytest.raises(ValueError, match="allow_tcp"):
        ZmqExecutor(plan, address="tcp://127.0.0.1:5999")
    with pytest.raises(ValueError, match="2 controllers"):
        ZmqExecutor(plan, controllers=3)
    with pytest.raises(ValueError, match="needs the address"):
        ZmqExecutor(plan, spawn=False)
    for bad in (-0.001, 2.0, float("nan"), "fast", True):
        with pytest.raises(ValueError, match="spin_s must be between 0 and 1 second"):
            ZmqExecutor(plan, spin_s=bad)


@pytest.mark.timeout(60)
def test_a_value_the_data_plane_cannot_carry_names_the_node_output_and_controller():
    from sample_nodes import count, make_set

    from yatt_graph import Graph

    with Graph("sets") as g:
        g.output("n", count(make_set()))
    plan = g.plan(2, placement={"make_set": 0, "count": 1})
    with ZmqExecutor(plan) as ex, pytest.raises(NodeExecutionError) as info:
        ex.step()
    text = str(info.value)
    assert "node 'make_set' output 'v' (to controller [1])" in text and "set" in text, text
    assert info.value.node == "make_set"


@pytest.mark.timeout(120)
def test_the_driver_builds_no_model_the_controllers_build_their_own():
    graph = load_graph("graphs.mm_ppo", batch_size=4)
    with ZmqExecutor(graph.plan(2)) as ex:
        ex.run(1)
    assert not any(node.is_set_up for node in graph.nodes.values())


@pytest.mark.timeout(120)
def test_controllers_started_before_the_graph_is_built_run_it():
    # What `yatt-graph run --controllers 2` does: start the controllers first (they import
    # torch and, from --preload, the graph's module while the driver builds the graph).
    from runtime.zmq.controllers import Controllers

    def group(count):
        return Controllers(
            count, address=None, keys=None, keys_dir=None, spawn=True,
            controller_output="capture", num_threads=1, max_message_bytes=0,
            heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0, startup_timeout_s=60.0,
            shutdown_grace_s=5.0, preload=("graphs/toy.py", "no_such_module_here"),
        )  # fmt: skip

    plan = load_graph("graphs.toy").plan(2)
    reference = LocalExecutor(load_graph("graphs.toy").plan(2)).run(3)
    with ZmqExecutor(plan, group=group(2)) as ex:
        results = ex.run(3)
    assert_same([r.outputs for r in reference], [r.outputs for r in results])
    three = group(3)
    with pytest.raises(ValueError, match="a group of 3 controllers cannot run a plan for 2"):
        ZmqExecutor(plan, group=three)
    assert_gone([p.pid for p in three.res.procs], three.run_dir)
