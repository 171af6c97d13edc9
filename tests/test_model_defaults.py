"""Defaults that follow the user's model, as a user meets them through ``yatt-graph run``: a
default that cannot work for the model given is fitted to it and the run says so, while a
value the user set is kept (and refused, naming the fix, where it cannot work)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_helpers import yatt


@pytest.fixture
def short_context_model(tmp_path) -> Path:
    """A Llama of one's own (random, 2 layers) whose context is 32 positions."""
    from nodes.models.hf_causal import tiny_causal_lm
    from nodes.models.policy_base import TINY_MARK

    folder = tmp_path / "lm32"
    tiny_causal_lm("llama").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    del config[TINY_MARK]  # a user's checkpoint carries no mark
    config["max_position_embeddings"] = 32
    (folder / "config.json").write_text(json.dumps(config))
    rows = [{"prompt": word, "answer": word} for word in ("red", "blue", "green", "cyan")]
    (tmp_path / "words.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _run(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return yatt(cwd, "run", *argv, timeout=200)


@pytest.mark.timeout(240)
def test_a_default_max_new_tokens_is_fitted_to_a_short_context(short_context_model, tmp_path):
    done = _run(
        tmp_path, "text_grpo", "--policy", str(short_context_model), "--data", "words.jsonl",
        "--steps", "1", "--out", "run", "--set", "batch_size=2", "group_size=2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "max_new_tokens=16: the model takes 32 positions" in done.stderr, done.stderr
    settings = json.loads((tmp_path / "run" / "settings.json").read_text())
    assert json.dumps(settings).count('"max_new_tokens": 16') >= 1, settings
    # the precision and token budget measured for this CPU, said at the start and used
    from nodes.models.precision import native_bf16

    precision = "bf16" if native_bf16("cpu") else "no"
    assert f"mixed_precision={precision}, micro_batch_tokens=1024" in done.stderr, done.stderr
    config = settings["config"]
    assert (config["mixed_precision"], config["micro_batch_tokens"]) == (precision, 1024)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["response_lengths/mean"] <= 16


@pytest.mark.timeout(240)
def test_a_max_new_tokens_the_user_set_is_kept_and_refused_where_it_cannot_fit(
    short_context_model, tmp_path
):
    done = _run(
        tmp_path, "text_grpo", "--policy", str(short_context_model), "--data", "words.jsonl",
        "--steps", "1", "--out", "run", "--set", "batch_size=2", "group_size=2",
        "max_new_tokens=40",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.endswith(
        "error: graphs.text_grpo: option max_new_tokens=40: must be below the model's context, "
        "32 positions, which the prompt shares\n"
    ), done.stderr  # refused when the options are read, before any model loads
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
