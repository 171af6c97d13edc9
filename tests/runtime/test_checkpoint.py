import pytest
from metrics_helpers import learning_values

from runtime import LocalExecutor
from runtime.train.checkpoint import CheckpointError, checkpoints, load_checkpoint, save_checkpoint
from runtime.train.loop import train
from runtime.train.metrics import read_metrics
from yatt_graph.refs import load_graph


def learning_keys(rows):
    return [learning_values(r) for r in rows]


def test_a_resumed_run_ends_with_the_same_metrics_as_an_uninterrupted_one(tmp_path):
    whole = train(
        LocalExecutor(load_graph("graphs.toy", seed=2)), 12, tmp_path / "whole", progress=False
    )
    part = tmp_path / "part"
    train(
        LocalExecutor(load_graph("graphs.toy", seed=2)), 7, part, checkpoint_every=7, progress=False
    )
    resumed = train(
        LocalExecutor(load_graph("graphs.toy", seed=2)),
        12,
        part,
        checkpoint_every=7,
        resume=part,
        progress=False,
    )
    assert [r["step"] for r in resumed] == [7, 8, 9, 10, 11]
    assert learning_keys(read_metrics(part)) == learning_keys(whole)
    assert (part / "trace.json").is_file() and (part / "checkpoints" / "step_000012").is_dir()


def test_a_corrupted_checkpoint_is_refused_and_the_previous_good_one_is_used(tmp_path):
    save_checkpoint(tmp_path, 1, {"step": 1})
    newest = save_checkpoint(tmp_path, 2, {"step": 2})
    data = (newest / "state.pt").read_bytes()
    (newest / "state.pt").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.warns(RuntimeWarning, match="step_000002: state.pt does not match its checksum"):
        path, state = load_checkpoint(tmp_path)
    assert path.name == "step_000001" and state == {"step": 1}
    (path / "meta.json").write_text("{not json")
    with pytest.raises(
        CheckpointError,
        match=r"step_000002: state.pt does not match.*step_000001: meta.json is not JSON",
    ):
        load_checkpoint(tmp_path)


def test_only_the_newest_checkpoints_are_kept_and_none_is_a_clear_error(tmp_path):
    for step in range(5):
        save_checkpoint(tmp_path, step, {"step": step}, keep=2)
    assert [p.name for p in checkpoints(tmp_path)] == ["step_000003", "step_000004"]
    with pytest.raises(CheckpointError, match="empty does not exist; give a run folder"):
        load_checkpoint(tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoints in"):
        load_checkpoint(tmp_path / "empty")


def test_rotation_orders_by_step_and_never_deletes_the_checkpoint_just_written(tmp_path):
    for step in (999_998, 999_999, 1_000_000, 1_000_001):  # names past 6 digits sort wrongly
        save_checkpoint(tmp_path, step, {"step": step}, keep=2)
    assert [p.name for p in checkpoints(tmp_path)] == ["step_1000000", "step_1000001"]
    assert load_checkpoint(tmp_path)[1] == {"step": 1_000_001}
    just_written = save_checkpoint(tmp_path, 5, {"step": 5}, keep=2)  # below the others
    assert just_written.is_dir()
    assert [p.name for p in checkpoints(tmp_path)] == ["step_000005", "step_1000001"]


def test_a_write_killed_midway_leaves_no_temporary_folder_after_the_next_save(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    dead = root / ".tmp_step_000004_999999999"  # no such pid
    (dead / "state.pt").parent.mkdir()
    (dead / "state.pt").write_bytes(b"half")
    save_checkpoint(tmp_path, 5, {"x": 1})
    assert sorted(p.name for p in root.iterdir()) == ["step_000005"]


def test_a_step_folder_without_meta_json_is_named(tmp_path):
    step = save_checkpoint(tmp_path, 2, {"x": 1})
    (step / "meta.json").unlink()
    with pytest.raises(
        CheckpointError, match=r"step_000002 has no meta.json: not a whole checkpoint"
    ):
        load_checkpoint(step)


def test_equal_tensors_are_written_once_and_loaded_as_their_own(tmp_path):
    """The update's weights, the same weights still on a delayed edge, and a copy of them
    elsewhere: one copy in state.pt. Loaded back, each is its own tensor again, so an
    in-place step on one (an optimizer's moment) leaves the others as they were; the state
    handed to the save is not changed."""
    import torch

    from yatt_graph.types import WeightUpdate

    weights = {"w": torch.randn(512, 1024), "b": torch.zeros(1024)}  # 2 MiB and 4 KiB
    update = WeightUpdate({k: v.clone() for k, v in weights.items()}, version=3)
    older = WeightUpdate({"w": weights["w"] + 1, "b": weights["b"]}, version=2)
    moment = torch.zeros(512, 1024)
    state = {
        "nodes": {"ppo": {"policy": weights, "moment": moment}, "critic": {"w": weights["w"].clone()}},
        "delayed": [["ppo", "weights", 1, older], ["ppo", "weights", 2, update]],
    }  # fmt: skip
    save_checkpoint(tmp_path, 3, state)
    size = (tmp_path / "checkpoints" / "step_000003" / "state.pt").stat().st_size
    mib = 1 << 20
    # w, the older w + 1 and the moment (and small ones); not w three times over: 5 x 2 MiB
    assert 3 * 2 * mib <= size < 3 * 2 * mib + mib // 2, size
    assert state["delayed"][1][3] is update and update.weights["w"] is not weights["w"]
    _, loaded = load_checkpoint(tmp_path)
    got = loaded["nodes"]["ppo"]["policy"]["w"]
    assert torch.equal(got, weights["w"]) and torch.equal(loaded["nodes"]["critic"]["w"], got)
    sent = loaded["delayed"][1][3]
    assert isinstance(sent, WeightUpdate) and sent.version == 3
    assert torch.equal(sent.weights["w"], got) and torch.equal(
        loaded["delayed"][0][3].weights["w"], weights["w"] + 1
    )
    loaded["nodes"]["ppo"]["moment"].add_(1.0)  # an optimizer step on the loaded moment
    got.mul_(2)
    assert torch.equal(sent.weights["w"], weights["w"]) and torch.equal(
        loaded["nodes"]["critic"]["w"], weights["w"]
    )
    assert not loaded["delayed"][0][3].weights["b"].any()
