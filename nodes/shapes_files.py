"""The shapes task written as files: a dataset :class:`nodes.datasets.DatasetSource` reads.

``write_shapes_dataset(out_dir)`` draws ``rows`` samples with :func:`nodes.data.make_sample`
and writes ``images/000000.png ...``, ``train.jsonl`` (``image`` is the PNG's path relative to
the file) and ``train.parquet`` (``image`` is the PNG's bytes). Both hold the columns
``prompt``, ``image``, ``answer`` and the other meta fields (choices, color, shape, count,
index), row for row the same. From the shell::

    python -m nodes.shapes_files OUT_DIR --rows 64 --task color [--seed 0] [--text-hint]
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

from nodes.data import TASKS, make_sample

__all__ = ["main", "write_shapes_dataset"]


def write_shapes_dataset(
    out_dir: str | Path,
    rows: int = 64,
    task: str = "color",
    seed: int = 0,
    text_hint: bool = False,
) -> dict[str, Path]:
    """Write ``rows`` shapes samples under ``out_dir``; return ``{"images", "jsonl", "parquet"}``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"write_shapes_dataset: rows must be an int >= 1, got {rows!r}")
    if task not in TASKS:
        raise ValueError(f"write_shapes_dataset: task {task!r} is not one of {sorted(TASKS)}")
    out = Path(out_dir)
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    json_rows, parquet_rows = [], []
    for index in range(rows):
        image, prompt, meta = make_sample(seed, index, task, text_hint=text_hint)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        png = buffer.getvalue()
        relative = f"images/{index:06d}.png"
        (out / relative).write_bytes(png)
        fields = {"answer": meta["answer"]}
        fields.update((k, v) for k, v in meta.items() if k != "answer")
        json_rows.append({"prompt": prompt, "image": relative, **fields})
        parquet_rows.append({"prompt": prompt, "image": png, **fields})
    jsonl = out / "train.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in json_rows), encoding="utf-8")
    parquet = out / "train.parquet"
    pq.write_table(pa.Table.from_pylist(parquet_rows), parquet)
    return {"images": images, "jsonl": jsonl, "parquet": parquet}


def main(argv: list[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(
        prog="python -m nodes.shapes_files", description="Write the shapes task as files."
    )
    parser.add_argument("out_dir", help="the folder to write (created if missing)")
    parser.add_argument("--rows", type=int, default=64, help="how many samples (default 64)")
    parser.add_argument("--task", default="color", choices=sorted(TASKS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text-hint", action="store_true", help="describe the image in words")
    args = parser.parse_args(argv)
    try:
        paths = write_shapes_dataset(args.out_dir, args.rows, args.task, args.seed, args.text_hint)
    except ValueError as exc:
        parser.error(str(exc))
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return paths


if __name__ == "__main__":
    main()
