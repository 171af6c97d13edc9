"""The README as a user follows it: every ``yatt-graph`` command of its code blocks runs here,
as typed, from a folder outside the repository, and does what the README says it does.

Two things are changed, and only these: step counts shrink (``--steps 500`` runs 4 steps, and
checkpoint intervals shrink with them), and the placeholders a user fills in are filled:
``/models/my-lm`` is a causal LM of one's own (a random 2-layer Llama saved to a folder, as a
user's checkpoint: no mark of the project's tiny models), ``prompts.jsonl`` / ``rows.jsonl``,
``my_rewards.py:score`` and ``my_env.py:MyEnv`` are written beside it, ``runs/demo/policy``
is a policy exported by a short run, and ``step_000250`` is the run's newest checkpoint.

A command the README gains with no check here fails :func:`test_every_readme_command_is_run`,
so the README cannot promise a command that nothing runs. The README's Python block runs too.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_helpers import yatt, yatt_here

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
STEPS = {"500": "4", "1000": "6", "300": "2"}
"""--steps of the README -> the steps run here (a resumed run continues past the first)."""
EVERY = {"50": "2", "20": "2"}
"""--checkpoint-every of the README -> here."""


def readme_blocks() -> list[list[str]]:
    """The ``yatt-graph`` command lines of each of the README's code blocks that has some,
    continuations joined and comments dropped, in the README's order."""
    blocks = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", README, re.S):
        text = re.sub(r"\\\n\s*", " ", block)
        lines = [line.split("  #")[0].strip() for line in text.splitlines()]
        found = [" ".join(line.split()) for line in lines if line.startswith("yatt-graph ")]
        if found:
            blocks.append(found)
    return blocks


def readme_commands() -> list[str]:
    return [command for block in readme_blocks() for command in block]


def _variants(command: str) -> list[str]:
    """A command with ``[OPTIONAL]`` parts, once without them and once with each."""
    optional = re.findall(r" \[([^\]]+)\]", command)
    bare = re.sub(r" \[[^\]]+\]", "", command)
    return [bare, *(f"{bare} {part}" for part in optional)]


MY_REWARDS = '''
def score(text, meta):
    """1 when the response holds the answer."""
    return 1.0 if str(meta.get("answer", "")).lower() in text.lower() else 0.0
'''

MY_ENV = '''
from nodes.agents import Environment, Observation


class MyEnv(Environment):
    """Say the row's answer; one turn."""

    max_turns = 1

    def reset(self, row):
        self.answer = row["answer"]
        return Observation(row["prompt"])

    def step(self, action):
        return None, float(self.answer in action), True
'''


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory) -> Path:
    """A user's folder: their model, data, reward and environment, and a demo policy."""
    from nodes.models.hf_causal import tiny_causal_lm
    from nodes.models.policy_base import TINY_MARK

    folder = tmp_path_factory.mktemp("user")
    model = folder / "models" / "my-lm"
    tiny_causal_lm("llama").save_pretrained(model)
    config = json.loads((model / "config.json").read_text())
    del config[TINY_MARK]
    (model / "config.json").write_text(json.dumps(config))
    rows = [{"prompt": f"say {w}", "answer": w} for w in ("red", "blue", "green", "cyan")]
    for name in ("prompts.jsonl", "rows.jsonl"):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    (folder / "my_rewards.py").write_text(MY_REWARDS)
    (folder / "my_env.py").write_text(MY_ENV)
    _yatt(folder, "run mm_ppo --steps 2 --out runs/demo --export runs/demo/policy --quiet")
    return folder


def _yatt(cwd: Path, command: str, timeout: float = 240) -> subprocess.CompletedProcess:
    done = yatt(cwd, *shlex.split(command), timeout=timeout)
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stderr[-4000:]}"
    return done


def _as_run_here(command: str, cwd: Path) -> str:
    """The README's command with its steps shrunk and its placeholders filled."""
    words = command.split()[1:]
    for i, word in enumerate(words[:-1]):
        if word == "--steps":
            words[i + 1] = STEPS[words[i + 1]]
        if word == "--checkpoint-every":
            words[i + 1] = EVERY[words[i + 1]]
    text = " ".join(words).replace("/models/my-lm", str(cwd / "models" / "my-lm"))
    if "step_000250" in text:
        newest = sorted((cwd / "runs" / "ppo" / "checkpoints").glob("step_*"))[-1]
        text = text.replace("step_000250", newest.name)
    if text.startswith("run ") and "--steps" not in words:
        text += " --steps 2"  # the README leaves the count to the default of 1000
    return text + (" --quiet" if text.startswith("run ") else "")


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _check_run(cwd: Path, command: str, done: subprocess.CompletedProcess) -> None:
    out = re.search(r"--out (\S+)", command) or re.search(r"--resume (\S+)", command)
    folder = cwd / (out[1] if out else "runs/" + command.split()[1])
    steps = int(re.search(r"--steps (\d+)", command)[1])
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (
        summary["steps"] == steps
        if "--resume" not in command
        else summary["last_step"] == steps - 1
    )
    if out:
        rows = _metrics(folder)
        assert [r["step"] for r in rows] == list(range(steps)), command
        assert (folder / "settings.json").is_file() and (folder / "trace.json").is_file()
    if "--checkpoint-every" in command:
        assert sorted((folder / "checkpoints").glob("step_*")), command
    if "--export" in command:
        assert (cwd / command.split("--export ")[1].split()[0] / "config.json").is_file()
    if "--controllers 2" in command:
        assert "controller 1" in done.stdout, done.stdout[-2000:]
    if "--overwrite" in command:
        assert list(folder.glob("previous-*")), command
    if "--env" in command or "text_agent" in command:
        assert "agent/turns_mean" in _metrics(folder)[-1] if out else True


CHECKS: dict[str, Callable[[Path, str, subprocess.CompletedProcess], None]] = {
    "run": _check_run,
    "plot": lambda cwd, c, d: _assert_file(cwd / c.split()[1] / "curves.png"),
    "report": lambda cwd, c, d: _assert_file(
        cwd / (c.split("-o ")[1] if "-o " in c else f"{c.split()[1]}/report.html")
    ),
    "viz": lambda cwd, c, d: _assert_svg(cwd / c.split("-o ")[1].split()[0]),
    "show": lambda cwd, c, d: _check_show(c, d.stdout),
    "export": lambda cwd, c, d: _assert_file(cwd / c.split()[2] / "prefix_vlm.json"),
}
"""Each subcommand's promised effect, checked after the command ran."""

IN_PROCESS = ("viz", "show", "export")
"""Subcommands run through the console script's ``main`` in this process (the same argv, in
the user's folder): each starts no run, and a process of its own would spend most of its
seconds importing torch. ``run``, ``plot`` and ``report`` run as processes of their own."""


def _assert_file(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 0, path


def _assert_svg(path: Path) -> None:
    text = path.read_text()
    assert text.lstrip().startswith("<") and "<svg" in text and "rollout" in text, path


def _check_show(command: str, out: str) -> None:
    if "--options" in command:
        assert "kl_coef" in out and "clip_eps" in out, out[:2000]
    elif "--mermaid" in command:
        assert out.lstrip().startswith(("graph", "flowchart")), out[:500]
    else:
        assert "rollout" in out and "ppo" in out, out[:2000]


def test_every_readme_command_is_run():
    commands = readme_commands()
    assert len(commands) >= 15  # (a parse that finds nothing would pass)
    for command in commands:
        assert command.split()[1] in CHECKS, f"README command with no check here: {command}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_readme_commands_do_what_it_says(user_folder):
    """Every command, in the README's order, in the user's folder; a command the README
    shows twice (the runs-and-folders section repeats the first run) runs once."""
    import time

    ran: set[str] = set()
    for command in readme_commands():
        for variant in _variants(command):
            if variant in ran:
                continue
            ran.add(variant)
            here = _as_run_here(variant, user_folder)
            start = time.perf_counter()
            if here.split()[0] in IN_PROCESS:
                done = yatt_here(user_folder, *shlex.split(here))
                assert done.returncode == 0, (
                    f"{here}: exit {done.returncode}\n{done.stderr[-4000:]}"
                )
            else:
                done = _yatt(user_folder, here)
            print(f"{time.perf_counter() - start:5.1f} s  yatt-graph {here}")
            CHECKS[variant.split()[1]](user_folder, here, done)


def test_the_readme_python_block_runs(tmp_path, monkeypatch):
    block = next(b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "Graph(" in b)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    graph = scope["g"]
    assert {"source", "encoder", "rollout", "reward", "update"} <= set(graph.nodes)
    import torch

    out = scope["centered"].run(scores=torch.tensor([1.0, 0.0]))
    assert torch.equal(out["advantages"], torch.tensor([0.5, -0.5]))
