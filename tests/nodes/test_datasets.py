"""DatasetSource (nodes/datasets.py) and write_shapes_dataset (nodes/shapes_files.py)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from nodes.data import answer_reward
from nodes.datasets import DatasetSource
from nodes.shapes_files import main, write_shapes_dataset


def _png(color=(200, 10, 10), size=8) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buffer, format="PNG")
    return buffer.getvalue()


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _text_rows(n: int) -> list[dict]:
    return [{"prompt": f"q{i}", "answer": f"a{i}", "idx": i} for i in range(n)]


def _read_all(source: DatasetSource, calls: int) -> list[dict]:
    return [m for _ in range(calls) for m in source.run()["meta"]]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict[str, Path]:
    return write_shapes_dataset(tmp_path_factory.mktemp("shapes"), rows=12, seed=3)


# --- formats ---------------------------------------------------------------------------------


def test_jsonl_and_parquet_from_write_shapes_dataset_agree(shapes):
    assert sorted(p.name for p in shapes["images"].iterdir())[:2] == ["000000.png", "000001.png"]
    outs = [
        DatasetSource(str(shapes[f]), batch_size=12, shuffle=False).run()
        for f in ("jsonl", "parquet")
    ]
    a, b = outs
    assert a["prompts"] == b["prompts"]
    assert [m["answer"] for m in a["meta"]] == [m["answer"] for m in b["meta"]]
    assert a["meta"] == b["meta"]
    for x, y in zip(a["images"], b["images"]):
        assert x.mode == y.mode == "RGB"
        assert x.tobytes() == y.tobytes()
    assert set(a["meta"][0]) == {"answer", "choices", "color", "shape", "count", "index"}
    assert [m["index"] for m in a["meta"]] == list(range(12))


def test_answer_reward_scores_the_right_answer_with_a_rows_meta(shapes):
    meta = DatasetSource(str(shapes["parquet"]), batch_size=4).run()["meta"]
    for m in meta:
        assert answer_reward(m["answer"], m) == 1.0
        wrong = next(c for c in m["choices"] if c != m["answer"])
        assert answer_reward(wrong, m) == pytest.approx(0.2)


def test_csv_reads_text_columns_and_images_by_path(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(_png())
    with (tmp_path / "d.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["question", "pic", "label", "n"])
        w.writerow(["what ?", "imgs/a.png", "7", "1"])
    out = DatasetSource(
        str(tmp_path / "d.csv"), prompt_key="question", image_key="pic", answer_key="label"
    ).run()
    assert out["prompts"] == ["what ?"]
    assert out["meta"] == [{"answer": "7", "n": "1"}]  # CSV has no types: text
    assert out["images"][0].getpixel((0, 0)) == (200, 10, 10)


def test_save_to_disk_folder_and_dataset_dict(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict(
        {"prompt": ["p0", "p1"], "image": [_png(), _png((0, 0, 255))], "answer": ["x", "y"]}
    ).cast_column("image", datasets.Image())
    ds.save_to_disk(str(tmp_path / "one"))
    out = DatasetSource(str(tmp_path / "one"), batch_size=2, shuffle=False).run()
    assert out["prompts"] == ["p0", "p1"]
    assert out["images"][1].getpixel((0, 0)) == (0, 0, 255)
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    assert DatasetSource(str(tmp_path / "dict"), batch_size=1).run()["prompts"][0] in {"p0", "p1"}
    datasets.DatasetDict({"test": ds, "val": ds}).save_to_disk(str(tmp_path / "nosplit"))
    with pytest.raises(
        ValueError, match=r"without a 'train' split \(its splits: \['test', 'val'\]\)"
    ):
        DatasetSource(str(tmp_path / "nosplit"))


def test_image_cells_of_every_form(tmp_path):
    (tmp_path / "a.png").write_bytes(_png((1, 2, 3)))
    table = pa.table(
        {
            "prompt": ["p0", "p1", "p2"],
            "image": [
                {"bytes": _png((4, 5, 6)), "path": None},
                {"bytes": None, "path": str(tmp_path / "a.png")},
                {"bytes": None, "path": "a.png"},
            ],
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    out = DatasetSource(str(tmp_path / "d.parquet"), batch_size=3, shuffle=False).run()
    assert [im.getpixel((0, 0)) for im in out["images"]] == [(4, 5, 6), (1, 2, 3), (1, 2, 3)]
    assert out["meta"] == [{}, {}, {}]  # no answer column: no answer
    rows = [{"prompt": "p", "image": ["a.png"]}, {"prompt": "q", "image": ["a.png", "a.png"]}]
    source = DatasetSource(str(_jsonl(tmp_path / "l.jsonl", rows)), batch_size=1, shuffle=False)
    assert source.run()["images"][0].getpixel((0, 0)) == (1, 2, 3)
    with pytest.raises(ValueError, match=r"l.jsonl row 2, column 'image': 2 images in one row"):
        source.run()
    rows.append({"prompt": "r", "image": "a.png"})  # a bad row like any other: skippable
    path = str(_jsonl(tmp_path / "s.jsonl", rows))
    skip = DatasetSource(path, batch_size=2, shuffle=False, on_bad_sample="skip").run()
    assert skip["prompts"] == ["p", "r"]


def test_text_only_data_and_images_false(tmp_path):
    path = str(_jsonl(tmp_path / "t.jsonl", _text_rows(3)))
    out = DatasetSource(path, batch_size=2, shuffle=False).run()
    assert out["images"] is None
    assert out["prompts"] == ["q0", "q1"]
    assert out["meta"] == [{"idx": 0, "answer": "a0"}, {"idx": 1, "answer": "a1"}]
    rows = [{"prompt": "p", "image": "missing.png", "answer": "a"}]
    ignored = DatasetSource(str(_jsonl(tmp_path / "i.jsonl", rows)), images=False).run()
    assert ignored["images"] is None and ignored["meta"] == [{"answer": "a"}]


def test_json_list_document(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps(_text_rows(2)))
    assert DatasetSource(str(tmp_path / "d.json"), shuffle=False).run()["prompts"] == ["q0", "q1"]


# --- schema errors at construction --------------------------------------------------------------


def test_schema_errors_at_construction(tmp_path):
    path = str(_jsonl(tmp_path / "t.jsonl", _text_rows(2)))
    with pytest.raises(ValueError, match=r"t.jsonl: no prompt column 'question'.*\['prompt', "):
        DatasetSource(path, prompt_key="question")
    with pytest.raises(ValueError, match=r"--set prompt_key="):
        DatasetSource(path, prompt_key="question")
    with pytest.raises(ValueError, match=r"no image column 'image' \(images are required\)"):
        DatasetSource(path, images=True)
    with pytest.raises(ValueError, match=r"does not exist"):
        DatasetSource(str(tmp_path / "nope.jsonl"))
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ValueError, match=r"unknown data format '.txt'"):
        DatasetSource(str(tmp_path / "d.txt"))
    with pytest.raises(ValueError, match=r"not a datasets save_to_disk folder"):
        DatasetSource(str(tmp_path))
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"the columns found are \['text'\]"):
        DatasetSource(str(tmp_path / "d.parquet"))
    (tmp_path / "d.csv").write_text("text,label\nx,y\n")
    with pytest.raises(ValueError, match=r"\['text', 'label'\]"):
        DatasetSource(str(tmp_path / "d.csv"))
    for bad in ({"batch_size": 0}, {"on_bad_sample": "ignore"}, {"images": "yes"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DatasetSource(path, **bad)


# --- bad rows ---------------------------------------------------------------------------------


def _bad_rows(tmp_path: Path) -> Path:
    (tmp_path / "ok.png").write_bytes(_png())
    (tmp_path / "broken.png").write_bytes(b"not a png")
    rows = [
        {"prompt": "good0", "image": "ok.png", "answer": "a"},
        {"prompt": None, "image": "ok.png", "answer": "a"},
        {"prompt": "", "image": "ok.png", "answer": "a"},
        {"prompt": "p", "image": "imgs/x.png", "answer": "a"},
        {"prompt": "p", "image": "broken.png", "answer": "a"},
        {"prompt": "p", "image": None, "answer": "a"},
        {"prompt": "p", "image": "ok.png", "answer": None},
        {"prompt": "good1", "image": "ok.png", "answer": "b"},
    ]
    return _jsonl(tmp_path / "data.jsonl", rows)


@pytest.mark.parametrize(
    ("row", "pattern"),
    [
        (2, r"column 'prompt': the prompt is empty"),
        (3, r"column 'prompt': the prompt is empty"),
        (4, r"column 'image': cannot read 'imgs/x.png' \(FileNotFoundError"),
        (5, r"column 'image': cannot read 'broken.png' \(UnidentifiedImageError"),
        (6, r"column 'image': no image"),
        (7, r"column 'answer': the answer is missing"),
    ],
)
def test_bad_row_raises_naming_file_row_and_column(tmp_path, row, pattern):
    source = DatasetSource(str(_bad_rows(tmp_path)), batch_size=1, shuffle=False)
    source.setup()
    source.load_state_dict({"epoch": 0, "position": row - 1, "skipped": 0})
    with pytest.raises(ValueError, match=rf"data.jsonl row {row}, {pattern}") as info:
        source.run()
    assert "fix the row or pass --on-bad-sample skip" in str(info.value)
    assert source.state_dict()["position"] == row - 1  # a failed call moves nothing


def test_skip_fills_from_the_next_rows_and_counts(tmp_path):
    source = DatasetSource(
        str(_bad_rows(tmp_path)),
        batch_size=2,
        shuffle=False,
        on_bad_sample="skip",
        emit_stats=True,
    )
    out = source.run()
    assert out["prompts"] == ["good0", "good1"]
    assert out["stats"] == {"epoch": 1, "skipped": 6}
    assert len(out["images"]) == 2
    again = source.run()  # the next epoch: the same rows, skipped again
    assert again["prompts"] == ["good0", "good1"] and again["stats"]["skipped"] == 12


def test_no_good_row_errors_after_one_pass(tmp_path):
    rows = [{"prompt": "", "answer": "a"}] * 3
    source = DatasetSource(
        str(_jsonl(tmp_path / "bad.jsonl", rows)), batch_size=2, on_bad_sample="skip"
    )
    with pytest.raises(ValueError, match=r"bad.jsonl: no usable row among its 3 rows"):
        source.run()


# --- order and state --------------------------------------------------------------------------


def test_small_dataset_gives_each_row_once_per_call(tmp_path):
    source = DatasetSource(str(_jsonl(tmp_path / "t.jsonl", _text_rows(3))), batch_size=10)
    assert sorted(source.run()["prompts"]) == ["q0", "q1", "q2"]


def test_validation_pattern_reads_the_first_rows_each_time(tmp_path):
    source = DatasetSource(
        str(_jsonl(tmp_path / "t.jsonl", _text_rows(5))), batch_size=3, shuffle=False
    )
    source.setup()
    start = source.state_dict()
    for _ in range(3):
        source.load_state_dict(start)
        assert source.forward()["prompts"] == ["q0", "q1", "q2"]


def test_rows_reads_one_pass_in_file_order_and_leaves_the_stream(tmp_path):
    source = DatasetSource(
        str(_jsonl(tmp_path / "t.jsonl", _text_rows(7))), batch_size=2, seed=1, emit_stats=True
    )
    source.run()
    state = source.state_dict()
    assert source.num_rows == 7
    batches = [source.rows(start, 3) for start in range(0, source.num_rows, 3)]
    assert [b["prompts"] for b in batches] == [["q0", "q1", "q2"], ["q3", "q4", "q5"], ["q6"]]
    assert batches[0]["images"] is None and batches[0]["stats"]["skipped"] == 0
    assert source.rows()["prompts"] == [f"q{i}" for i in range(7)]
    assert source.rows(7)["prompts"] == []
    assert source.state_dict() == state
    with pytest.raises(ValueError, match=r"t.jsonl: rows\(start=8\) is outside 0..7"):
        source.rows(8)
    with pytest.raises(ValueError, match=r"rows\(count=-1\) must be an int >= 0"):
        source.rows(0, -1)


def test_rows_raises_or_leaves_bad_rows_out(tmp_path):
    path = str(_bad_rows(tmp_path))
    with pytest.raises(
        ValueError, match=r"data.jsonl row 2, column 'prompt'.*--on-bad-sample skip"
    ):
        DatasetSource(path).rows()
    skip = DatasetSource(path, on_bad_sample="skip", emit_stats=True)
    out = skip.rows()
    assert out["prompts"] == ["good0", "good1"] and len(out["images"]) == 2
    assert out["stats"]["skipped"] == 6 and skip.state_dict()["skipped"] == 0
    assert skip.rows(1, 2) == {
        "images": [],
        "prompts": [],
        "meta": [],
        "stats": {"epoch": 0, "skipped": 2},
    }


def test_reshuffle_differs_between_epochs_but_is_seeded(tmp_path):
    path = str(_jsonl(tmp_path / "t.jsonl", _text_rows(20)))

    def epochs(seed):
        metas = _read_all(DatasetSource(path, batch_size=10, seed=seed), 4)
        return [m["idx"] for m in metas[:20]], [m["idx"] for m in metas[20:]]

    first, second = epochs(0)
    assert sorted(first) == sorted(second) == list(range(20))
    assert first != second
    assert epochs(0) == (first, second)
    assert epochs(1) != (first, second)
    ordered = _read_all(DatasetSource(path, batch_size=10, shuffle=False), 4)
    assert [m["idx"] for m in ordered] == list(range(20)) * 2


def test_exact_resume(tmp_path):
    path = str(_jsonl(tmp_path / "t.jsonl", _text_rows(7)))
    ref = DatasetSource(path, batch_size=3, seed=5)
    expected = _read_all(ref, 6)
    first = DatasetSource(path, batch_size=3, seed=5)
    got = _read_all(first, 2)
    state = first.state_dict()
    assert set(state) == {"epoch", "position", "skipped"}
    resumed = DatasetSource(path, batch_size=3, seed=5)
    resumed.load_state_dict(state)
    assert got + _read_all(resumed, 4) == expected
    with pytest.raises(ValueError, match="state has no 'skipped'"):
        resumed.load_state_dict({"epoch": 0, "position": 0})
    resumed.load_state_dict({"epoch": 0, "position": 7, "skipped": 0})
    with pytest.raises(ValueError, match=r"position 7 is outside its 7 rows"):
        resumed.run()


def test_non_text_prompts_are_bad_rows(tmp_path):
    rows = [{"prompt": "   "}, {"prompt": 3}]
    source = DatasetSource(str(_jsonl(tmp_path / "w.jsonl", rows)), batch_size=1, shuffle=False)
    with pytest.raises(ValueError, match=r"w.jsonl row 1, column 'prompt': the prompt is empty"):
        source.run()


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n=st.integers(1, 9),
    batch_size=st.integers(1, 6),
    seed=st.integers(0, 2**40),
    offset=st.integers(0, 8),
)
def test_no_row_lost_or_duplicated_within_an_epoch(tmp_path, n, batch_size, seed, offset):
    path = str(_jsonl(tmp_path / f"p{n}.jsonl", _text_rows(n)))
    source = DatasetSource(path, batch_size=batch_size, seed=seed)
    source.setup()
    source.load_state_dict({"epoch": 3, "position": 0, "skipped": 0})
    stream: list[int] = []
    while len(stream) < 2 * n:
        stream += [m["idx"] for m in source.run()["meta"]]
    assert sorted(stream[:n]) == sorted(stream[n : 2 * n]) == list(range(n))
    position = offset % n  # resuming mid-epoch continues the same stream
    resumed = DatasetSource(path, batch_size=batch_size, seed=seed)
    resumed.load_state_dict({"epoch": 3, "position": position, "skipped": 0})
    again: list[int] = []
    while len(again) < n:
        again += [m["idx"] for m in resumed.run()["meta"]]
    assert again[:n] == stream[position : position + n]


# --- the shapes files command -------------------------------------------------------------------


def test_shapes_files_command(tmp_path, capsys):
    paths = main([str(tmp_path / "out"), "--rows", "3", "--task", "shape", "--text-hint"])
    assert "jsonl:" in capsys.readouterr().out
    rows = [json.loads(line) for line in paths["jsonl"].read_text().splitlines()]
    assert len(rows) == 3 and rows[0]["prompt"].startswith("it is ")
    assert rows[0]["answer"] == rows[0]["shape"]
    assert (tmp_path / "out" / rows[0]["image"]).is_file()
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x"), "--rows", "0"])


def test_a_csv_row_with_a_field_more_or_less_than_the_header_is_refused_naming_its_line(tmp_path):
    """pandas would make an extra first field the index and shift every column (prompts
    becoming answers) with no warning."""
    path = tmp_path / "d.csv"
    path.write_text("question,answer\nwhat colour?,red\nname it, please?,blue,extra\n")
    with pytest.raises(ValueError, match=r"d\.csv:3: this row has 4 fields and the header names 2"):
        DatasetSource(str(path), prompt_key="question").setup()
    path.write_text("question,answer\nonly a question\n")
    with pytest.raises(ValueError, match=r"d\.csv:2: this row has 1 fields"):
        DatasetSource(str(path), prompt_key="question").setup()


def test_a_csv_with_a_byte_order_mark_reads_its_first_column(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes("\ufeffquestion,answer\nwhat colour?,red\n".encode())
    source = DatasetSource(str(path), prompt_key="question", batch_size=1)
    assert source.run()["prompts"] == ["what colour?"]


def test_a_line_that_is_not_utf8_is_named_or_left_out_with_skip(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "b\xff"}\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: byte 0xff is not UTF-8 text"):
        DatasetSource(str(path), shuffle=False).setup()
    source = DatasetSource(str(path), shuffle=False, on_bad_sample="skip", batch_size=2)
    with pytest.warns(RuntimeWarning, match="left out 1 line"):
        source.setup()
    assert source.run()["prompts"] == ["a", "c"]


def test_a_pipe_and_one_column_for_prompt_and_image_are_refused(tmp_path):
    import os

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is not a regular file"):
        DatasetSource(str(fifo))  # (reading it would wait for a writer forever)
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n')
    with pytest.raises(ValueError, match="prompt_key and image_key both name column 'prompt'"):
        DatasetSource(str(path), image_key="prompt")


def test_files_a_reader_would_misread_are_named_with_the_line(tmp_path, capfd):
    """Lines that are not one JSON object, a key twice, a column named twice, a mistyped
    column option and a Parquet file with no rows: each one line naming file and line, and
    nothing else printed (the ``datasets`` reader's own log of the failure is held back)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cases = {
        "cut.jsonl": ('{"prompt": "a"}\n{"prompt": \n', r"cut\.jsonl:2: not JSON"),
        "twice.jsonl": (
            '{"prompt": "a", "prompt": "b"}\n',
            r"twice\.jsonl:1: the key\(s\) 'prompt'",
        ),
        "list.jsonl": ('{"prompt": "a"}\n[1, 2]\n', r"list\.jsonl:2: a JSON list, not an object"),
        "str.jsonl": ('"just text"\n{"prompt": "a"}\n', r"str\.jsonl:1: a JSON str, not an object"),
        "dup.csv": ("prompt,answer,answer\nq,red,blue\n", r"the header names 'answer' twice"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=message):
            DatasetSource(str(tmp_path / name)).setup()
    assert "Failed to load" not in capfd.readouterr().err
    good = _jsonl(tmp_path / "good.jsonl", _text_rows(2))
    for option in ("answer_key", "image_key"):
        with pytest.raises(ValueError, match=rf"no column 'colr' \({option}\).*--set {option}="):
            DatasetSource(str(good), **{option: "colr"})
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "none.parquet")
    with pytest.raises(ValueError, match=r"none\.parquet: the dataset has no rows"):
        DatasetSource(str(tmp_path / "none.parquet")).setup()


def test_a_prompt_of_chat_messages_is_read_as_messages(tmp_path):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    rows = [{"prompt": chat, "answer": "4"}, {"prompt": [{"text": "no role"}], "answer": "x"}]
    source = DatasetSource(
        str(_jsonl(tmp_path / "c.jsonl", rows)), shuffle=False, on_bad_sample="skip"
    )
    out = source.run()
    assert out["prompts"] == [chat] * len(out["prompts"])  # the bad row was skipped
    with pytest.raises(
        Exception, match=r"row 2, column 'prompt': a prompt is text or a list of chat"
    ):
        DatasetSource(str(_jsonl(tmp_path / "d.jsonl", rows)), shuffle=False, batch_size=2).run()


def test_validation_decodes_with_the_stop_strings(tmp_path):
    """Greedy validation ends a response at a stop string, as the rollout does: with every
    printable character a stop string, each response is its first token."""
    import string

    from nodes.validation import GreedyValidation

    data = str(_jsonl(tmp_path / "v.jsonl", [{"prompt": p, "answer": "x"} for p in ("red", "a")]))
    (tmp_path / "lengths.py").write_text("def score(text, meta):\n    return float(len(text))\n")
    kwargs = {"every": 1, "rows": 2, "max_new_tokens": 12}
    reward = f"{tmp_path / 'lengths.py'}:score"
    free = GreedyValidation("tiny-gpt2", data, reward, **kwargs).run()["val"]
    stopped = GreedyValidation(
        "tiny-gpt2", data, reward, stop=list(string.printable), **kwargs
    ).run()["val"]
    assert free["response_length"] > 2, free
    assert stopped["response_length"] == 1, stopped
