"""Rollout with stream=True: finished rows handed out while the others still generate."""

from __future__ import annotations

import threading

import pytest
import torch

from nodes.models import sampling
from nodes.models.policy import tiny_prefix_vlm
from nodes.rollout import Rollout
from yatt_graph.stream import join_pieces

PROMPTS = ["hi", "what colour is it?", "x", "name the shape", "", "a b c"]


@pytest.fixture(scope="module")
def policy():
    return tiny_prefix_vlm(seed=0)


@pytest.fixture(scope="module")
def embeds():
    return torch.randn(len(PROMPTS), 32, generator=torch.Generator().manual_seed(0))


# stop_token_ids make the responses ragged (a random tiny policy rarely says EOS); greedy
# decoding of these prompts emits 36 at once in row 2 and 10 from step 6 on in row 3.
CASES = {
    "greedy": {"temperature": 0.0, "stop_token_ids": [10, 36]},
    "sampled, n=2, every 3": {"n": 2, "stop_token_ids": [5, 6, 7], "stream_every": 3},
    "top-p, stop string": {"temperature": 0.7, "top_p": 0.9, "stop": ["e"]},
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_pieces_join_to_what_the_whole_call_returns(policy, embeds, options):
    plain = {k: v for k, v in options.items() if k != "stream_every"}
    whole = Rollout(model=policy, max_new_tokens=16, seed=3, **plain)
    streamed = Rollout(model=policy, max_new_tokens=16, seed=3, stream=True, **options)
    assert streamed.streaming and not whole.streaming
    for _ in range(2):  # per-step seeds and group labels advance alike
        want = whole.run(prompts=PROMPTS, image_embeds=embeds)
        pieces = list(streamed.run_stream(prompts=PROMPTS, image_embeds=embeds))
        got = join_pieces(pieces, "rollout")
        assert got.keys() == want.keys()
        for key, value in want.items():
            if key in ("texts", "weight_sync"):  # (no weights came: the loads are 0 in both)
                assert got[key] == value
            else:  # the tiny policy pads with 0, as the join does: equal bit for bit
                assert torch.equal(got[key], value), key
        assert len(pieces) > 1  # ragged responses came out in more than one piece
    assert streamed.state_dict() == whole.state_dict()
    # run() (no executor) still returns the whole batch, the same one
    again = Rollout(model=policy, max_new_tokens=16, seed=3, stream=True, **options)
    assert torch.equal(
        again.run(prompts=PROMPTS, image_embeds=embeds)["logprobs"],
        (
            Rollout(model=policy, max_new_tokens=16, seed=3, **plain).run(
                prompts=PROMPTS, image_embeds=embeds
            )["logprobs"]
        ),
    )


def test_rows_leave_at_the_decode_step_they_end(policy, embeds, monkeypatch):
    """Each piece is handed out at the step its rows ended, not when the batch is done."""
    flushed = []
    flush = sampling._FinishWatch.flush

    def spy(self, new_tokens):
        flushed.append((new_tokens.shape[1], list(self.ended)))
        flush(self, new_tokens)

    monkeypatch.setattr(sampling._FinishWatch, "flush", spy)
    node = Rollout(
        model=policy, max_new_tokens=16, temperature=0.0, stop_token_ids=[10, 36], stream=True
    )
    pieces = list(node.run_stream(prompts=PROMPTS, image_embeds=embeds))
    lengths = join_pieces(pieces)["response_lengths"]
    assert [rows for _, rows in flushed] == [p.rows for p in pieces]
    for width, rows in flushed[:-1]:  # every piece but the last left before the end
        assert width < int(lengths.max())
        assert all(int(lengths[r]) <= width for r in rows)


def test_a_stream_closed_early_stops_its_generation(policy, embeds):
    node = Rollout(model=policy, max_new_tokens=64, stop_token_ids=[5], stream=True)
    stream = node.run_stream(prompts=PROMPTS, image_embeds=embeds)
    next(stream)
    stream.close()
    assert not [t for t in threading.enumerate() if t.name == "yatt-generate"]
    assert node.step == 0  # the call did not complete


def test_an_error_in_generation_reaches_the_caller(policy, embeds, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the model broke")

    node = Rollout(model=policy, max_new_tokens=8, stream=True)
    monkeypatch.setattr(node.policy, "_generate_raw", broken)
    with pytest.raises(RuntimeError, match="the model broke"):
        list(node.run_stream(prompts=PROMPTS, image_embeds=embeds))
    assert not [t for t in threading.enumerate() if t.name == "yatt-generate"]


def test_stream_options_are_checked(policy):
    with pytest.raises(
        ValueError, match="stream=True needs backend='hf', recompute_logprobs=False"
    ):
        Rollout(model=policy, stream=True, recompute_logprobs=True)
    with pytest.raises(ValueError, match="stream_every=0"):
        Rollout(model=policy, stream=True, stream_every=0)
