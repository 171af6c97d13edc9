"""Each controller owns devices: its Resources (runtime.sched.devices), applied in its process
(runtime.sched.affinity), reported back and changed between steps (runtime.zmq).

The pure parts (who gets which cores and GPUs, the environment a controller starts with) run
with made-up core and GPU counts. The process tests read each controller's affinity and
environment from ``/proc`` (what the kernel says, not what the controller says); they start
controllers (a few seconds each), so each has a timeout. ~30 s in all.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from zmq_graphs import assert_gone, in_process_run

from runtime.sched import affinity
from runtime.sched.affinity import DRIVER_CUDA_ENV, child_env, set_process_affinity
from runtime.sched.devices import (
    Resources,
    assign_resources,
    cuda_visible_devices,
    split_evenly,
    usable_core_ids,
)
from runtime.sched.placement import controller_assignment
from runtime.zmq import options
from runtime.zmq.driver import ZmqExecutor
from yatt_graph.refs import load_graph

CORES = usable_core_ids()


# --- who gets what (pure) -----------------------------------------------------------------
def test_colocated_on_policy_controllers_share_every_core():
    got = assign_resources(2, cores=range(8), placement="colocated", max_staleness=0)
    assert got == [Resources(tuple(range(8)), 8)] * 2


@pytest.mark.parametrize(("placement", "staleness"), [("partial", 0), ("colocated", 1)])
def test_sides_that_run_at_once_get_disjoint_even_shares(placement, staleness):
    got = assign_resources(3, cores=range(8), placement=placement, max_staleness=staleness)
    assert [r.cores for r in got] == [(0, 1), (2, 3, 4), (5, 6, 7)]
    assert [r.threads for r in got] == [2, 3, 3]
    one_each = assign_resources(
        3, cores=(4, 9), placement="partial"
    )  # fewer cores than controllers
    assert [r.cores for r in one_each] == [(4,), (9,), (4,)]


def test_gpus_are_split_evenly_or_round_robin():
    def gpus(controllers, n, device="cuda"):
        got = assign_resources(controllers, cores=(0, 1), device=device, gpus=n)
        return [r.cuda for r in got]

    assert gpus(2, 8) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert gpus(3, 4) == [(0,), (1,), (2, 3)]
    assert gpus(3, 2) == [(0,), (1,), (0,)]  # colocated controllers share a GPU
    assert gpus(2, 2, "auto") == [(0,), (1,)]
    assert gpus(2, 2, "cpu") == [(), ()]
    assert gpus(2, 0, "auto") == [(), ()]
    with pytest.raises(RuntimeError, match="device=cuda, but no CUDA device is visible"):
        gpus(2, 0)


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match="placement must be 'colocated' or 'partial'"):
        assign_resources(2, cores=(0,), placement="spread")
    with pytest.raises(ValueError, match="controllers must be >= 1"):
        assign_resources(0, cores=(0,))
    with pytest.raises(ValueError, match="no CPU cores"):
        assign_resources(1, cores=())
    assert split_evenly((1, 2, 3, 4, 5), 2) == [(1, 2), (3, 4, 5)]


def test_a_controller_sees_only_its_gpus_from_the_start():
    env = {"PATH": "/bin"}
    assert child_env(env, Resources((0,), 1)) is env  # no GPUs: the environment as it is
    got = child_env(env, Resources((0,), 1, (1, 3)))
    assert got["CUDA_VISIBLE_DEVICES"] == "1,3" and got[DRIVER_CUDA_ENV] == ""
    # The ordinals index the driver's own visible GPUs.
    mine = child_env({"CUDA_VISIBLE_DEVICES": "4,5,GPU-ab"}, Resources((), 0, (2,)))
    assert mine["CUDA_VISIBLE_DEVICES"] == "GPU-ab" and mine[DRIVER_CUDA_ENV] == "4,5,GPU-ab"
    assert cuda_visible_devices((0, 1), None) == "0,1"
    with pytest.raises(ValueError, match=r"GPU ordinals \[3\] are not among the 2"):
        cuda_visible_devices((3,), "0,1")


def test_cuda_without_a_gpu_is_refused_before_any_process_starts(monkeypatch):
    monkeypatch.setattr(options, "visible_gpus", lambda: 0)
    with pytest.raises(
        RuntimeError, match="no CUDA device is visible to the driver; use --device cpu"
    ):
        ZmqExecutor(load_graph("graphs.toy").plan(2), device="cuda")
    with pytest.raises(ValueError, match="resources must be 2 Resources"):
        ZmqExecutor(load_graph("graphs.toy").plan(2), resources=[Resources()])
    with pytest.raises(ValueError, match=r"resources\[0\] .* names cores outside"):
        ZmqExecutor(load_graph("graphs.toy").plan(2), resources=[Resources((999,)), Resources()])


# --- in this process ----------------------------------------------------------------------
@pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores to see a narrower mask")
def test_affinity_reaches_every_thread_of_the_process():
    started, stop = threading.Event(), threading.Event()
    tid = []

    def other():
        tid.append(threading.get_native_id())
        started.set()
        stop.wait(30)

    t = threading.Thread(target=other, daemon=True)
    t.start()
    started.wait(30)
    try:
        assert set_process_affinity(CORES[:1]) == CORES[:1]
        assert os.sched_getaffinity(tid[0]) == {CORES[0]}  # not only the calling thread
        assert set_process_affinity(CORES) == CORES  # and widened again
        assert os.sched_getaffinity(tid[0]) == set(CORES)
    finally:
        set_process_affinity(CORES)
        stop.set()
        t.join(30)


def test_apply_resources_sets_threads_and_refuses_foreign_cores():
    threads = torch.get_num_threads()
    try:
        got = affinity.apply_resources(Resources(CORES, 1))
        assert got == Resources(CORES, 1) and torch.get_num_threads() == 1
        assert affinity.apply_resources(Resources(), pinned_threads=0).threads == 1  # left as is
        with pytest.raises(ValueError, match=r"cores \[999\], which this process may not use"):
            affinity.apply_resources(Resources((999,), 1))
    finally:
        set_process_affinity(CORES)
        torch.set_num_threads(threads)


# --- controllers --------------------------------------------------------------------------
def _masks(pid: int) -> set[str]:
    """The CPU list of every thread of process ``pid``, as the kernel has it."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            out |= {ln.split()[-1] for ln in f if ln.startswith("Cpus_allowed_list")}
    return out


def _env(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
    return {k.decode(): v.decode() for k, v in items}


def _cpu_list(cores) -> str:
    return Resources(tuple(cores)).describe().split(",")[0].removeprefix("cores ")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("placement", ["colocated", "partial"])
def test_controllers_run_on_their_cores_and_say_so(placement):
    graph = load_graph("graphs.toy")
    plan = graph.plan(2, placement=controller_assignment(graph, 2, placement))
    want = assign_resources(2, cores=CORES, placement=placement)
    ex = ZmqExecutor(plan, placement=placement)
    try:
        assert ex.resources == want  # what READY reported
        for pid, r in zip(ex.pids, want, strict=True):
            assert _masks(pid) == {_cpu_list(r.cores)}, pid
            assert _env(pid)["OMP_NUM_THREADS"] == str(r.threads)
            if "OMP_WAIT_POLICY" not in os.environ:  # started outside the CLI: threads sleep
                assert _env(pid)["OMP_WAIT_POLICY"] == "PASSIVE"
        result = ex.step()
        for c, r in enumerate(want):
            assert result.sched[f"sched/threads/c{c}"] == r.threads
            assert result.sched[f"sched/cores/c{c}"] == len(r.cores)
        assert "sched/rebalances" in result.sched  # adaptive by default
        assert result.sched["sched/ipc_bytes"] == 0.0  # the controllers said: nothing on a GPU
    finally:
        ex.close()
    assert_gone(ex.pids, ex.run_dir)


@pytest.mark.timeout(90)
@pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores to move one between controllers")
def test_new_resources_apply_between_steps_to_every_thread():
    ex = ZmqExecutor(load_graph("graphs.toy").plan(2), adaptive=False)
    try:
        before = ex.step()
        assert "sched/rebalances" not in before.sched  # adaptive=False: static
        first, rest = CORES[:1], CORES[1:]
        ex.set_resources([Resources(first, 1), Resources(rest, len(rest))])
        after = ex.step()
        assert ex.resources == [Resources(first, 1), Resources(rest, len(rest))]
        assert after.sched["sched/threads/c0"] == 1.0
        assert _masks(ex.pids[0]) == {_cpu_list(first)}
        assert _masks(ex.pids[1]) == {_cpu_list(rest)}
        ex.set_resources([Resources(CORES, len(CORES))] * 2)  # widened again
        ex.step()
        assert all(_masks(pid) == {_cpu_list(CORES)} for pid in ex.pids)
    finally:
        ex.close()


@pytest.mark.timeout(90)
def test_pinned_threads_stay_and_turn_adaptive_off():
    ex = ZmqExecutor(load_graph("graphs.toy").plan(2), num_threads=1)
    try:
        result = ex.step()
        assert [r.threads for r in ex.resources] == [1, 1]
        assert "sched/rebalances" not in result.sched
    finally:
        ex.close()


@pytest.mark.timeout(90)
def test_each_controller_starts_with_its_gpus_in_its_environment(monkeypatch):
    # No GPU here: the driver is told it sees two. The controllers' CUDA never starts (the toy
    # graph runs on the CPU); what is checked is the environment each one was started with.
    monkeypatch.setattr(options, "visible_gpus", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ex = ZmqExecutor(load_graph("graphs.toy").plan(2), device="cuda")
    try:
        assert [r.cuda for r in ex.resources] == [(0,), (1,)]
        assert [_env(pid)["CUDA_VISIBLE_DEVICES"] for pid in ex.pids] == ["0", "1"]
        ex.step()
    finally:
        ex.close()


@pytest.mark.timeout(300)
def test_the_default_two_controller_run_equals_in_process_at_the_same_thread_count():
    # Colocated and on-policy, each controller computes on every core with one thread per
    # core, as an in-process run does with torch's threads set to the core count, so float
    # reductions split alike and the metrics agree bitwise. (Thread counts change the last
    # bits: 1 vs 2 threads differ in the losses. So adaptive is off here: a re-balance would
    # change a controller's threads part-way.)
    expected = in_process_run("graphs.mm_ppo", 6, len(CORES), batch_size=8)
    with ZmqExecutor(load_graph("graphs.mm_ppo", batch_size=8).plan(2), adaptive=False) as ex:
        got = ex.run(6)
        assert [r.threads for r in ex.resources] == [len(CORES)] * 2
    for want, have in zip(expected, got, strict=True):
        assert want.outputs.keys() == have.outputs.keys()
        assert torch.equal(want.outputs["scores"], have.outputs["scores"])
        assert want.outputs["metrics"] == have.outputs["metrics"], want.step
        assert want.outputs["metrics"]["loss"] == have.outputs["metrics"]["loss"]
