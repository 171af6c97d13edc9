"""Rewards that take time, run as a user types them from a folder outside the repository: an
HTTP reward server (started here, in a thread), an async reward past its time limit, and the
sandboxed code-execution example, each in a one-step ``text_grpo`` run."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cli_helpers import yatt

ROOT = Path(__file__).resolve().parents[1]
RUN = ["run", "text_grpo", "--steps", "1", "--quiet", "--set", "batch_size=2", "group_size=2"]
"""One step of 2 prompts x 2 responses: 4 samples scored."""

pytestmark = pytest.mark.timeout(120)


def _last_metrics(out: Path) -> dict:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])


def _error_line(done) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if " error: " in x]
    return line


class _Server(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)
        data = json.dumps({"score": 0.625}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_an_http_reward_scores_each_sample_from_a_users_folder(tmp_path):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    httpd.seen = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/score"
    try:
        done = yatt(tmp_path, *RUN, "--reward", url, "--out", "run", timeout=100)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert done.returncode == 0, done.stderr
    assert _last_metrics(tmp_path / "run")["scores/mean"] == 0.625  # the server's scores
    assert len(httpd.seen) == 4
    for body in httpd.seen:
        assert set(body) == {"prompt", "response", "meta"}
        assert body["prompt"].endswith("?") and isinstance(body["response"], str)
        assert body["meta"]["answer"] in ("red", "green", "blue", "yellow")  # the row's columns


def test_an_http_reward_whose_server_is_down_is_one_line_naming_the_url(tmp_path):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    url = f"http://127.0.0.1:{httpd.server_address[1]}/score"
    httpd.server_close()  # nothing listens there now
    line = _error_line(yatt(tmp_path, *RUN, "--reward", url, timeout=100))
    assert f"reward {url}: no server answers" in line
    assert line.endswith("start the reward server there, or give --reward the URL it listens on")


SLOW = """
import asyncio
import itertools

from nodes.rewards import reward

calls = itertools.count()


@reward(concurrency=4, timeout_s=0.5)
async def score(text, meta):
    if next(calls) % 2:  # every second call never answers
        await asyncio.sleep(3600)
    return 1.0
"""


def test_an_async_reward_past_its_time_limit_is_skipped_and_counted_or_named(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW)
    args = [*RUN, "--reward", "slow.py:score"]
    done = yatt(tmp_path, *args, "--on-bad-sample", "skip", "--out", "run", timeout=100)
    assert done.returncode == 0, done.stderr
    row = _last_metrics(tmp_path / "run")
    assert row["skipped_samples"] == 2 and row["scores/mean"] == 0.5
    line = _error_line(yatt(tmp_path, *args, timeout=100))
    assert "got no score from reward function slow:score: no answer within timeout_s=0.5" in line
    assert "--on-bad-sample skip" in line


# The sandbox inside a run: each data row carries the response to score (what a policy might
# write), so that every kind of misbehaving code meets the sandbox in the same step.
CANNED = f"""
import importlib.util

from nodes.rewards import reward

spec = importlib.util.spec_from_file_location("code_reward", {str(ROOT / "examples/code_reward.py")!r})
code_reward = importlib.util.module_from_spec(spec)
spec.loader.exec_module(code_reward)
code_reward.LIMITS.update(cpu_s=1, wall_s=4.0, output_kb=64)


@reward(concurrency=4)
def score(text, meta):
    return code_reward.score(meta["canned"], meta)
"""

ADD = "def add(a, b):\n    return a + b\n"
MISBEHAVING = {
    "correct": ADD,
    "loops": "while True:\n    pass\n" + ADD,
    "sleeps": "import time\ntime.sleep(600)\n" + ADD,
    "allocates": "big = bytearray(8 << 30)\n" + ADD,
    "writes outside": "open({outside!r}, 'w').write('x')\n" + ADD,
    "opens a socket": "import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)\n" + ADD,
    "prints megabytes": "print('x' * 4_000_000)\n" + ADD,
    "half right": "def add(a, b):\n    return 5\n",
}


def test_the_code_reward_scores_misbehaving_code_and_the_run_goes_on(tmp_path):
    outside = tmp_path / "escape.txt"
    listener = socket.create_server(("127.0.0.1", 0))  # what the socket code tries to reach
    listener.setblocking(False)
    port = listener.getsockname()[1]
    rows = [
        {
            "prompt": f"write add ({name})",
            "canned": f"```python\n{code.format(outside=str(outside), port=port)}```",
            "tests": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"],
        }
        for name, code in MISBEHAVING.items()
    ]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "canned.py").write_text(CANNED)
    argv = ["run", "text_grpo", "--steps", "1", "--quiet", "--data", "tasks.jsonl",
            "--reward", "canned.py:score", "--set", "batch_size=8", "group_size=2"]  # fmt: skip
    try:
        done = yatt(tmp_path, *argv, "--out", "run", timeout=110)
        with pytest.raises(BlockingIOError):
            listener.accept()  # no connection came
    finally:
        listener.close()
    assert done.returncode == 0, done.stderr
    # Every row once, twice each: 1 (correct) and 0.5 (half right) of 8 rows; the rest 0.
    assert _last_metrics(tmp_path / "run")["scores/mean"] == pytest.approx(1.5 / 8)
    assert not outside.exists()


def test_the_code_reward_as_the_readme_runs_it(tmp_path):
    """The README's command, with the tiny policy (whose two-token answers hold no code
    block: 0 each), from a user's folder."""
    argv = ["run", "text_grpo", "--steps", "1", "--quiet", "--data",
            str(ROOT / "examples/code_tasks.jsonl"), "--reward",
            str(ROOT / "examples/code_reward.py") + ":score", "--set", "batch_size=2",
            "group_size=2", "--out", "run"]  # fmt: skip
    done = yatt(tmp_path, *argv, timeout=100)
    assert done.returncode == 0, done.stderr
    assert _last_metrics(tmp_path / "run")["scores/mean"] == 0.0
