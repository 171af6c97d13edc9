"""Streaming nodes in the executors: consumers fed per piece (runtime/engine/streams.py)."""

from __future__ import annotations

import pytest
import torch
from sample_nodes import Decode, LengthScore, Mean, Score
from zmq_graphs import assert_gone

from runtime.engine.engine import LocalExecutor
from runtime.engine.streams import StreamBook
from runtime.zmq.controller import IDLE_POLL_MS, poll_ms
from runtime.zmq.driver import ZmqExecutor
from yatt_graph import ANY, BatchPolicy, Graph, Node, NodeExecutionError, NodeOutputError, Tensor
from yatt_graph.stream import Piece, fuse_pieces


class Texts(Node):
    kind = "data"
    outputs = {"text": ANY}

    def __init__(self, n: int, **kw):
        super().__init__(**kw)
        self.n = n

    def forward(self):
        return {"text": [f"t{i}" for i in range(self.n)]}


def stream_graph(
    n: int = 7,
    pause_s: float = 0.0,
    per_row: bool = True,
    places: tuple[int, int] = (0, 1),
    other_text: bool = False,
    say_size: bool = False,
    score_policy: BatchPolicy | None = None,
) -> Graph:
    """decode (streams) -> score (fed per piece) -> mean (whole); decode's lengths also reach
    mean through a delayed edge."""
    with Graph("streams") as g:
        d = Decode(n, pause_s, say_size, placement=places[0], name="decode")()
        score_in = {"ids": d.ids, "length": d.length, "text": d.text}
        if other_text:  # a per-sample input that does not come from the stream: score runs whole
            score_in["text"] = Texts(n, placement=places[1], name="texts")()
            g.discard(d.text)
        policy = {"batch_policy": score_policy} if score_policy else {}
        s = Score(per_row, placement=places[1], name="score", **policy)(**score_in)
        mean = Mean(placement=places[1], name="mean")
        m = mean(score=s.score)
        g.connect(d.length, mean, "prev", delay=1)
        g.output("ids", d.ids)
        g.output("score", s.score)
        g.output("tag", s.tag)
        g.output("mean", m.mean)
        g.output("prev_total", m.prev_total)
    return g


def expected(step: int, n: int = 7) -> dict[str, object]:
    """What the graph computes, from Decode's own definition, without any streaming."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(1, 6, (n,), generator=g)
    ids = torch.randint(3, 50, (n, 5), generator=g)
    width = int(lengths.max())
    cut = torch.where(torch.arange(width)[None, :] < lengths[:, None], ids[:, :width], 0)
    return {"ids": cut, "score": cut.sum(-1).float() / lengths.float()}


def test_a_streaming_node_run_alone_joins_its_pieces_in_row_order():
    out = Decode(7).run()
    want = expected(0)
    assert torch.equal(out["ids"], want["ids"])  # ragged pieces zero-padded to the longest
    assert [int(t.split(":")[0][1:]) for t in out["text"]] == list(range(7))
    pieces = list(Decode(7).run_stream())
    assert len(pieces) > 1 and sorted(r for p in pieces for r in p.rows) == list(range(7))


@pytest.mark.parametrize(
    ("piece", "match"),
    [
        (([0, 0], {"y": torch.ones(2)}), "already yielded"),
        (([0, 1], {"y": torch.ones(3)}), "3 entries for 2 rows"),
        (([0], {"z": torch.ones(1)}), "every declared output"),
        ("oops", "yield \\(rows, outputs\\) pairs"),
        (([-1], {"y": torch.ones(1)}), "non-negative ints"),
        (([0, 3], {"y": torch.ones(2)}, 2), "below the batch size 2"),
        (([0], {"y": torch.ones(1)}, -1), "batch size must be a non-negative int"),
    ],
)
def test_a_bad_piece_is_named(piece, match):
    class Bad(Node):
        outputs = {"y": Tensor("float32", "B")}

        def forward_stream(self):
            yield piece

    with pytest.raises(NodeOutputError, match=f"node 'bad': forward_stream piece 0.*{match}"):
        Bad().run()


def test_a_mapping_is_a_value_of_the_whole_call_in_every_piece():
    class Stats(Node):
        outputs = {"y": Tensor("float32", "B"), "stats": ANY}

        def __init__(self, same: bool):
            super().__init__()
            self.same = same

        def forward_stream(self):
            stats = {"seconds": 0.5}
            yield [0, 1], {"y": torch.ones(2), "stats": stats}
            yield [2], {"y": torch.zeros(1), "stats": stats if self.same else {"seconds": 1.0}}

    out = Stats(True).run()
    assert out["stats"] == {"seconds": 0.5} and out["y"].tolist() == [1.0, 1.0, 0.0]
    with pytest.raises(NodeOutputError, match="'stats' is a mapping .* differs between pieces"):
        Stats(False).run()


@pytest.mark.parametrize(
    ("pieces", "match"),
    [
        ([([0], 2), ([1], 3)], "piece 1: says batch size 3, an earlier piece said 2"),
        ([([0], 2), ([1], None)], "piece 1: says batch size None, an earlier piece said 2"),
        ([([0], 3), ([1], 3)], "said its batch has 3 rows but yielded 2"),
    ],
)
def test_a_batch_size_is_said_alike_in_every_piece_and_kept(pieces, match):
    class Sized(Node):
        outputs = {"y": Tensor("float32", "B")}

        def forward_stream(self):
            for rows, size in pieces:
                yield (rows, {"y": torch.ones(1)}) + ((size,) if size is not None else ())

    with pytest.raises(NodeOutputError, match=match):
        Sized().run()


def test_rows_that_do_not_cover_the_batch_are_refused():
    class Gappy(Node):
        outputs = {"y": Tensor("float32", "B")}

        def forward_stream(self):
            yield [0], {"y": torch.ones(1)}
            yield [2], {"y": torch.ones(1)}

    with pytest.raises(NodeOutputError, match="not 0..1: missing \\[1\\]"):
        Gappy().run()


def _fused(sizes: list[int], budget: int) -> list[int]:
    """The calls that fusing whole pieces of ``sizes`` rows within ``budget`` rows makes."""
    calls: list[int] = []
    for n in sizes:
        if calls and calls[-1] + n <= budget:
            calls[-1] += n
        else:
            calls.append(n)
    return calls


@pytest.mark.parametrize("budget", [64, 3, 1])
def test_the_in_process_executor_fuses_the_queued_pieces_within_the_budget(budget):
    """In process the stream is complete before its consumer runs: each call takes as many
    whole pieces as its max_batch_size allows (a piece larger than the budget goes alone)."""
    graph = stream_graph(score_policy=BatchPolicy(max_batch_size=budget))
    with LocalExecutor(graph.plan(2)) as ex:
        results = ex.run(3)
        calls = ex.graph.nodes["score"].calls
    sizes = [[len(p.rows) for p in _stream_at(s)] for s in range(3)]
    assert calls == [c for step in sizes for c in _fused(step, budget)]
    assert sum(calls) == 21  # every row once
    if budget == 64:
        assert calls == [7, 7, 7]  # the whole stream in one call a step
    for step, r in enumerate(results):
        want = expected(step)
        assert torch.equal(r.outputs["ids"], want["ids"])
        assert torch.allclose(r.outputs["score"], want["score"])
        assert r.outputs["tag"] == [
            f"R{i}:{n}" for i, n in enumerate(want["ids"].ne(0).sum(-1).tolist())
        ]
        assert torch.allclose(r.outputs["mean"], want["score"].mean())
        # the delayed edge carries the joined lengths of the step before
        prev = -1 if step == 0 else int(expected(step - 1)["ids"].ne(0).sum())
        assert r.outputs["prev_total"] == prev


def _stream_at(step: int):
    node = Decode(7)
    node.begin_step(step)
    return node.run_stream()


def test_a_consumer_with_a_per_sample_input_from_elsewhere_runs_once_on_the_whole_batch():
    with LocalExecutor(stream_graph(other_text=True).plan(2)) as ex:
        r = ex.step()
        assert ex.graph.nodes["score"].calls == [7]
    assert torch.allclose(r.outputs["score"], expected(0)["score"])


@pytest.mark.timeout(120)
def test_a_per_sample_input_from_elsewhere_is_taken_row_by_row_when_the_stream_says_its_size():
    small = BatchPolicy(max_batch_size=2)  # so that a step takes several calls
    graph = stream_graph(other_text=True, say_size=True, score_policy=small)
    with LocalExecutor(graph.plan(2)) as ex:
        local = ex.run(2)
        calls = ex.graph.nodes["score"].calls
    assert len(calls) > 2 and sum(calls) == 14  # per piece, every row once
    graph = stream_graph(other_text=True, say_size=True, score_policy=small)
    with ZmqExecutor(graph.plan(2)) as ex:
        remote = ex.run(2)
    for step, (a, b) in enumerate(zip(local, remote, strict=True)):
        assert torch.allclose(a.outputs["score"], expected(step)["score"])
        # the texts came from the other node, each row with its own sample
        assert a.outputs["tag"] == [f"T{i}" for i in range(7)] == b.outputs["tag"]
        assert torch.equal(a.outputs["score"], b.outputs["score"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("executor", [LocalExecutor, ZmqExecutor], ids=["in-process", "zeromq"])
def test_a_consumer_that_does_not_answer_per_row_is_named(executor):
    with (
        executor(stream_graph(per_row=False).plan(2)) as ex,
        pytest.raises(NodeExecutionError, match="node 'score', called on piece 0.*at step 0"),
    ):
        ex.step()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("places", "controllers", "steps"),
    [((0, 1), 2, 3), ((0, 0), 1, 2)],
    ids=["between controllers", "on one controller"],
)
def test_zeromq_streaming_equals_the_in_process_run(places, controllers, steps):
    with LocalExecutor(stream_graph(places=places).plan(controllers)) as local:
        want = local.run(steps)
    with ZmqExecutor(stream_graph(places=places).plan(controllers)) as zmq_run:
        got = zmq_run.run(steps)
    for a, b in zip(want, got, strict=True):
        for key in ("ids", "score", "mean"):
            assert torch.equal(a.outputs[key], b.outputs[key]), key
        assert a.outputs["tag"] == b.outputs["tag"]
        assert a.outputs["prev_total"] == b.outputs["prev_total"]


@pytest.mark.timeout(120)
def test_zeromq_consumer_starts_before_the_producer_finishes():
    pause = 2.0  # real waiting in the producer after its first piece
    with ZmqExecutor(stream_graph(pause_s=pause).plan(2)) as ex:
        r = ex.step()
    decode_end = r.node_start["decode"] + r.node_seconds["decode"]
    assert r.node_seconds["decode"] >= pause
    # score (controller 1) took the first piece while decode (controller 0) was still paused;
    # the margin (1.5 s for the piece to cross and the call to start) holds on a loaded machine
    assert r.node_start["score"] < decode_end - pause / 4
    assert torch.allclose(r.outputs["score"], expected(0)["score"])


@pytest.mark.timeout(120)
def test_zeromq_a_producer_that_fails_mid_stream_stops_the_run_naming_it():
    """Its first piece already reached the consumer on the other controller; the run still
    stops with the producer, its controller and the step named, and leaves nothing behind."""
    with Graph("broken_stream") as g:
        d = Decode(7, fail_at=1, placement=0, name="decode")()
        s = Score(placement=1, name="score")(ids=d.ids, length=d.length, text=d.text)
        g.output("score", s.score)
        g.discard(s.tag)
    ex = ZmqExecutor(g.plan(2))
    try:
        assert torch.allclose(ex.step().outputs["score"], expected(0)["score"])
        with pytest.raises(NodeExecutionError, match="decode broke mid-stream at step 1") as err:
            ex.step()
        assert err.value.node == "decode" and "controller 0" in str(err.value)
    finally:
        ex.close()
    assert_gone(ex.pids, ex.run_dir)


@pytest.mark.timeout(120)
def test_zeromq_a_consumer_with_a_queue_delay_waits_for_more_pieces_then_runs_on_its_own():
    """With a long max_queue_delay_s the consumer on the other controller waits for the whole
    stream (its budget is never full): one call a step. With a short one it runs on what has
    arrived while the producer still pauses, as with no delay."""
    wait = BatchPolicy(max_batch_size=64, max_queue_delay_s=600.0)
    with ZmqExecutor(stream_graph(pause_s=1.0, score_policy=wait).plan(2)) as ex:
        results = ex.run(2)
    for step, r in enumerate(results):
        assert torch.allclose(r.outputs["score"], expected(step)["score"])
        decode_end = r.node_start["decode"] + r.node_seconds["decode"]
        assert r.node_start["score"] >= decode_end - 0.05  # it waited for the end of the stream
    pause = 2.0
    short = BatchPolicy(max_batch_size=64, max_queue_delay_s=0.2)
    with ZmqExecutor(stream_graph(pause_s=pause, score_policy=short).plan(2)) as ex:
        r = ex.step()
    decode_end = r.node_start["decode"] + r.node_seconds["decode"]
    assert r.node_start["score"] < decode_end - pause / 4  # the margin as in the test above
    assert torch.allclose(r.outputs["score"], expected(0)["score"])


def test_a_controller_with_nothing_to_run_wakes_when_a_queue_delay_runs_out():
    """The loop's wait is cut to a waiting consumer's delay (rounded up, so it has passed on
    waking), not the idle 500 ms that would let a 0.2 s max_queue_delay_s run 0.5 s late."""
    assert poll_ms(True, 0.2) == 0  # it ran something: look at once for what became ready
    assert poll_ms(False, None) == IDLE_POLL_MS
    assert poll_ms(False, 0.2) == 200
    assert poll_ms(False, 0.0004) == 1
    assert poll_ms(False, 0.0) == 0
    assert poll_ms(False, 30.0) == IDLE_POLL_MS


def test_pieces_fuse_in_order_and_pad_like_a_join():
    a = Piece([3, 1], {"ids": torch.tensor([[1, 2], [3, 4]]), "text": ["a", "b"]}, 5)
    b = Piece([0], {"ids": torch.tensor([[5, 6, 7]]), "text": ["c"]}, 5)
    f = fuse_pieces([a, b])
    assert f.rows == [3, 1, 0] and f.size == 5 and f.outputs["text"] == ["a", "b", "c"]
    assert torch.equal(f.outputs["ids"], torch.tensor([[1, 2, 0], [3, 4, 0], [5, 6, 7]]))
    assert fuse_pieces([a]) is a


def test_the_stream_book_waits_for_every_port_and_piece():
    book = StreamBook()
    book.add(0, "d", "a", 1, [1], [10])
    assert book.piece(0, "d", 0, {"a"}) is None and book.count(0, "d", {"a"}) is None
    book.add(0, "d", "a", 0, [0], [9])
    book.end(0, "d", "a", 2)
    assert book.count(0, "d", {"a"}) == 2 and book.count(0, "d", {"a", "b"}) is None
    assert not book.add(0, "d", "a", 0, [0], [9])  # a second copy is refused
    assert book.joined(0, "d", "a") == [9, 10]
    book.discard(0, "d")
    assert not book


def rollout_graph(stream: bool) -> Graph:
    """The library's Rollout (streaming or not) -> a per-sample score on another controller."""
    from nodes.rollout import Rollout

    with Graph("rollout_stream") as g:
        prompts = Texts(6, placement=0, name="prompts")()
        sample = Rollout(
            max_new_tokens=12,
            stop_token_ids=list(range(10, 20)),  # about one token in ten ends a response
            stream=stream,
            placement=0,
            name="rollout",
        )(prompts=prompts)
        g.output(
            "score",
            LengthScore(  # a small budget, so that a step takes several calls in process too
                placement=1, name="score", batch_policy=BatchPolicy(max_batch_size=2)
            )(response_lengths=sample.response_lengths, texts=sample.texts),
        )
        g.output("ids", sample.response_ids)
        g.output("lengths", sample.response_lengths)
        g.output("weight_sync", sample.weight_sync)  # a value of the call in every piece
        for port in ("prompt_ids", "prompt_mask", "response_mask", "logprobs", "group_ids"):
            g.discard(getattr(sample, port))
    return g


@pytest.mark.timeout(180)
def test_the_library_rollout_streams_to_a_consumer_on_another_controller():
    with LocalExecutor(rollout_graph(stream=False).plan(2)) as ex:
        whole = ex.run(2)
    with LocalExecutor(rollout_graph(stream=True).plan(2)) as ex:
        local = ex.run(2)
        calls = ex.graph.nodes["score"].calls
    assert len(calls) > 2 and sum(calls) == 12  # per piece, every row once
    with ZmqExecutor(rollout_graph(stream=True).plan(2)) as ex:
        remote = ex.run(2)
    for a, b, c in zip(whole, local, remote, strict=True):
        assert len(set(a.outputs["lengths"].tolist())) > 1  # ragged
        for key in ("score", "ids", "lengths"):
            assert torch.equal(a.outputs[key], b.outputs[key]), key
            assert torch.equal(b.outputs[key], c.outputs[key]), key
        zero = {"seconds": 0.0, "bytes": 0, "hf_seconds": 0.0}  # no weights reach it here
        assert (
            a.outputs["weight_sync"] == b.outputs["weight_sync"] == c.outputs["weight_sync"] == zero
        )
