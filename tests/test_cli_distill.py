"""On-policy distillation as a user types it: ``yatt-graph run text_grpo --teacher DIR --set
distill_coef=...`` from a folder outside the repository, and its mistakes as one-line errors
before any step."""

from __future__ import annotations

import json

import pytest
from cli_helpers import yatt, yatt_here

from nodes.data import task_vocabulary
from nodes.models.policy import build_policy


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """A teacher with the tiny policy's tokenizer (another seed's weights), and one with a
    character tokenizer."""
    root = tmp_path_factory.mktemp("teachers")
    build_policy(
        {"name": "tiny-prefix-vlm", "words": task_vocabulary(), "seed": 5}
    ).save_pretrained(root / "same")
    build_policy({"name": "tiny-qwen2", "seed": 5}).save_pretrained(root / "chars")
    return root


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["loss", "advantage"])
def test_a_teacher_teaches_and_each_step_reports_the_reverse_kl(tmp_path, teachers, mode):
    teacher = teachers / "same"
    run = yatt(tmp_path, "run", "text_grpo", "--teacher", str(teacher), "--steps", "3",
               "--set", "distill_coef=0.5", f"distill_mode={mode}", "reward_coef=0",
               "--out", "run")  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "step" in r and "loss" in r]
    assert len(steps) == 3
    for row in steps:
        assert "time/teacher" in row  # the teacher node ran this step
        kl = row["distill/kl"]
        assert isinstance(kl, float) and abs(kl) < 10  # log pi - log pi_teacher, a mean
        assert ("distill_loss" in row) == (mode == "loss")
        if mode == "loss":
            assert row["distill_loss"] > 0  # k2 of two different models
    settings = json.loads((tmp_path / "run" / "settings.json").read_text())
    assert json.dumps(settings).count(str(teacher)) >= 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--teacher", "{root}/nowhere", "--set", "distill_coef=1"],
         "option --teacher {root}/nowhere: must be an existing local model folder"),
        (["--teacher", "{root}/chars", "--set", "distill_coef=1"],
         "option --teacher {root}/chars: its tokenizer is not the policy's (the policy's "
         "vocabulary has 24 tokens and the teacher's 101;"),
        (["--teacher", "{root}/same", "--set", "distill_coef=-0.5"],
         "option distill_coef=-0.5: must be a finite number >= 0.0"),
        (["--set", "distill_coef=1"], "option distill_coef=1.0 needs a teacher: pass --teacher DIR"),
        (["--teacher", "{root}/same"], "is read only with distill_coef > 0; pass --set distill_coef=1"),
    ],
)  # fmt: skip
def test_a_wrong_teacher_or_coef_is_one_line_before_any_step(tmp_path, teachers, argv, message):
    argv = [a.format(root=teachers) for a in argv]
    run = yatt_here(tmp_path, "run", "text_grpo", *argv, "--steps", "2", "--out", "run")
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("yatt-graph run: error: "), run.stderr[-2000:]
    assert message.format(root=teachers) in lines[0]
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
