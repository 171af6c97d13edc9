"""The sample browser of ``yatt-graph report``: the rows of a run's ``samples/*.parquet``
(the newest steps' first, at most :data:`MAX_SAMPLE_ROWS`) as JSON values, and the thumbnails
their ``image`` column names, from ``samples/_images/``, once each as data URLs. A file a
crash cut short is left out with a note."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from runtime.train.metrics import json_number
from runtime.train.samples import IMAGES

__all__ = ["MAX_SAMPLE_ROWS", "sample_browser"]

MAX_SAMPLE_ROWS = 20_000
"""The most samples a page holds (the newest steps' first); the page says when it holds fewer."""


def _cell(value: Any) -> Any:
    if isinstance(value, bytes):  # an image: shown as a thumbnail
        kind = "png" if value[:4] == b"\x89PNG" else "jpeg"
        return f"data:image/{kind};base64," + base64.b64encode(value).decode()
    if isinstance(value, float):
        return json_number(value)
    if value is None or isinstance(value, bool | int | str):
        return value
    return str(value)


def sample_browser(run: Path, notes: list[str]) -> dict[str, Any]:
    """The samples the page browses: their columns, rows, files read and thumbnails."""
    folder = run / "samples"
    files = sorted(folder.glob("step-*.parquet")) if folder.is_dir() else []
    if not files:
        notes.append(
            "no samples/: the run kept none (`yatt-graph run --samples-every N` keeps every "
            "Nth step's samples; the graph must output texts, prompts and scores)"
        )
        return {"columns": [], "rows": [], "files": 0}
    import pyarrow.parquet as pq

    columns: list[str] = []
    rows: list[list[Any]] = []
    for path in reversed(files):  # newest first, so a cap keeps the latest steps
        try:
            table = pq.read_table(path)
        except Exception as exc:  # a file a crash cut short: the others still count
            notes.append(f"samples/{path.name} could not be read ({type(exc).__name__}); left out")
            continue
        for name in table.column_names:
            if name not in columns:
                columns.append(name)
        data = table.to_pydict()
        n = table.num_rows
        if len(rows) + n > MAX_SAMPLE_ROWS:
            notes.append(
                f"the page holds the {len(rows)} samples of the newest steps, of more in samples/ "
                f"(at most {MAX_SAMPLE_ROWS}); read them all with pandas.read_parquet"
            )
            break
        rows.extend([_cell(data.get(c, [None] * n)[i]) for c in columns] for i in range(n))
    width = len(columns)
    rows = [r + [None] * (width - len(r)) for r in rows]
    images = _thumbnails(folder, columns, rows, notes)
    order = columns.index("step") if "step" in columns else None
    if order is not None:
        sample = columns.index("sample") if "sample" in columns else order
        rows.sort(key=lambda r: (r[order] if r[order] is not None else -1, r[sample] or 0))
    return {"columns": columns, "rows": rows, "files": len(files), "images": images}


def _thumbnails(
    folder: Path, columns: list[str], rows: list[list[Any]], notes: list[str]
) -> dict[str, str]:
    """The thumbnails the rows' ``image`` column names (a hash; the PNGs are in
    ``samples/_images/step-*.parquet``), each once, as data URLs."""
    if "image" not in columns:
        return {}
    import pyarrow.parquet as pq

    at = columns.index("image")
    wanted = {r[at] for r in rows if isinstance(r[at], str) and not r[at].startswith("data:")}
    images: dict[str, str] = {}
    for path in sorted((folder / IMAGES).glob("step-*.parquet")):
        try:
            table = pq.read_table(path).to_pydict()
        except Exception as exc:  # cut short by a crash: its rows show no thumbnail
            notes.append(f"samples/{IMAGES}/{path.name} could not be read ({type(exc).__name__})")
            continue
        for key, png in zip(table.get("hash", []), table.get("png", [])):
            if key in wanted and isinstance(png, bytes):
                images[key] = "data:image/png;base64," + base64.b64encode(png).decode()
    missing = len(wanted - set(images))
    if missing:
        notes.append(f"{missing} thumbnails named by samples/ are not in samples/{IMAGES}/")
    return images
