"""--wandb: the run's scalars and its kept samples in a W&B run beside the run folder, offline
when no key is configured (the test has none: HOME is a fresh folder and WANDB_* are unset)."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip(
    "wandb", reason="the wandb extra is not installed: pip install 'yatt-graph[wandb]'"
)

from process_helpers import live_children  # noqa: E402

from runtime.cli import main  # noqa: E402
from runtime.train.wandb_log import wandb_mode  # noqa: E402


@pytest.fixture
def no_key(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # no ~/.netrc, so no wandb login
    return home


def test_the_mode_is_offline_without_a_key(no_key, monkeypatch):
    assert wandb_mode() == "offline"
    (no_key / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k3y\n")
    (no_key / ".netrc").chmod(0o600)
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() is None  # the user's choice: wandb reads it itself


@pytest.mark.timeout(180)
def test_a_run_logs_its_scalars_and_kept_samples_offline(no_key, tmp_path, capsys):
    import pyarrow.parquet as pq

    out = tmp_path / "run"
    argv = ["run", "text_grpo", "--steps", "4", "--samples-every", "2", "--out", str(out)]
    assert main([*argv, "--wandb", "--quiet"]) == 0
    assert live_children() == []  # wandb's service process ended with the run
    (record,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    scalars = [k for k, v in last.items() if k != "step" and isinstance(v, int | float)]
    assert len(scalars) > 20
    deadline = time.monotonic() + 60  # wandb's core process may still be writing its log
    while missing := [k for k in scalars if k.encode() not in record.read_bytes()]:
        assert time.monotonic() < deadline, f"not in the W&B run's log: {missing}"
        time.sleep(0.2)
    tables = sorted(record.parent.glob("files/media/table/samples_*.table.json"))
    assert [t.name.split("_")[1] for t in tables] == ["1", "3"]  # the steps kept
    for step, table in zip((1, 3), tables):
        got = json.loads(table.read_text())
        kept = pq.read_table(out / "samples" / f"step-{step:06d}.parquet").to_pylist()
        rows = [dict(zip(got["columns"], row)) for row in got["data"]]
        assert [(r["prompt"], r["response"], r["reward"]) for r in rows] == [
            (r["prompt"], r["response"], r["reward"]) for r in kept
        ]


def test_wandb_needs_a_run_folder(capsys):
    assert main(["run", "toy", "--steps", "1", "--wandb", "--quiet"]) == 2
    assert "--wandb needs --out DIR" in capsys.readouterr().err
