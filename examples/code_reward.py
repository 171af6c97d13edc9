"""A code-execution reward: the response's last ```python block, run in a sandbox against the
row's tests; the score is the share of tests that pass.

    yatt-graph run text_grpo --policy DIR --data examples/code_tasks.jsonl \\
        --reward examples/code_reward.py:score

Each row of the data holds its tests in the ``tests`` column: a list of lines such as
``"assert add(2, 3) == 5"`` (or one string). The code runs once, then each test in the code's
namespace; a test that raises (an ``AssertionError`` or anything else) fails. A response with
no ```python block (nor a bare ``` block) scores 0.

The sandbox is a subprocess (``python -I -B``, an empty environment, a new session so that the
whole process group is killed at the end) with:

* CPU time: ``RLIMIT_CPU`` (:data:`LIMITS` ``cpu_s``); memory: ``RLIMIT_AS`` (``memory_mb``);
  output: stdout and stderr go to an unnamed temporary file under ``RLIMIT_FSIZE``
  (``output_kb``), which also bounds any file the code writes; wall clock: the process group
  is killed after ``wall_s`` (a ``sleep`` uses no CPU time). Past a limit the process dies and
  the tests it had not passed yet count as failed.
* No network: where an unprivileged process may make a user namespace (``unshare -rn``; most
  Linux machines), the child runs in a network namespace of its own, whose only device is a
  loopback that is down: the kernel refuses every connection, to other hosts and to this
  machine's own servers alike. Elsewhere (:data:`NETWORK` says which) an audit hook in the
  child refuses Python's socket calls, which code that reaches the C library some other way
  could get around (ctypes and new processes are refused for that reason, below).
* Files: a private temporary folder, its working directory, deleted afterwards. An audit hook
  refuses writes, removals and renames outside it (Python's ``open`` and ``os`` calls), starting
  processes and loading C libraries through ``ctypes``. The hook is Python's, not the kernel's:
  it stops what a policy's code plainly tries, not a native extension built to escape.

What the sandbox does not stop: code that games its own tests (an object whose ``__eq__`` is
always True passes ``assert f() == 3``); judge such tests, not the sandbox, by their asserts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from nodes.rewards import reward

__all__ = ["LIMITS", "NETWORK", "last_code_block", "run_tests", "score"]

LIMITS = {"cpu_s": 2, "memory_mb": 512, "output_kb": 256, "wall_s": 10.0}
"""The sandbox's limits: CPU seconds, address space in MB, output (and file) size in KB, and
wall-clock seconds."""

_UNSHARE = shutil.which("unshare")
PYTHON = sys.executable
"""The interpreter that runs the code (this one: the code may import what it has)."""


def _can_unshare() -> bool:
    if _UNSHARE is None:
        return False
    try:
        done = subprocess.run([_UNSHARE, "-rn", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


NETWORK = "namespace" if _can_unshare() else "audit hook"
"""How the child is kept off the network here: ``"namespace"`` (``unshare -rn``, the kernel)
or ``"audit hook"`` (Python's socket calls refused in the child)."""

_BLOCK = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# The child: reads its job from stdin, lowers its own limits (for good: an unprivileged process
# cannot raise a hard limit again), installs the audit hook, runs the code and then each test,
# printing one line a test that starts with a secret the code never sees on its stdout.
_CHILD = r"""
import json, os, resource, sys
job = json.loads(sys.stdin.read())
folder = os.path.realpath(job["folder"])
cpu, memory, output = job["cpu_s"], job["memory_mb"] << 20, job["output_kb"] << 10
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (output, output))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
PATHS = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,),
         "os.chown": (0,), "os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (1,),
         "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,)}
REFUSED = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
           "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata"}
if not job["namespace"]:
    REFUSED |= {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
                "socket.sendto", "socket.gethostbyname"}

def inside(path):
    if isinstance(path, int):
        return True  # an open descriptor: its file was checked when opened
    path = os.fsdecode(path)
    return os.path.realpath(path).startswith(folder + os.sep)

def guard(event, args):
    if event in REFUSED:
        raise PermissionError(f"sandbox: {event} is refused")
    if event == "open":
        path, mode, flags = args
        writes = (mode and any(c in mode for c in "wax+")) or (flags or 0) & WRITES
        if writes and not inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox is refused")
    elif event in PATHS and not all(inside(args[i]) for i in PATHS[event]):
        raise PermissionError(f"sandbox: {event} outside the sandbox is refused")

secret = job.pop("secret")
code, tests = job.pop("code"), job.pop("tests")
sys.addaudithook(guard)
print(secret, "start", flush=True)
scope = {"__name__": "__main__"}
try:
    exec(compile(code, "solution.py", "exec"), scope)
except BaseException:
    pass  # its tests fail on their own
for i, test in enumerate(tests):
    try:
        exec(compile(test, f"test_{i}", "exec"), scope)
        passed = True
    except BaseException:
        passed = False
    sys.stdout.flush()
    print(secret, i, "pass" if passed else "fail", flush=True)
"""


def last_code_block(text: str) -> str | None:
    """The last ```python (or bare ```) block of ``text``, or None."""
    blocks = _BLOCK.findall(text)
    return blocks[-1] if blocks else None


def run_tests(code: str, tests: Sequence[str], limits: Mapping[str, Any] = LIMITS) -> list[bool]:
    """Whether each test passed, with ``code`` run in the sandbox under ``limits``."""
    limits = {**LIMITS, **limits}
    secret = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="code-reward-") as folder, tempfile.TemporaryFile() as out:  # fmt: skip
        job = {**limits, "folder": folder, "code": code, "tests": list(tests), "secret": secret,
               "namespace": NETWORK == "namespace"}  # fmt: skip
        command = [PYTHON, "-I", "-B", "-c", _CHILD]
        if NETWORK == "namespace":
            command = [_UNSHARE, "-rn", *command]
        try:
            child = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=out, stderr=out, cwd=folder, env={},
                start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            raise RuntimeError(f"code_reward: the sandbox did not start ({exc})") from exc
        try:
            child.communicate(json.dumps(job).encode(), timeout=float(limits["wall_s"]))
        except subprocess.TimeoutExpired:
            pass
        finally:
            _kill_group(child)
        out.seek(0)
        lines = out.read(int(limits["output_kb"]) << 10).decode("utf-8", "replace").splitlines()
    ours = [line.split()[1:] for line in lines if line.startswith(secret + " ")]
    if ["start"] not in ours:  # not the code's fault: the sandbox itself did not start
        shown = " | ".join(lines[-3:])[:300]
        raise RuntimeError(
            f"code_reward: the sandbox did not start (exit {child.returncode}: {shown!r}); "
            f"check that {PYTHON} runs within the limits {limits}"
        )
    return [[str(i), "pass"] in ours for i in range(len(tests))]


def _kill_group(child: subprocess.Popen) -> None:
    """Kill the child's whole session (whatever it started) and reap it."""
    with contextlib.suppress(ProcessLookupError):  # (it and all it started ended already)
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


@reward(concurrency=4, timeout_s=LIMITS["wall_s"] + 20)
def score(text: str, meta: Mapping[str, Any], *, tests_key: str = "tests") -> float:
    """The share of the row's tests (``meta[tests_key]``) that the response's last Python
    block passes in the sandbox; 0 when it has no block."""
    if tests_key not in meta:
        raise ValueError(
            f"code_reward: the row has no {tests_key!r} column (its columns: {sorted(meta)}); "
            "give each row a list of assert lines"
        )
    tests = meta[tests_key]
    tests = [tests] if isinstance(tests, str) else list(tests)
    code = last_code_block(text)
    if code is None or not tests:
        return 0.0
    return sum(run_tests(code, tests)) / len(tests)
