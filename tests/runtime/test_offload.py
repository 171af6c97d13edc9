"""Roles taking turns on a device: model state offloaded and reloaded, timed.

On a CPU nothing has to move; ``nodes.models.offload.ALWAYS_COPY`` makes the moves copy into
fresh CPU tensors, so the bookkeeping (what moves, back where, shared modules, optimizer
state) runs here. The CUDA case is the ``gpu`` test and bench/gpu_check.py's offload row.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

import nodes.models.offload as off
from runtime import LocalExecutor
from runtime.engine.switch import Switch, offloading, switch_metrics
from runtime.sched.devices import Resources
from yatt_graph import Graph, Node, Tensor


class Recorder(Node):
    """A model role that writes what the executor asks of it into a shared log."""

    kind = "rollout"
    inputs = {"x": Tensor("float32", "B")}
    outputs = {"y": Tensor("float32", "B")}

    def __init__(self, log: list | None = None, name: str | None = None):
        super().__init__(name=name)
        self.log = log if log is not None else []

    def forward(self, x):
        self.log.append(("call", self.name, self.step))
        return {"y": x + 1}

    def offload(self) -> int:
        self.log.append(("offload", self.name))
        return 8

    def reload(self) -> int:
        self.log.append(("reload", self.name))
        return 8


class Start(Node):
    kind = "data"
    outputs = {"x": Tensor("float32", "B")}

    def forward(self):
        return {"x": torch.zeros(2)}


def _two_roles(log: list) -> Graph:
    with Graph("roles") as g:
        a = Recorder(log, name="a")(Start(name="start")())
        g.output("y", Recorder(log, name="b")(a))
    return g


def test_roles_take_turns_in_process_only_when_asked():
    log: list = []
    ex = LocalExecutor(_two_roles(log), offload="on")
    assert log == [("reload", "a"), ("reload", "b")]  # moves nothing: each now holds its state
    log.clear()
    ex.run(2)
    assert log == [
        ("offload", "b"), ("call", "a", 0),  # built on the device: b leaves before a runs
        ("offload", "a"), ("reload", "b"), ("call", "b", 0),
        ("offload", "b"), ("reload", "a"), ("call", "a", 1),
        ("offload", "a"), ("reload", "b"), ("call", "b", 1),
    ]  # fmt: skip
    for mode in ("auto", "off"):
        log.clear()
        LocalExecutor(_two_roles(log), offload=mode).run(2)
        assert [e[0] for e in log] == ["call"] * 4


def test_a_controller_offloads_when_its_turn_ends_and_reloads_before_its_next_call():
    log: list = []
    ex = LocalExecutor(_two_roles(log))
    ex.engine.switch = Switch(ex.engine.nodes, "phase", here=3)  # a controller's switch
    log.clear()
    results = ex.run(2)
    # each node's state comes back just before its own call, not with its neighbours'
    assert log == [
        ("call", "a", 0), ("call", "b", 0), ("offload", "a"), ("offload", "b"),
        ("reload", "a"), ("call", "a", 1), ("reload", "b"), ("call", "b", 1),
        ("offload", "a"), ("offload", "b"),
    ]  # fmt: skip
    kinds = [[(w, moved, c) for w, _, _, moved, c in r.switches] for r in results]
    assert kinds == [
        [("offload", 16, 3)],
        [("reload", 8, 3), ("reload", 8, 3), ("offload", 16, 3)],
    ]


def test_a_controller_releases_the_device_before_its_outputs_leave():
    """A process sharing the GPU acts on the outputs (reloads, wakes vLLM): by then the
    sender's weights and optimizer state are off the device."""
    log: list = []

    class Outbox:
        def value(self, step, src, port, value, dests):
            log.append(("send", src, step))

    ex = LocalExecutor(_two_roles(log))
    ex.engine.switch = Switch(ex.engine.nodes, "phase", here=3)
    ex.engine.remote_out[("b", "y")] = [1]  # b's output goes to controller 1
    ex.engine.outbox = Outbox()
    log.clear()
    ex.run(1)
    assert log == [("call", "a", 0), ("call", "b", 0), ("offload", "a"), ("offload", "b"), ("send", "b", 0)]  # fmt: skip


def test_switch_metrics_and_spans_appear_per_step():
    log: list = []
    results = LocalExecutor(_two_roles(log), offload="on").run(2)
    sched = results[1].sched
    assert sched["sched/switches"] == 4.0
    assert sched["sched/offload_bytes"] == sched["sched/reload_bytes"] == 16.0
    total = sched["sched/offload_s"] + sched["sched/reload_s"]
    assert math.isclose(sched["sched/switch_s"], total) and sched["sched/switch_s"] >= 0
    assert sched["sched/switch_s/c0"] == sched["sched/switch_s"]
    metrics = switch_metrics([("offload", 0.0, 0.5, 10, 0), ("reload", 1.0, 0.25, 10, 1)], [0, 1])
    assert metrics["sched/switch_s/c0"] == 0.5 and metrics["sched/switch_s/c1"] == 0.25
    assert metrics["sched/switch_s"] == 0.75 and metrics["sched/switches"] == 2.0


def test_auto_offloads_exactly_the_controllers_that_share_a_gpu_under_colocated_placement():
    shared = [Resources(cuda=(0,)), Resources(cuda=(0,)), Resources(cuda=(1,))]
    kw = dict(placement="colocated", max_staleness=0, resources=shared)
    assert offloading("auto", **kw) == [0, 1]
    assert offloading("on", **kw) == [0, 1, 2] and offloading("off", **kw) == []
    assert offloading("auto", **{**kw, "placement": "partial"}) == []
    assert offloading("auto", **{**kw, "max_staleness": 1}) == []
    cpu = [Resources(cores=(0, 1)), Resources(cores=(0, 1))]  # cores are shared, no GPU
    assert offloading("auto", placement="colocated", max_staleness=0, resources=cpu) == []
    with pytest.raises(ValueError, match="offload must be 'auto'"):
        LocalExecutor(_two_roles([]), offload="sometimes")


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(6, 4)).square().sum().backward()
    opt.step()
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(6, 4)).square().sum().backward()
    opt.step()


def test_a_round_trip_keeps_parameters_buffers_and_optimizer_state_bit_identical():
    model, opt = _trained()
    twin_model, twin_opt = copy.deepcopy((model, opt))
    params = list(model.parameters())
    ptrs = [p.data_ptr() for p in params]
    moved, homes = off.move(model, "cpu", copy=True)
    moved_opt, opt_homes = off.move(opt, "cpu", copy=True)
    assert moved > 0 and moved_opt > 0  # weights + grads + running stats; exp_avg(_sq)
    assert [p.data_ptr() for p in model.parameters()] != ptrs  # it really moved
    assert off.move(model, homes=homes, copy=True)[0] == moved
    assert off.move(opt, homes=opt_homes, copy=True)[0] == moved_opt
    assert list(model.parameters()) == params  # the same Parameter objects: opt still holds them
    for (k, v), w in zip(model.state_dict().items(), twin_model.state_dict().values()):
        assert torch.equal(v, w), k
    for p, q in zip(params, twin_model.parameters()):
        for key, value in opt.state[p].items():
            assert torch.equal(value, twin_opt.state[q][key]), key
    _step(model, opt), _step(twin_model, twin_opt)  # and training goes on alike
    for v, w in zip(model.state_dict().values(), twin_model.state_dict().values()):
        assert torch.equal(v, w)


class Holder(off.Offload, Node):
    """A node holding a module (and maybe an optimizer), like a rollout or an update."""

    outputs = {"y": Tensor("float32", "B")}

    def __init__(self, module=None, opt=None, name: str | None = None):
        super().__init__(name=name)
        self.module, self.opt = module, opt

    def forward(self):
        return {"y": torch.zeros(1)}


def _within(t: torch.Tensor, flat: torch.Tensor) -> bool:
    start = flat.data_ptr()
    return start <= t.data_ptr() and t.data_ptr() + t.nbytes <= start + flat.nbytes


def test_each_part_waits_on_the_host_in_one_buffer_allocated_once(monkeypatch):
    monkeypatch.setattr(off, "ALWAYS_COPY", True)
    allocated = []
    real = off._allocate
    monkeypatch.setattr(off, "_allocate", lambda n, pin: allocated.append(n) or real(n, pin))
    model, opt = _trained()
    twin_model, twin_opt = copy.deepcopy((model, opt))
    node = Holder(model, opt, name="update")
    node.setup()
    node.reload()
    host_ptrs = None
    for _ in range(4):
        before = copy.deepcopy(model.state_dict())
        node.offload()
        module_buf, opt_buf = off._entries[model].host.flat, off._entries[opt].host.flat
        tensors = [*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers()]
        assert all(_within(t, module_buf) for t in tensors)
        adam = [v for state in opt.state.values() for k, v in state.items() if k != "step"]
        assert all(_within(v, opt_buf) for v in adam)
        ptrs = [t.data_ptr() for t in [*tensors, *adam]]
        assert host_ptrs in (None, ptrs)  # the same places, every time
        host_ptrs = ptrs
        node.reload()
        assert not any(_within(t, module_buf) for t in model.parameters())  # no alias back
        for (k, v), w in zip(model.state_dict().items(), before.values()):
            assert torch.equal(v, w), k  # bit for bit
        _step(model, opt), _step(twin_model, twin_opt)
    assert len(allocated) == 2  # one for the module, one for its optimizer's state
    for v, w in zip(model.state_dict().values(), twin_model.state_dict().values()):
        assert torch.equal(v, w)


def test_a_buffer_grows_once_when_gradients_and_adam_state_appear_after_its_first_offload(
    monkeypatch,
):
    monkeypatch.setattr(off, "ALWAYS_COPY", True)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    node = Holder(model, opt, name="update")
    node.setup()
    node.reload(), node.offload(), node.reload()  # no gradients nor Adam state yet
    assert off._entries[opt].host.allocations == 0 and off._entries[model].host.allocations == 1
    for _ in range(3):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        node.offload(), node.reload()
    assert off._entries[opt].host.allocations == 1
    assert off._entries[model].host.allocations == 2  # the weights alone, then with gradients


def test_a_rollout_lets_go_of_an_unversioned_payload_when_offloaded(monkeypatch):
    import gc
    import weakref

    from nodes.rollout import Rollout

    monkeypatch.setattr(off, "ALWAYS_COPY", True)
    node = Rollout(policy="tiny-qwen2", max_new_tokens=2)
    node.setup()
    payload = {k: v.clone() for k, v in node.policy.state_dict().items()}  # a user's state dict
    node.run(prompts=["ab"], weights=payload)
    alive = weakref.ref(next(iter(payload.values())))
    node.offload()
    del payload
    gc.collect()
    assert alive() is None, "the payload's tensors outlive the offload"


def test_a_module_two_nodes_share_leaves_with_the_last_and_comes_back_with_the_first(
    monkeypatch,
):
    monkeypatch.setattr(off, "ALWAYS_COPY", True)
    model, opt = _trained()
    rollout, update = Holder(model, name="rollout"), Holder(model, opt, name="update")
    rollout.setup(), update.setup()
    assert rollout.reload() == update.reload() == 0  # as the executor does: both hold it now
    size = sum(p.numel() * 4 for p in model.parameters())
    assert rollout.offload() == 0  # the update still holds the policy: nothing moves
    assert rollout.offload() == 0  # idempotent
    assert update.offload() > size  # the policy (with grads and buffers) and its Adam state
    assert update.offload() == 0
    assert rollout.reload() > size  # the policy comes back with the first that needs it
    assert rollout.reload() == 0
    assert update.reload() > 0  # the optimizer state, beside its parameters


def test_in_process_a_shared_policy_stays_while_the_roles_take_turns(monkeypatch):
    # the rollout and the update hold one policy; only the update's Adam state is its own
    monkeypatch.setattr(off, "ALWAYS_COPY", True)  # every move is a copy: data_ptr tells
    model, opt = _trained()
    with Graph("shared") as g:
        g.output("r", Holder(model, name="rollout")())
        g.output("u", Holder(model, opt, name="update")())
    ptrs = [p.data_ptr() for p in model.parameters()]
    adam = sum(v.nbytes for state in opt.state.values() for k, v in state.items() if k != "step")
    results = LocalExecutor(g, offload="on").run(3)
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # the policy never moved
    for r in results:  # the Adam state went out before the rollout and back for the update
        assert r.sched["sched/offload_bytes"] == r.sched["sched/reload_bytes"] == adam


def test_an_update_whose_rank_group_has_not_formed_moves_nothing(monkeypatch):
    from nodes.update.grpo import GRPOUpdate

    monkeypatch.setattr(off, "ALWAYS_COPY", True)
    node = GRPOUpdate(name="grpo")
    node.setup()
    node.ranks = 2  # no group joined: nothing sharded to move (test_train_ranks moves a group's)
    assert node.offload() == 0 and node.reload() == 0
    node.ranks = 1
    assert node.offload() > 0 and node.reload() > 0  # alone, its policy moves


def test_training_with_offload_equals_training_without(monkeypatch):
    import graphs.mm_ppo as mm_ppo

    def run(offload: str) -> list:
        ex = LocalExecutor(mm_ppo.build_graph(batch_size=4), offload=offload)
        return ex.run(3)

    monkeypatch.setattr(off, "ALWAYS_COPY", True)
    moved = run("on")
    monkeypatch.setattr(off, "ALWAYS_COPY", False)
    plain = run("off")
    assert all(r.sched["sched/offload_bytes"] > 0 for r in moved)
    assert all(r.sched["sched/reload_bytes"] > 0 for r in moved)
    for a, b in zip(moved, plain):
        assert torch.equal(a.outputs["scores"], b.outputs["scores"])
        for k, v in a.outputs["metrics"].items():
            w = b.outputs["metrics"][k]
            assert v == w or (math.isnan(v) and math.isnan(w)), (k, v, w)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("controllers", [1, 2])
def test_offload_on_through_the_cli_reports_switches_in_metrics_and_trace(tmp_path, controllers):
    from runtime.cli import main
    from runtime.train.metrics import read_metrics

    out = tmp_path / "run"
    args = ["run", "graphs.toy", "--steps", "3", "--offload", "on", "--out", str(out)]
    # Two controllers on partial placement: the rollout side waits for the update's weights
    # and the training side for the rollout every step, so each goes idle (offload) and runs
    # again (reload) whatever the timing. (Colocated, the data and the encoder run ahead on
    # controller 0, and whether a controller ever waits depends on the timing.)
    where = ["--controllers", "2", "--placement", "partial"] if controllers == 2 else []
    assert main([*args, *where, "--quiet"]) == 0
    rows = read_metrics(out)
    assert len(rows) == 3 and all("sched/switch_s" in r for r in rows)
    assert sum(r["sched/switches"] for r in rows) > 0
    spans = [e for e in json.loads((out / "trace.json").read_text())["traceEvents"]]
    names = {e["name"] for e in spans if e["ph"] == "X"}
    assert {"offload", "reload"} <= names


def test_offload_off_through_the_cli_adds_no_switch_metrics(tmp_path):
    from runtime.cli import main
    from runtime.train.metrics import read_metrics

    out = tmp_path / "run"
    assert main(["run", "graphs.toy", "--steps", "2", "--offload", "off", "--out", str(out), "--quiet"]) == 0  # fmt: skip
    assert not any(k.startswith("sched/switch") for r in read_metrics(out) for k in r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_frees_the_gpu_memory_and_reload_restores_the_state():
    torch.manual_seed(0)
    model = nn.Linear(1024, 1024).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    opt.step()
    twin = copy.deepcopy(model.state_dict())
    node = Holder(model, opt, name="update")
    node.setup()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before, _ = torch.cuda.mem_get_info()  # what the driver has free: what another process gets
    moved = node.offload()
    assert moved >= 4 * 1024 * 1024 * 4  # weight, grad, exp_avg, exp_avg_sq
    assert model.weight.device.type == "cpu" and model.weight.is_pinned()
    assert torch.cuda.mem_get_info()[0] - before >= moved * 0.9
    assert node.reload() == moved
    assert model.weight.device.type == "cuda"
    assert all(
        v.device.type == "cuda" for s in opt.state.values() for k, v in s.items() if k != "step"
    )
    for k, v in model.state_dict().items():
        assert torch.equal(v, twin[k])
