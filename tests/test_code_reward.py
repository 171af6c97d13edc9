"""The sandboxed code-execution reward shipped as an example (examples/code_reward.py): code
that loops, sleeps, allocates too much, writes outside its folder, starts a process, opens a
socket or prints megabytes scores what it should and returns within the limits; correct code
passes. Each case is built so that, without its limit, the tests would pass (the limit is what
the score shows), and no verdict depends on timing."""

from __future__ import annotations

import importlib.util
import socket
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"cpu_s": 1, "memory_mb": 256, "output_kb": 64, "wall_s": 4.0}

pytestmark = pytest.mark.timeout(120)


def _load():
    spec = importlib.util.spec_from_file_location("code_reward", ROOT / "examples/code_reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


code_reward = _load()
ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]


def _run(code: str, tests: list[str], **limits) -> list[bool]:
    return code_reward.run_tests(code, tests, {**SMALL, **limits})


def test_the_last_python_block_is_scored_by_the_share_of_tests_passed():
    text = f"First try:\n```python\ndef add(a, b):\n    return 5\n```\nBetter:\n```python\n{ADD}```"
    assert code_reward.last_code_block(text) == ADD
    assert code_reward.score(text, {"tests": ADD_TESTS}) == 1.0
    half = "```python\ndef add(a, b):\n    return 5\n```"
    assert code_reward.score(half, {"tests": ADD_TESTS}) == 0.5
    assert code_reward.score("no code here", {"tests": ADD_TESTS}) == 0.0
    assert code_reward.score(f"```\n{ADD}```", {"tests": "assert add(1, 1) == 2"}) == 1.0
    with pytest.raises(ValueError, match="the row has no 'tests' column"):
        code_reward.score(half, {"answer": "x"})


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("loops forever", "while True:\n    pass\n"),
        ("sleeps past the wall clock", "import time\ntime.sleep(600)\n"),
    ],
)
def test_code_past_its_time_is_killed_and_scores_what_it_passed(name, code):
    tests = ["assert True", code, "assert True"]  # the second test never ends
    assert _run("", tests) == [True, False, False]


def test_an_allocation_beyond_the_memory_limit_fails():
    code = (
        "try:\n    big = bytearray(1 << 30)\n    got = True\nexcept MemoryError:\n    got = False\n"
    )
    assert _run(code, ["assert got"]) == [False]
    assert _run(code, ["assert got"], memory_mb=2048) == [True]  # the limit is what refused it


def test_megabytes_of_output_stop_the_code_and_the_rest_fails():
    code = "print('x' * 4_000_000)\n" + ADD
    assert _run(code, ADD_TESTS) == [False, False]
    assert _run(code, ADD_TESTS, output_kb=8192) == [True, True]


def test_files_are_written_only_in_a_private_folder_deleted_afterwards(tmp_path, monkeypatch):
    outside = tmp_path / "escape.txt"
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    code = (
        "import os\n"
        "open('mine.txt', 'w').write('here')\n"
        "inside = open('mine.txt').read()\n"
        f"try:\n    open({str(outside)!r}, 'w').write('x')\n    wrote = True\n"
        "except PermissionError:\n    wrote = False\n"
        f"try:\n    os.rename('mine.txt', {str(outside)!r})\n    moved = True\n"
        "except PermissionError:\n    moved = False\n"
        f"try:\n    os.system('touch {outside}')\n    started = True\n"
        "except PermissionError:\n    started = False\n"
    )
    tests = ["assert inside == 'here'", "assert wrote", "assert moved", "assert started"]
    assert _run(code, tests) == [True, False, False, False]
    assert not outside.exists()
    assert list(temp.iterdir()) == []  # the private folder is gone


def test_the_environment_is_empty(monkeypatch):
    monkeypatch.setenv("CODE_REWARD_SECRET", "s3cret")
    code = "import os\nnames = set(os.environ)\n"
    assert _run(code, ["assert 'CODE_REWARD_SECRET' not in names", "assert 'PATH' not in names"]) == [True, True]  # fmt: skip


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server
    server.close()


def _connects(port: int) -> str:
    return (
        "import socket\n"
        f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
        "    reached = True\nexcept OSError:\n    reached = False\n"
    )


def _pending(server: socket.socket) -> int:
    count = 0
    while True:
        try:
            server.accept()[0].close()
        except BlockingIOError:
            return count
        count += 1


@pytest.mark.parametrize("network", ["namespace", "audit hook"])
def test_code_reaches_no_socket(listener, network, monkeypatch):
    if network == "namespace" and code_reward.NETWORK != "namespace":
        pytest.skip("this machine lets no unprivileged process make a user namespace (unshare -rn)")
    monkeypatch.setattr(code_reward, "NETWORK", network)
    code = _connects(listener.getsockname()[1])
    scope: dict = {}
    exec(code, scope)  # outside the sandbox the same code reaches the server
    assert scope["reached"] and _pending(listener) == 1
    assert _run(code, ["assert reached"]) == [False]
    assert _pending(listener) == 0


@pytest.mark.parametrize("network", ["namespace", "audit hook"])
def test_a_sandbox_that_cannot_start_is_an_error_not_a_zero(tmp_path, monkeypatch, network):
    if network == "namespace" and code_reward.NETWORK != "namespace":
        pytest.skip("this machine lets no unprivileged process make a user namespace (unshare -rn)")
    monkeypatch.setattr(code_reward, "NETWORK", network)
    monkeypatch.setattr(code_reward, "PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(RuntimeError, match="code_reward: the sandbox did not start"):
        _run(ADD, ADD_TESTS)


def test_the_example_data_rows_hold_tests_the_reward_reads():
    import json

    rows = [json.loads(line) for line in (ROOT / "examples/code_tasks.jsonl").read_text().splitlines()]  # fmt: skip
    assert len(rows) == 8 and all(row["prompt"] and row["tests"] for row in rows)
    assert code_reward.score(f"```python\n{ADD}```", rows[0]) == 1.0  # the add task
