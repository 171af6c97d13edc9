"""What each reader takes of a node's outputs (runtime/engine/calls.py).

There is no GPU here: the meta device stands for one. ``gpu_is_meta`` makes the rule count
"meta" as a CUDA device and copies a meta tensor to the host as zeros of its shape (a meta
tensor has no data to copy), so a value that reached a reader unmoved is still on "meta".
"""

from __future__ import annotations

import pytest
import torch

from runtime import LocalExecutor
from runtime.engine import calls
from runtime.engine.calls import TensorMoves, host_copy, on_cuda
from runtime.engine.engine import StepEngine
from yatt_graph import ANY, Graph, Node, Tensor

SEEN: dict[str, dict] = {}


@pytest.fixture
def gpu_is_meta(monkeypatch):
    monkeypatch.setattr(calls, "on_cuda", lambda d: on_cuda(d) or str(d) == "meta")
    monkeypatch.setattr(calls, "_to_host", lambda t: torch.zeros(t.shape, dtype=t.dtype))
    SEEN.clear()


class OnGpu(Node):
    """Returns its outputs on its (fake) GPU, as the library's model nodes do."""

    outputs = {"x": Tensor("float32", "B", "D"), "stats": ANY}
    device = "meta"

    def forward(self):
        return {"x": torch.ones(4, 3, device="meta"), "stats": {"m": torch.ones(2, device="meta")}}


class Reads(Node):
    inputs = {"x": Tensor("float32", "B", "D")}
    outputs = {"n": ANY}

    def __init__(self, device: str = "cpu", name: str | None = None):
        super().__init__(name=name)
        self.device = device

    def forward(self, x):
        SEEN[self.name] = {"x": x.device.type}
        return {"n": x.shape[0]}


def _graph() -> Graph:
    with Graph("moves") as g:
        out = OnGpu(name="gpu")()
        g.output("gpu_n", Reads(device="meta", name="on_gpu")(out.x))
        g.output("cpu_n", Reads(name="on_cpu")(out.x))
        g.output("x", out.x)
        g.output("stats", out.stats)
    return g


def test_a_reader_on_the_gpu_takes_the_tensor_and_one_off_it_a_host_copy(gpu_is_meta):
    result = LocalExecutor(_graph()).step()
    assert SEEN == {"on_gpu": {"x": "meta"}, "on_cpu": {"x": "cpu"}}
    # the graph's marked outputs (metrics, samples, checkpoints) are host copies, nested too
    assert result.outputs["x"].device.type == "cpu"
    assert result.outputs["stats"]["m"].device.type == "cpu"


class Outbox:
    """What the producer's controller sends: (piece index or -1, device, controllers)."""

    def __init__(self):
        self.sent = []

    def value(self, step, src, port, value, dests):
        if port == "x":
            self.sent.append((-1, value.device.type, dests))

    def piece(self, step, src, port, index, piece, dests):
        self.sent.append((index, piece.outputs[port].device.type, dests))

    def end(self, step, src, port, count, dests):
        pass


def _send_from_controller_0(g: Graph) -> list:
    """Run the producer "gpu" on controller 0 of three: "on_gpu" reads it on controller 1,
    "on_cpu" on controller 2."""
    assignment = {"gpu": 0, "on_gpu": 1, "on_cpu": 2}
    devices = {"gpu": "meta", "on_gpu": "meta", "on_cpu": "cpu"}
    outbox = Outbox()
    engine = StepEngine(
        {"gpu": g.nodes["gpu"]}, g.edges, g.graph_outputs, list(assignment), assignment,
        outbox=outbox, devices=devices,
    )  # fmt: skip
    engine.allow(1)
    assert engine.run_one()
    return sorted(outbox.sent)


def test_another_controller_takes_the_value_as_it_is_only_when_all_its_readers_are_on_a_gpu(
    gpu_is_meta,
):
    assert _send_from_controller_0(_graph()) == [(-1, "cpu", [2]), (-1, "meta", [1])]


def test_the_rule_splits_controllers_by_their_readers():
    class Edge:
        def __init__(self, src, dst):
            self.src, self.src_port, self.dst = src, "x", dst

    edges = [Edge("p", "a"), Edge("p", "b"), Edge("p", "c")]
    moves = TensorMoves({"p": "cuda:0", "a": "cuda", "b": "cpu", "c": "cuda:1"}, edges,
                        {"p": 0, "a": 1, "b": 2, "c": 2})  # fmt: skip
    # controller 2 runs a reader on the CPU as well: it gets the host copy, for both
    assert moves.split("p", "x", [1, 2]) == [([1], True), ([2], False)]
    cpu_only = TensorMoves({"p": "cpu", "a": "cpu"}, edges[:1], {"p": 0, "a": 1})
    assert cpu_only.split("p", "x", [1]) == [([1], True)]
    value = {"t": torch.ones(2)}
    inputs = {"x": value}
    assert cpu_only.inputs(Reads(name="a"), inputs) is inputs and cpu_only.for_host(value) is value


def test_host_copy_keeps_what_is_on_the_host_and_copies_the_rest(gpu_is_meta):
    here = [torch.ones(2), ("a", torch.zeros(1))]
    assert host_copy(here) is here
    moved = host_copy({"a": [torch.ones(2, device="meta")], "b": "text"})
    assert moved["a"][0].device.type == "cpu" and moved["b"] == "text"
    from yatt_graph.stream import Piece  # a named tuple keeps its type and fields

    piece = host_copy(Piece([0], {"x": torch.ones(1, device="meta")}, 1))
    assert type(piece) is Piece and piece.outputs["x"].device.type == "cpu" and piece.size == 1


# --- the library's model nodes return their outputs on their device ------------------------


def test_the_vision_encoder_returns_its_embeddings_on_its_device():
    from PIL import Image

    from nodes.vision import tiny_vision_encoder

    encoder = tiny_vision_encoder()
    encoder.setup()
    encoder.tower.to("meta")  # the tower on the (fake) GPU: its forward runs there
    encoder.device = torch.device("meta")
    out = encoder.run(images=[Image.new("RGB", (32, 32))] * 2)
    assert out["image_embeds"].device.type == "meta" and out["image_embeds"].shape == (2, 32)


@pytest.mark.parametrize("budget", [0, 12])
def test_the_reference_and_critic_scores_stay_where_the_model_computes(budget):
    from nodes.reference import _in_parts

    B, R = 4, 5
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    ids = torch.ones(B, 3, dtype=torch.long)

    def on_gpu(prompt_ids, prompt_mask, response_ids, response_mask, embeds, images):
        return torch.ones(response_ids.shape, device="meta")  # the model's forward, there

    out = _in_parts(on_gpu, budget, ids, ids, mask, mask.float(), None, None)
    assert out.device.type == "meta" and out.shape == (B, R)


class StreamsOnGpu(Node):
    outputs = {"x": Tensor("float32", "B", "D")}
    device = "meta"

    def forward_stream(self):
        for rows in ([0, 1], [2]):
            yield rows, {"x": torch.ones(len(rows), 3, device="meta")}, 3


def test_a_streams_pieces_go_to_each_controller_as_its_readers_take_them(gpu_is_meta):
    with Graph("stream") as g:
        x = StreamsOnGpu(name="gpu")()  # (one output: its handle)
        g.output("gpu_n", Reads(device="meta", name="on_gpu")(x))
        g.output("cpu_n", Reads(name="on_cpu")(x))
    sent = _send_from_controller_0(g)
    assert sent == [(0, "cpu", [2]), (0, "meta", [1]), (1, "cpu", [2]), (1, "meta", [1])]


def test_parts_from_two_devices_join_on_the_first_ones():
    from runtime.sched.batching import concat
    from yatt_graph.stream import Piece, join_pieces

    gpu, host = torch.ones(2, 3, device="meta"), torch.ones(1, 3)
    assert concat([{"x": gpu}, {"x": host}])["x"].device.type == "meta"
    joined = join_pieces([Piece([0, 1], {"x": gpu}), Piece([2], {"x": host})])
    assert joined["x"].device.type == "meta" and joined["x"].shape == (3, 3)
