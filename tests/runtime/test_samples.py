"""The samples file's lineage columns, from real runs of the ready graphs: where each sample
came from (data file and row, image), what it became (stop reason, reward, advantage,
reference KL, logprob gap) and what made it (weight version, staleness, controller); and a
misaligned graph output refused, naming it."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nodes.sample_stats import SampleStats, sample_positions, sample_stats
from runtime.train.samples import IMAGES, SampleAlignmentError, SampleWriter

CLI = "import sys; from runtime.cli import main; sys.exit(main())"


def _run(out: Path, graph: str, *args: str, timeout: float = 240) -> list[dict]:
    import pyarrow.parquet as pq

    cmd = [sys.executable, "-c", CLI, "run", graph, "--out", str(out), "--quiet",
           "--samples-every", "1", *args]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return pq.read_table(out / "samples").to_pylist()  # the folder reads as one table


@pytest.fixture(scope="module")
def grpo(tmp_path_factory) -> tuple[Path, list[dict]]:
    """mm_grpo, 3 steps of 2 prompts x 4 samples, every step kept."""
    out = tmp_path_factory.mktemp("samples") / "grpo"
    return out, _run(out, "mm_grpo", "--steps", "3", "--set", "batch_size=2")


@pytest.mark.timeout(240)
def test_each_sample_names_its_data_row_prompt_and_image(grpo):
    from PIL import Image

    from nodes.data import make_sample
    from runtime.train.samples import image_hash

    out, rows = grpo
    assert len(rows) == 3 * 8
    for r in rows:
        assert r["data_file"] == "shapes:color"
        index = r["step"] * 2 + r["prompt_index"]  # the stream's position: 2 prompts a step
        assert r["data_row"] == index
        image, prompt, _ = make_sample(0, index, "color")
        assert r["prompt"] == prompt and r["image"] == image_hash(image)
    import pyarrow.parquet as pq

    pngs = pq.read_table(out / "samples" / IMAGES).to_pydict()
    assert sorted(pngs["hash"]) == sorted({r["image"] for r in rows})  # each image once
    for png in pngs["png"]:
        thumb = Image.open(io.BytesIO(png))
        assert thumb.format == "PNG" and max(thumb.size) <= 64


@pytest.mark.timeout(240)
def test_stop_reason_advantage_kl_and_weight_version_per_sample(grpo):
    _, rows = grpo
    settings = json.loads((grpo[0] / "settings.json").read_text())["config"]
    longest = settings["max_new_tokens"]
    for r in rows:
        assert r["stop_reason"] in ("stop", "max_new_tokens")
        if r["stop_reason"] == "max_new_tokens":
            assert r["length"] == longest
        assert r["weight_version"] == r["step"] and r["staleness"] == 0  # on-policy
        assert r["controller"] == 0
        if r["step"] == 0:  # the policy is still the reference
            assert abs(r["ref_kl"]) < 1e-5
        assert "logprob_gap" not in r  # nothing recomputes logprobs here
    assert any(abs(r["ref_kl"]) > 1e-3 for r in rows if r["step"] == 2)  # updated since
    for step in range(3):
        for prompt in range(2):
            group = [r for r in rows if r["step"] == step and r["prompt_index"] == prompt]
            rewards = torch.tensor([r["reward"] for r in group])
            expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # GRPO's advantage
            got = torch.tensor([r["advantage"] for r in group])
            assert torch.allclose(got, expected.float(), atol=1e-4)


@pytest.mark.timeout(240)
def test_a_user_data_file_row_ppo_advantage_and_logprob_gap(tmp_path):
    data = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"it is one red square . what color is the shape ? ({i})",
              "answer": "red"} for i in range(5)]  # fmt: skip
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rows = _run(tmp_path / "ppo", "text_ppo", "--steps", "2", "--data", str(data),
                "--set", "batch_size=3", "--set", "recompute_logprobs=true")  # fmt: skip
    assert len(rows) == 6 and "image" not in rows[0]
    for r in rows:
        assert r["data_file"] == "prompts.jsonl"
        assert r["prompt"].endswith(f"({r['data_row']})")  # the row it names holds its prompt
        assert r["advantage"] is not None and r["ref_kl"] is not None
        assert 0 <= r["logprob_gap"] < 1e-3  # recomputed logprobs match the sampler's
    assert len({r["data_row"] for r in rows if r["step"] == 0}) == 3


@pytest.mark.timeout(240)
def test_dynamic_sampling_leaves_the_dropped_samples_numbers_empty(tmp_path):
    rows = _run(tmp_path / "ds", "text_grpo", "--steps", "2", "--set", "batch_size=2",
                "--set", "dynamic_sampling=1.0")  # fmt: skip
    assert len(rows) == 2 * 4 * 4  # 4 prompts drawn a step, 4 samples each
    for step in range(2):
        mine = [r for r in rows if r["step"] == step]
        trained = [r for r in mine if r["advantage"] is not None]
        assert len(trained) <= 2 * 4
        for r in trained:  # a kept group's rewards differ
            group = [x for x in mine if x["prompt_index"] == r["prompt_index"]]
            assert all(x["advantage"] is not None for x in group)
            assert len({x["reward"] for x in group}) > 1


@pytest.mark.timeout(240)
def test_a_stale_rollout_records_its_weight_version_and_staleness(tmp_path):
    rows = _run(tmp_path / "async", "text_grpo", "--steps", "4", "--set", "batch_size=2",
                "--max-staleness", "1", "--staleness", "fixed")  # fmt: skip
    by_step = {r["step"]: (r["weight_version"], r["staleness"]) for r in rows}
    # step k reads the weights of step k-2's update: version k-1 (none yet at steps 0 and 1)
    assert by_step == {0: (0, 0), 1: (0, 1), 2: (1, 1), 3: (2, 1)}


@pytest.mark.timeout(240)
def test_controllers_name_the_one_that_ran_the_rollout(tmp_path):
    rows = _run(tmp_path / "zmq", "text_grpo", "--steps", "2", "--set", "batch_size=2",
                "--controllers", "2", "--placement", "partial")  # fmt: skip
    graph = json.loads((tmp_path / "zmq" / "trace.json").read_text())
    rollout = {e["pid"] for e in graph["traceEvents"] if e.get("name") == "rollout"}
    assert len(rollout) == 1 and {r["controller"] for r in rows} == rollout
    assert all(r["advantage"] is not None for r in rows)


def test_sample_stats_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # [B=2, R=3]
    adv = torch.tensor([[2.0, 4.0, 9.0], [-1.0, 9.0, 9.0]])
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -2.5, 7.0], [-0.25, 0.0, 0.0]])
    got = sample_stats(mask, adv, lp, ref, old)
    assert got["advantage"].tolist() == [3.0, -1.0]
    assert got["ref_kl"].tolist() == [(0.5 - 1.0) / 2, 0.0]
    assert got["logprob_gap"].tolist() == [0.25, 0.25]
    assert set(sample_stats(mask, adv)) == {"advantage"}


def test_sample_positions_follow_the_group_labels_and_refuse_strangers():
    sampled = torch.tensor([10, 10, 11, 11, 12, 12])
    assert sample_positions(torch.tensor([11, 11, 12, 12]), sampled).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="group 13"):
        sample_positions(torch.tensor([13, 13]), sampled)
    with pytest.raises(ValueError, match="group 10"):
        sample_positions(torch.tensor([10, 10, 10]), sampled)
    node = SampleStats(name="sample_stats")
    out = node.run({"response_mask": torch.ones(2, 1), "group_ids": torch.tensor([4, 4]),
                    "advantages": torch.ones(2, 1)})["stats"]  # fmt: skip
    assert out["sample"].tolist() == [0, 1]


def _outputs(**changes):
    outputs = {
        "texts": ["a", "b", "c", "d"],
        "prompts": ["p", "q"],
        "scores": torch.tensor([0.0, 1.0, 0.5, 0.0]),
        "response_lengths": torch.tensor([1, 2, 3, 4]),
        "truncated": torch.tensor([0.0, 1.0, 0.0, 0.0]),
        "data_rows": [{"file": "d.jsonl", "row": 7}, {"file": "d.jsonl", "row": 2}],
        "sample_stats": {"sample": torch.tensor([2, 3]), "advantage": torch.tensor([0.5, -0.5])},
        "reward_components": {"format": torch.tensor([1.0, 0.0, 1.0, 1.0])},
    }
    return {**outputs, **changes}


def test_the_writer_lines_columns_up_by_sample(tmp_path):
    import pyarrow.parquet as pq

    writer = SampleWriter(tmp_path, every=1)
    path = writer.write(5, _outputs(), staleness={"rollout.weights": 0}, controllers={"rollout": 1})
    writer.close()  # the files are written on the writer's thread
    t = pq.read_table(path).to_pydict()
    assert t["data_row"] == [7, 7, 2, 2] and t["stop_reason"][:2] == ["stop", "max_new_tokens"]
    assert t["advantage"] == [None, None, 0.5, -0.5] and t["reward/format"] == [1, 0, 1, 1]
    assert t["weight_version"] == [5] * 4 and t["staleness"] == [0] * 4
    assert t["controller"] == [1] * 4


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"scores": torch.zeros(3)}, "'scores' has 3 rows"),
        ({"truncated": torch.zeros(5)}, "'truncated' has 5 rows"),
        ({"data_rows": [{"file": "d", "row": 0}]}, "'data_rows' has 1 rows, and the step has 2 prompts"),
        ({"sample_stats": {"sample": torch.tensor([0, 1]), "advantage": torch.zeros(3)}},
         "'sample_stats.advantage' has 3 rows"),
        ({"sample_stats": {"sample": torch.tensor([3, 4]), "advantage": torch.zeros(2)}},
         "'sample_stats' names samples [3, 4]"),
        ({"texts": ["a", "b", "c"]}, "3 texts for 2 prompts"),
    ],
)  # fmt: skip
def test_a_misaligned_output_is_refused_naming_it(tmp_path, changes, named):
    writer = SampleWriter(tmp_path, every=10)  # the first step is checked though not kept
    with pytest.raises(SampleAlignmentError) as info:
        writer.write(0, _outputs(**changes))
    assert named in str(info.value)
    assert not (tmp_path / "samples").exists()


MISALIGNED_GRAPH = """
import torch
from yatt_graph import ANY, Graph, Tensor, node

@node(outputs={"texts": ANY, "prompts": ANY, "scores": Tensor("float32", "B")})
def sample():
    return {"texts": ["a", "b", "c", "d"], "prompts": ["p", "q"], "scores": torch.zeros(3)}

def build_graph():
    with Graph("misaligned") as g:
        out = sample()
        g.output("texts", out.texts)
        g.output("prompts", out.prompts)
        g.output("scores", out.scores)
    return g
"""


@pytest.mark.timeout(120)
def test_a_run_whose_graph_misaligns_an_output_stops_naming_it(tmp_path):
    graph = tmp_path / "misaligned.py"
    graph.write_text(MISALIGNED_GRAPH)
    cmd = [sys.executable, "-c", CLI, "run", str(graph), "--steps", "3", "--out",
           str(tmp_path / "run"), "--quiet"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert done.returncode != 0
    assert "graph output 'scores' has 3 rows, and the step has 4 responses" in done.stderr


def test_an_image_is_written_once_and_a_resumed_run_rewrites_its_later_steps(tmp_path):
    import pyarrow.parquet as pq
    from PIL import Image

    a, b, c = (Image.new("RGB", (80, 40), color) for color in ("red", "green", "blue"))
    pictures = tmp_path / "samples" / IMAGES
    writer = SampleWriter(tmp_path, every=1)
    writer.write(0, _outputs(images=[a, b]))
    writer.write(1, _outputs(images=[a, c]))
    writer.write(2, _outputs(images=[b, c]))  # nothing new: no thumbnail file
    writer.close()
    assert sorted(p.name for p in pictures.iterdir()) == [
        "step-000000.parquet",
        "step-000001.parquet",
    ]
    first = pq.read_table(pictures / "step-000000.parquet").to_pydict()
    assert len(first["hash"]) == 2 and Image.open(io.BytesIO(first["png"][0])).size == (64, 32)
    assert len(pq.read_table(pictures / "step-000001.parquet")) == 1

    resumed = SampleWriter(tmp_path, every=1)  # from a checkpoint at step 1
    resumed.write(1, _outputs(images=[c, a]))
    resumed.close()
    assert not (tmp_path / "samples" / "step-000002.parquet").exists()
    assert pq.read_table(pictures / "step-000001.parquet").to_pydict()["hash"] == [
        pq.read_table(tmp_path / "samples" / "step-000001.parquet")["image"][0].as_py()
    ]


def test_a_failure_on_the_writers_thread_raises_at_the_next_write(tmp_path):
    (tmp_path / "samples").write_text("a file where the folder should be")
    writer = SampleWriter(tmp_path, every=1)
    assert writer.write(0, _outputs()) is not None  # the caller's part succeeds
    with pytest.raises(FileExistsError):
        writer.write(1, _outputs())
    writer.close()


@pytest.mark.timeout(240)
def test_rollout_replicas_name_the_one_that_sampled_each_prompt(tmp_path):
    rows = _run(tmp_path / "replicas", "text_grpo", "--steps", "2", "--set", "batch_size=4",
                "--controllers", "2", "--replicas", "rollout=2")  # fmt: skip
    by_prompt: dict[tuple[int, int], set[int]] = {}
    for r in rows:
        by_prompt.setdefault((r["step"], r["prompt_index"]), set()).add(r["replica"])
    assert all(len(v) == 1 for v in by_prompt.values())  # a prompt's samples: one replica
    assert set().union(*by_prompt.values()) == {0, 1}  # both sampled some
