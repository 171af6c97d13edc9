"""Placement (runtime.sched.placement) and the device pool (runtime.sched.devices). ~1 s."""

import threading

import pytest
import torch

from bench.sim.placement import Placement, colocated, partial, place
from bench.sim.scheduler import Scheduler
from runtime.sched.devices import Slot, SlotPool, cpu_slot_count
from yatt_graph import BatchPolicy
from yatt_graph.refs import load_graph

TOY_KINDS = {
    "source": "data",
    "encoder": "encoder",
    "rollout": "rollout",
    "reward": "reward",
    "advantage": "function",
    "update": "update",
}


def test_colocated_puts_every_node_on_every_device():
    p = colocated(["rollout", "reward"], 4, switch_cost_s=0.5)
    assert p.devices_of("rollout") == p.devices_of("reward") == [0, 1, 2, 3]
    assert p.mode == "colocated" and p.switch_cost_s == 0.5 and p.barrier
    assert "all: devices [0, 1, 2, 3] <- reward, rollout" in p.to_text()


def test_partial_splits_rollout_side_from_train_side():
    p = partial(TOY_KINDS, 4)
    assert p.groups == {"rollout": [0, 1], "train": [2, 3]}
    assert {n for n, g in p.nodes.items() if g == "rollout"} == {"source", "encoder", "rollout"}
    assert p.devices_of("update") == [2, 3]
    q = partial(TOY_KINDS, 3, rollout_devices=1)
    assert q.devices_of("rollout") == [0] and q.devices_of("reward") == [1, 2]


def test_place_reads_node_kinds_from_a_graph():
    g = load_graph("graphs.toy")
    p = place(g, 2, "partial")
    assert p.group_of("rollout") == "rollout" and p.group_of("reward") == "train"
    assert set(p.nodes) == set(g.nodes)
    q = place(g, 2, "colocated", nodes=["rollout", "reward"], switch_cost_s=0.1)
    assert set(q.nodes) == {"rollout", "reward"} and q.switch_cost_s == 0.1


def test_placement_errors_say_what_to_do():
    with pytest.raises(ValueError, match="partial placement needs at least 2 devices"):
        partial(TOY_KINDS, 1)
    with pytest.raises(ValueError, match="rollout_devices must be between 1 and 1"):
        partial(TOY_KINDS, 2, rollout_devices=2)
    with pytest.raises(ValueError, match="puts every node in one group"):
        partial({"reward": "reward", "update": "update"}, 2)
    with pytest.raises(ValueError, match="mode must be 'colocated' or 'partial'"):
        place(TOY_KINDS, 2, "disaggregated")
    with pytest.raises(ValueError, match=r"group 'all' names devices \[0, 5\] but the pool has 2"):
        Placement("colocated", {"all": [0, 5]}, {"a": "all"}).verify(2)
    with pytest.raises(ValueError, match="not one of"):
        Placement("partial", {"g": [0]}, {"a": "h"}).verify()
    with pytest.raises(KeyError, match="no group for node 'critic'"):
        colocated(["rollout"], 2).devices_of("critic")
    with pytest.raises(ValueError, match=r"nodes \['nope'\] are not in the graph"):
        place(TOY_KINDS, 2, nodes=["nope"])


def test_pool_detects_cuda_or_cpu_slots(monkeypatch):
    pool = SlotPool.detect(cpu_slots=3, kind="cpu")
    assert [d.name for d in pool] == ["cpu:0", "cpu:1", "cpu:2"]
    assert pool[1].torch_device == "cpu"
    monkeypatch.setenv("YATT_CPU_SLOTS", "5")
    assert cpu_slot_count() == 5 and len(SlotPool.detect(kind="cpu")) == 5
    monkeypatch.setenv("YATT_CPU_SLOTS", "many")
    with pytest.raises(ValueError, match=r"\$YATT_CPU_SLOTS must be an integer"):
        cpu_slot_count()
    monkeypatch.delenv("YATT_CPU_SLOTS")
    auto = SlotPool.detect()
    if torch.cuda.is_available():
        assert [d.kind for d in auto] == ["cuda"] * torch.cuda.device_count()
        assert auto[0].torch_device == "cuda:0"
    else:
        assert all(d.kind == "cpu" for d in auto) and len(auto) >= 1
        with pytest.raises(RuntimeError, match="no CUDA device"):
            SlotPool.detect(kind="cuda")


def test_pool_refuses_two_calls_at_once_on_one_device():
    pool = SlotPool([Slot("cpu", 0)])
    with (
        pool.busy(pool[0], "a"),
        pytest.raises(RuntimeError, match="one worker per device"),
        pool.busy(pool[0], "b"),
    ):
        pass
    with pytest.raises(ValueError, match="duplicate devices"):
        SlotPool([Slot("cpu", 0), Slot("cpu", 0)])


@pytest.mark.timeout(60)
def test_scheduler_serves_each_node_only_on_its_placement_group():
    where, lock = {}, threading.Lock()
    pair = threading.Barrier(2, timeout=20)  # reward calls pass only two at a time

    def record(name):
        def fn(inputs, dev):
            with lock:
                where.setdefault(name, set()).add(dev.name)
            if name == "reward":
                pair.wait()
            return {"x": inputs["x"]}

        return fn

    pool = SlotPool.cpu(3)
    p = partial({"rollout": "rollout", "reward": "reward"}, 3, rollout_devices=1)
    sched = Scheduler(pool, placement=p)
    sched.add("rollout", record("rollout"), policy=BatchPolicy(max_batch_size=1))
    sched.add("reward", record("reward"), policy=BatchPolicy(max_batch_size=1))
    sched.connect("rollout", "reward")
    with sched:
        out = sched.submit("rollout", {"x": torch.arange(8)}).result(timeout=30)
    assert out["x"].tolist() == list(range(8))
    assert where["rollout"] == {"cpu:0"}
    assert where["reward"] == {"cpu:1", "cpu:2"}


def test_partial_controller_assignment_separates_the_rollout_side():
    from runtime.sched.placement import controller_assignment
    from yatt_graph.refs import load_graph

    graph = load_graph("graphs.mm_ppo", batch_size=2)
    hints = controller_assignment(graph, 3, "partial")
    rollout_side = {
        n for n, node in graph.nodes.items() if node.kind in ("data", "encoder", "rollout")
    }
    assert {hints[n] for n in rollout_side} <= {0, 1}
    assert {hints[n] for n in set(graph.nodes) - rollout_side} == {2}
    plan = graph.plan(3, placement=hints)
    assert all(plan.assignment[n] == hints[n] for n in graph.nodes)


def test_partial_placement_on_one_controller_is_refused(capsys):
    from runtime.cli import main

    assert main(["run", "graphs.toy", "--placement", "partial"]) == 2
    assert "needs --controllers 2 or more" in capsys.readouterr().err


def test_colocated_controllers_split_only_what_runs_ahead_of_the_weights():
    """On-policy, every node after the rollout waits for the new weights: a cut there only
    adds transfers. The data and the vision encoder read no weights, so the next step's run
    on controller 0 while controller 1 trains."""
    from runtime.sched.placement import controller_assignment, runs_ahead
    from yatt_graph.refs import load_graph

    graph = load_graph("graphs.mm_ppo", batch_size=2)
    assert runs_ahead(graph) == ["data", "vision"]
    hints = controller_assignment(graph, 2, "colocated")
    assert {n for n, c in hints.items() if c == 0} == {"data", "vision"}
    assert set(controller_assignment(graph, 3, "colocated").values()) == {0, 1, 2}
    assert controller_assignment(graph, 1, "colocated") is None
    toy = load_graph("graphs.toy")
    assert runs_ahead(toy) == ["source", "encoder"]


def test_partial_sides_balance_measured_time_and_keep_pins():
    from runtime.sched.placement import balance_sides, controller_assignment, partial_sides
    from yatt_graph.refs import load_graph

    graph = load_graph("graphs.mm_grpo", batch_size=2)
    sides = partial_sides(graph)
    assert sides["reference"] == "train" and sides["rollout"] == "rollout"
    # the training side is the busier: the reference (an inference node) moves over
    busy = {"data": 0.01, "vision": 0.02, "rollout": 0.06, "reward": 0.01, "reference": 0.05,
            "group_advantage": 0.001, "grpo": 0.12}  # fmt: skip
    moved = balance_sides(graph, sides, busy)
    assert moved["reference"] == "rollout" and moved["reward"] == "train"
    assert moved["grpo"] == "train"  # an update never moves
    assert balance_sides(graph, sides, busy, pins={"reference"})["reference"] == "train"
    # balanced already: nothing moves
    assert balance_sides(graph, sides, {**busy, "grpo": 0.03}) == sides
    pinned = partial_sides(graph, {"reference": "rollout"})
    assert pinned["reference"] == "rollout"
    hints = controller_assignment(graph, 2, "partial", sides=pinned)
    assert hints["reference"] == hints["rollout"] == 0 and hints["grpo"] == 1
    with pytest.raises(ValueError, match="not in the graph"):
        partial_sides(graph, {"nope": "train"})
    with pytest.raises(ValueError, match="the sides are rollout and train"):
        partial_sides(graph, {"reference": "left"})
    everything = dict.fromkeys(graph.nodes, "train")
    with pytest.raises(ValueError, match="every node on one side"):
        controller_assignment(graph, 2, "partial", sides=everything)
