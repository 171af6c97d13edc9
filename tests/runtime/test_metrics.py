import json
import os
import signal
import sys

import pytest
import torch

from runtime.cli import main
from runtime.interrupts import interrupts_held
from runtime.train.metrics import MetricsWriter, read_metrics, summarize


def test_summarize_flattens_outputs():
    row = summarize(
        3,
        {"scores": torch.tensor([0.0, 1.0]), "metrics": {"loss": 0.5, "note": "x"}},
        {"a": 0.1},
        0.2,
    )
    assert row == {
        "step": 3,
        "time/step": 0.2,
        "scores/mean": 0.5,
        "scores/std": 0.5,
        "loss": 0.5,
        "time/a": 0.1,
    }


def test_writer_appends_json_lines_and_reader_keeps_the_last_row_per_step(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write({"step": 0, "scores/mean": 0.1})
        w.write({"step": 1, "scores/mean": float("nan")})
        w.write({"step": 1, "scores/mean": 0.3})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[1])["scores/mean"] is None  # NaN is written as null, valid JSON
    assert read_metrics(tmp_path) == [
        {"step": 0, "scores/mean": 0.1},
        {"step": 1, "scores/mean": 0.3},
    ]


def test_run_writes_metrics_trace_and_plot(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "graphs.toy", "--steps", "6", "--out", str(out), "--quiet"]) == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(6)) and "time/rollout" in rows[0]
    trace = json.loads((out / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 6 * 6 and {e["name"] for e in spans} >= {"rollout", "update"}
    assert main(["plot", str(out)]) == 0
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(300)
def test_a_ready_graph_run_writes_the_rollouts_weight_sync_a_step(tmp_path):
    """text_grpo in process, 2 steps: step 0 loads no weights (0), step 1 the update's (the
    policy's state dict, which the rollout shares here: no copy, but its bytes counted)."""
    from yatt_graph.refs import load_graph

    out = tmp_path / "run"
    argv = ["run", "text_grpo", "--steps", "2", "--set", "batch_size=2", "--out", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    rows = read_metrics(out)
    assert rows[0]["weight_sync/bytes"] == rows[0]["weight_sync/seconds"] == 0
    policy = load_graph("graphs.text_grpo", batch_size=2).nodes["rollout"].policy
    assert rows[1]["weight_sync/bytes"] == sum(t.nbytes for t in policy.state_dict().values())
    assert rows[1]["weight_sync/seconds"] > 0 and "weight_sync/hf_seconds" in rows[1]


def test_run_ends_with_a_one_line_json_summary(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "graphs.toy", "--steps", "6", "--out", str(out), "--quiet"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    rows = read_metrics(out)
    rewards = [r["scores/mean"] for r in rows]
    assert summary["steps"] == 6 and summary["last_step"] == 5 and summary["window"] == 3
    assert summary["reward_first"] == pytest.approx(sum(rewards[:3]) / 3, abs=1e-6)
    assert summary["reward_last"] == pytest.approx(sum(rewards[-3:]) / 3, abs=1e-6)
    assert summary["wall_s"] > 0 and summary["samples_per_s"] > 0
    assert json.loads((out / "summary.json").read_text()) == summary


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


@pytest.mark.parametrize("checksum", ["google_crc32c", "tensorboard's own"])
def test_tensorboard_gets_every_metric(tmp_path, monkeypatch, checksum):
    pytest.importorskip(
        "tensorboard", reason="tensorboard is not installed (the test extra has it)"
    )
    if checksum == "google_crc32c":
        pytest.importorskip("google_crc32c", reason="the tensorboard extra installs it")
    else:
        monkeypatch.setitem(sys.modules, "google_crc32c", None)  # as if not installed

    with MetricsWriter(tmp_path) as w:
        w.write({"step": 0, "scores/mean": 0.25, "loss": 1.5})
        w.write({"step": 1, "scores/mean": 0.75, "loss": 1.0})
    # TensorBoard's reader drops a record whose checksum is wrong: every row is there.
    assert _scalars(tmp_path / "tensorboard") == {
        "scores/mean": [(0, 0.25), (1, 0.75)],
        "loss": [(0, 1.5), (1, 1.0)],
    }
    (path,) = (tmp_path / "tensorboard").iterdir()
    data = bytearray(path.read_bytes())
    data[-6] ^= 1  # a bit of the last step's record
    path.write_bytes(bytes(data))
    assert _scalars(tmp_path / "tensorboard")["loss"] == [(0, 1.5)]


def test_plot_of_a_folder_with_no_run_is_a_clear_error(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics at" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path)


@pytest.mark.parametrize(
    "row, kl_key",
    [
        ({"advantage/kl": 1.5, "approx_kl": 0.01}, "advantage/kl"),  # PPO: GAE's stats
        ({"kl_ref": 0.05, "approx_kl": 0.01}, "kl_ref"),  # GRPO: the update's KL term
        ({"kl": 0.2, "advantage/kl": 1.5}, "kl"),  # an exact name wins over a suffix
        ({"approx_kl": 0.01}, None),  # a policy's change per update is not a KL to the reference
    ],
)
def test_plot_draws_the_kl_to_the_reference_not_the_update_step(row, kl_key):
    from runtime.train.loop import _progress_fields
    from runtime.train.plot import _panels

    full = {"step": 0, "scores/mean": 0.5, **row}
    panels = dict(_panels([full]))
    assert panels.get("reward") == "scores/mean"
    assert panels.get("KL to reference") == kl_key
    # The progress bar shows the same curves.
    fields = _progress_fields(full, 10.0)
    assert fields["reward"] == "0.500"
    assert fields.get("kl") == (None if kl_key is None else f"{full[kl_key]:.3f}")


def test_a_last_line_cut_short_by_a_crash_is_left_out_with_a_warning(tmp_path, capsys):
    rows = [{"step": k, "reward/mean": 0.1 * k, "scores/mean": 0.1 * k} for k in range(3)]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rew'
    (tmp_path / "metrics.jsonl").write_text(text)
    with pytest.warns(RuntimeWarning, match=r"metrics.jsonl:4: the last line is cut short"):
        assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    assert main(["plot", str(tmp_path)]) == 0  # the plot uses the whole rows
    (tmp_path / "metrics.jsonl").write_text(text.replace('{"step": 1', 'garbage {"step": 1'))
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        read_metrics(tmp_path)


def _spin() -> None:
    for _ in range(10_000):  # bytecodes, where Python runs a pending signal's handler
        pass


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt, as in a terminal (a shell that starts the suite in the
    background sets SIGINT to be ignored, and this process inherits that)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_ctrl_c_inside_a_write_waits_until_the_row_is_whole_in_both_files(tmp_path, ctrl_c_raises):
    pytest.importorskip(
        "tensorboard", reason="tensorboard is not installed (the test extra has it)"
    )
    w = MetricsWriter(tmp_path)
    real, done = w._events.scalars, []

    def scalars(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        _spin()
        done.append(real(*args, **kwargs))

    w._events.scalars = scalars
    with pytest.raises(KeyboardInterrupt):
        w.write({"step": 0, "scores/mean": 0.5})
    assert done == [None]  # the event went in before Ctrl-C acted
    w.close()
    assert read_metrics(tmp_path)[0]["scores/mean"] == 0.5
    assert _scalars(tmp_path / "tensorboard") == {"scores/mean": [(0, 0.5)]}


def test_signals_held_in_a_block_reach_their_handlers_once_when_it_ends(ctrl_c_raises):
    seen = []
    old = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            _spin()
            assert seen == []
        assert seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_glance_shows_a_few_responses_with_their_prompts_and_rewards():
    from runtime.train.loop import glance

    outputs = {
        "prompts": ["what color?", "what shape?"],
        "texts": ["red", "blue", "a circle " * 20, "square"],  # two responses a prompt
        "scores": torch.tensor([1.0, 0.0, 0.5, 1.0]),
    }
    lines = glance(7, outputs, rows=2)
    assert lines[0] == "step 7: 2 of 4 responses"
    assert lines[1] == "  'what color?' -> 'red' (reward 1)"
    assert lines[2].startswith("  'what shape?' -> 'a circle a circle") and "...'" in lines[2]
    assert glance(7, {"scores": outputs["scores"]}) == []  # a graph without texts: nothing


@pytest.mark.timeout(300)
def test_a_run_glances_at_its_responses_every_n_steps_unless_quiet(tmp_path, capsys):
    argv = ["run", "text_grpo", "--steps", "2", "--set", "batch_size=2", "--glance-every", "1"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "step 0: 2 of 8 responses" in err and "step 1: 2 of 8 responses" in err
    assert "-> " in err and "(reward " in err
    assert main([*argv, "--out", str(tmp_path / "b"), "--quiet"]) == 0
    assert "responses\n" not in capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "c"), "--glance-every", "-1"]) == 2
    assert "--glance-every must be 0 or more" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_a_run_keeps_its_samples_every_n_steps_within_a_cap(tmp_path, capsys, monkeypatch):
    import pyarrow.parquet as pq

    import runtime.train.samples as samples

    argv = ["run", "text_grpo", "--steps", "4", "--set", "batch_size=2", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "a"), "--samples-every", "2"]) == 0
    files = sorted((tmp_path / "a" / "samples").iterdir())
    assert [f.name for f in files] == ["step-000001.parquet", "step-000003.parquet"]
    table = pq.read_table(files[-1]).to_pydict()
    assert table["step"] == [3] * 8 and table["sample"] == list(range(8))  # 2 prompts x 4
    assert table["prompt_index"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert table["prompt"][0] == table["prompt"][3] and all(0 <= r <= 1 for r in table["reward"])
    assert all(isinstance(n, int) and n >= 1 for n in table["length"])
    assert main([*argv, "--out", str(tmp_path / "b"), "--samples-every", "0"]) == 0
    assert not (tmp_path / "b" / "samples").exists()
    monkeypatch.setattr(samples, "MAX_BYTES", 1)  # full after the first file
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "c"), "--samples-every", "1"]) == 0
    assert len(list((tmp_path / "c" / "samples").iterdir())) == 1
    assert "no more samples are written this run" in capsys.readouterr().err
