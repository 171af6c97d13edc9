"""Rewards that take time: concurrent calls with time limits and retries
(nodes/rewards/calls.py), and the HTTP reward (nodes/rewards/remote.py) against a local server.

No verdict here depends on timing: concurrency is shown by barriers that only open when that
many calls run at once, and a call past its time limit is one that never returns by itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nodes.rewards import HttpReward, RuleReward, SampleError, reward, reward_from_option
from nodes.rewards.calls import CallFailure, CallPolicy, call_policy, run_calls
from yatt_graph import UsageError

pytestmark = pytest.mark.timeout(60)

# --- rewards used by the tests (module level, as a plan rebuilds them by reference) ----------

FOUR_AT_ONCE = threading.Barrier(4, timeout=30)
RELEASE = threading.Event()  # set at the end of a test whose calls never return by themselves
TRIES: Counter[str] = Counter()


@reward(concurrency=4)
def meets_three_others(text, meta):
    """Scores only when 4 calls run at once (the barrier breaks, and the call raises, else)."""
    FOUR_AT_ONCE.wait()
    return float(len(text))


def plain(text, meta):
    return float(len(text))


async def async_length(text, meta):
    await asyncio.sleep(0)
    return float(len(text))


@reward(timeout_s=0.2)
def hangs_on_x(text, meta):
    if text == "x":
        RELEASE.wait(60)
    return 1.0


@reward(timeout_s=0.2, retries=1)
async def async_hangs_on_x(text, meta):
    if text == "x":
        await asyncio.sleep(3600)  # cancelled at its time limit
    return 1.0


@reward(retries=2)
def fails_twice(text, meta):
    TRIES[text] += 1
    if TRIES[text] <= 2:
        raise ConnectionError(f"try {TRIES[text]}")
    return 5.0


def refuses(text, meta):
    TRIES[text] += 1
    raise SampleError("no code block in the response")


refuses.call_policy = CallPolicy(retries=3)


# --- the call policy ------------------------------------------------------------------------


def test_a_call_policy_is_the_options_over_the_declaration_over_the_defaults():
    assert call_policy(plain, "r") == CallPolicy(concurrency=1, timeout_s=None, retries=0)
    assert call_policy(async_length, "r").concurrency == 16
    assert call_policy(meets_three_others, "r") == CallPolicy(concurrency=4)
    assert call_policy(meets_three_others, "r", concurrency=2, retries=1) == CallPolicy(2, None, 1)
    assert RuleReward(fails_twice, timeout_s=3).calls == CallPolicy(1, 3, 2)
    with pytest.raises(ValueError, match="node 'r': concurrency must be an int >= 1, got 0"):
        RuleReward(plain, concurrency=0, name="r")
    with pytest.raises(ValueError, match=r"@reward on 'f': timeout_s must be a finite .* got -1"):

        def f(text, meta):
            return 0.0

        reward(timeout_s=-1)(f)
    with pytest.raises(ValueError, match="retries must be an int >= 0"):
        call_policy(plain, "r", retries=-2)


# --- running calls ----------------------------------------------------------------------------


def test_calls_run_at_once_up_to_the_concurrency_and_scores_keep_their_order():
    node = RuleReward(meets_three_others)
    texts = ["a", "bb", "ccc", "dddd", "e", "ff", "ggg", "hhhh"]  # two rounds of four
    assert node.run(texts=texts)["scores"].tolist() == [float(len(t)) for t in texts]


def test_the_last_call_to_end_keeps_its_place():
    order = []
    done = [threading.Event() for _ in range(4)]

    def waits_for_the_next(i: int) -> int:  # call i ends after call i + 1: reverse order
        if i + 1 < len(done):
            assert done[i + 1].wait(30)
        order.append(i)
        done[i].set()
        return i

    got = run_calls(waits_for_the_next, [((i,), {}) for i in range(4)], CallPolicy(concurrency=4))
    assert order == [3, 2, 1, 0] and got == [0, 1, 2, 3]


def test_an_async_reward_runs_on_the_loop_and_from_inside_a_running_loop():
    node = RuleReward(async_length)
    assert node.run(texts=["a", "bcd"])["scores"].tolist() == [1.0, 3.0]

    async def in_a_notebook():  # a caller whose thread already runs an event loop
        return node.run(texts=["ab"])["scores"].tolist()

    assert asyncio.run(in_a_notebook()) == [2.0]


@pytest.mark.parametrize("fn", [hangs_on_x, async_hangs_on_x])
def test_a_call_past_its_time_limit_follows_on_bad_sample(fn):
    try:
        node = RuleReward(fn, on_bad_sample="skip", emit_bad_mask=True)
        out = node.run(texts=["a", "x", "b"])
        assert out["scores"].tolist() == [1.0, 0.0, 1.0]
        assert out["bad_samples"].tolist() == [False, True, False]
        with pytest.raises(UsageError) as info:
            RuleReward(fn, name="judge").run(texts=["a", "x"])
        tries = " (2 tries)" if fn is async_hangs_on_x else ""
        assert str(info.value).startswith(
            f"node 'judge': sample 1 got no score from reward function {__name__}:"
            f"{fn.__name__}: no answer within timeout_s=0.2{tries} (make it faster, or give it "
            "more time: a larger timeout_s)."
        )
        assert str(info.value).endswith("or pass on_bad_sample='skip' to score such samples 0 and count them")  # fmt: skip
    finally:
        RELEASE.set()


def test_a_failing_call_is_tried_again_and_a_sample_error_is_not():
    TRIES.clear()
    assert RuleReward(fails_twice).run(texts=["a", "b"])["scores"].tolist() == [5.0, 5.0]
    assert TRIES == {"a": 3, "b": 3}
    TRIES.clear()
    with pytest.raises(ValueError, match=r"sample 0 got no score .*: it raised ConnectionError: try 2 \(2 tries\)"):  # fmt: skip
        RuleReward(fails_twice, retries=1).run(texts=["a"])
    TRIES.clear()
    node = RuleReward(refuses, on_bad_sample="skip")
    assert node.run(texts=["a"])["scores"].tolist() == [0.0] and TRIES == {"a": 1}
    with pytest.raises(UsageError, match="sample 0 got no score .*: no code block in the response"):
        RuleReward(refuses).run(texts=["a"])


def test_failures_are_values_and_run_calls_never_raises_for_a_call():
    def boom(x):
        raise KeyError(x)

    (got,) = run_calls(boom, [(("k",), {})], CallPolicy(concurrency=2, timeout_s=5))
    assert isinstance(got, CallFailure) and isinstance(got.error, KeyError)
    assert got.reason == "it raised KeyError: 'k'" and not got.user_error


# --- the HTTP reward --------------------------------------------------------------------------


class _Scorer(BaseHTTPRequestHandler):
    """Answers {"score": len(response) / 10}; a response "garbage" gets a non-JSON body, "oops"
    a 500 the first time, "bad" a 400."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)
        status, out = 200, json.dumps({"score": len(body["response"]) / 10, "note": "x"})
        if body["response"] == "garbage":
            out = "<html>not a score</html>"
        elif body["response"] == "oops" and sum(b["response"] == "oops" for b in self.server.seen) == 1:  # fmt: skip
            status, out = 500, "try later"
        elif body["response"] == "bad":
            status, out = 400, "no"
        data = out.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Scorer)
    httpd.seen = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join(10)


def _url(httpd: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{httpd.server_address[1]}/score"


def test_the_http_reward_posts_the_schema_and_reads_the_score(server):
    node = reward_from_option(_url(server))
    assert isinstance(node, HttpReward) and node.needs_prompts
    assert node.calls == CallPolicy(concurrency=16, timeout_s=30.0, retries=2)
    chat = [{"role": "user", "content": "hi"}]
    out = node.run(
        texts=["a", "oops", "abcd"], prompts=["p", chat, "q"], meta=[{"answer": "4", "n": 1}] * 3
    )
    assert out["scores"].tolist() == pytest.approx([0.1, 0.4, 0.4])  # "oops" after one 500
    first = min(server.seen, key=lambda b: b["response"])
    assert first == {"prompt": "p", "response": "a", "meta": {"answer": "4", "n": 1}}
    assert {json.dumps(b["prompt"]) for b in server.seen} >= {json.dumps(chat)}
    again = reward_from_option(_url(server), concurrency=2, timeout_s=5, retries=0)
    assert again.calls == CallPolicy(concurrency=2, timeout_s=5, retries=0)


@pytest.mark.parametrize(
    ("response", "said"),
    [
        ("garbage", "the server answered '<html>not a score</html>' (JSON is malformed"),
        ("bad", "the server answered status 400 ('no'), not the JSON {\"score\": number}"),
    ],
)
def test_a_server_answering_garbage_names_the_url_or_is_skipped(server, response, said):
    node = reward_from_option(_url(server), name="rm")
    with pytest.raises(UsageError) as info:
        node.run(texts=["ok", response], prompts=["p", "p"])
    message = str(info.value)
    assert message.startswith(f"node 'rm': sample 1 got no score from {_url(server)}: {said}")
    assert "nodes.rewards.remote" in message and "on_bad_sample='skip'" in message
    assert sum(b["response"] == response for b in server.seen) == 1  # refused, not tried again
    skip = reward_from_option(_url(server), on_bad_sample="skip")
    out = skip.run(texts=["ok", response], prompts=["p", "p"])
    assert out["bad_samples"].tolist() == [False, True] and out["scores"][1] == 0


def test_a_server_that_is_down_stops_the_run_naming_the_url_under_either_policy(caplog):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Scorer)  # a port nothing listens on
    url = _url(httpd)
    httpd.server_close()
    for policy in ("raise", "skip"):
        node = reward_from_option(url, on_bad_sample=policy, retries=0)
        with pytest.raises(UsageError) as info:
            node.run(texts=["a"], prompts=["p"])
        assert str(info.value) == (
            f"node 'reward': reward {url}: no server answers ([Errno 111] Connection refused); "
            "start the reward server there, or give --reward the URL it listens on"
        )


def test_an_http_spelling_without_a_host_lists_the_spellings():
    with pytest.raises(ValueError, match="reward 'http:/x': a reward server is http://HOST:PORT/PATH"):  # fmt: skip
        reward_from_option("http:/x")
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        HttpReward("ftp://h/x")


def test_a_skipped_failure_is_logged_with_the_samples(caplog):
    with caplog.at_level(logging.WARNING, logger="nodes.rewards"):
        RuleReward(refuses, on_bad_sample="skip", name="r").run(texts=["a", "b"])
    assert "node 'r': 2 sample(s) had no usable reward" in caplog.text and "[0, 1]" in caplog.text
