"""A local dataset's files, read before its rows are: the format and columns from the schema
alone (a Parquet schema, the first JSON line, the CSV header, a saved folder's
``dataset_info.json``), and checks of the text a loader would misread (a CSV row of the wrong
width, bytes that are not UTF-8). :class:`nodes.datasets.DatasetSource` uses them."""

from __future__ import annotations

import csv
import json
import warnings
from collections.abc import Callable
from pathlib import Path

__all__ = ["dataset_columns"]

_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _saved_folder(path: Path) -> Path:
    """The ``save_to_disk`` folder of one dataset: ``path``, or its ``train`` split."""
    dict_file = path / "dataset_dict.json"
    if dict_file.is_file():
        splits = json.loads(dict_file.read_text()).get("splits", [])
        if "train" not in splits:
            raise ValueError(
                f"{path}: a saved DatasetDict without a 'train' split (its splits: {splits}); "
                f"pass one split's folder, e.g. {path / splits[0]}"
                if splits
                else f"{path}: a saved DatasetDict with no splits"
            )
        return path / "train"
    if not (path / "dataset_info.json").is_file() and not (path / "state.json").is_file():
        raise ValueError(
            f"{path}: a folder that is not a datasets save_to_disk folder (no dataset_info.json, "
            "state.json or dataset_dict.json); pass a .jsonl, .json, .parquet or .csv file, or a "
            "folder written by Dataset.save_to_disk"
        )
    return path


def _json_columns(path: Path) -> list[str]:
    with path.open("rb") as f:
        raw = next((line for line in f if line.strip()), None)
    first = None if raw is None else raw.decode("utf-8", errors="replace")
    if first is None:
        raise ValueError(f"{path}: the file is empty; it needs one JSON object per line")
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        row = None
    if isinstance(row, dict):  # JSON Lines
        return list(row)
    if row is not None and not isinstance(row, list):  # one value, but not an object
        raise ValueError(
            f"{path}:1: a JSON {type(row).__name__}, not an object; write one JSON object per line"
        )
    try:  # one JSON document: a list of row objects
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path} row 1: not JSON ({exc}); write one JSON object per line (JSON Lines)"
        ) from exc
    if isinstance(doc, list) and doc and isinstance(doc[0], dict):
        return list(doc[0])
    raise ValueError(
        f"{path}: expected JSON Lines (one object per line) or a list of objects, "
        f"got a {type(doc).__name__}; write one JSON object per line"
    )


def dataset_columns(path: str | Path) -> tuple[str, Path, list[str]]:
    """``(format, data path, columns)`` of a local dataset, read from its schema alone."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data path {str(path)!r} does not exist; pass an existing file or folder")
    if not path.is_dir() and not path.is_file():
        raise ValueError(
            f"data path {str(path)!r} is not a regular file (a pipe, a device or a socket); "
            "save the data to a file and pass that"
        )
    if path.is_dir():
        folder = _saved_folder(path)
        info_file = folder / "dataset_info.json"
        if not info_file.is_file():
            raise ValueError(f"{folder}: no dataset_info.json; write the folder with save_to_disk")
        features = json.loads(info_file.read_text()).get("features") or {}
        return "disk", folder, list(features)
    fmt = _FILE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(
            f"{path}: unknown data format {path.suffix!r}; use one of "
            f"{sorted(_FILE_FORMATS)} or a save_to_disk folder"
        )
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return fmt, path, list(pq.read_schema(path).names)
        except Exception as exc:
            raise ValueError(f"{path}: cannot read the Parquet schema ({exc})") from exc
    if fmt == "csv":
        with path.open(newline="", encoding="utf-8-sig") as f:  # (-sig: a BOM is no column)
            header = next(csv.reader(f), None)
        if not header:
            raise ValueError(f"{path}: no header row; the first line must name the columns")
        if twice := _twice(header):  # a reader keeps one of them and drops the other's values
            raise ValueError(
                f"{path}: the header names {', '.join(map(repr, twice))} twice; give each "
                "column its own name"
            )
        return fmt, path, header
    return fmt, path, _json_columns(path)


def _utf8_lines(path: Path, on_bad_sample: str, scratch: Callable[[], Path]) -> str:
    """``path``, when every line is UTF-8 text; else with ``on_bad_sample="raise"`` a
    ValueError naming the first bad line, and with ``"skip"`` a copy without the bad lines
    (in ``scratch()``, a folder of this node's), with a warning that counts them."""
    bad: list[int] = []
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                if on_bad_sample == "raise":
                    raise ValueError(
                        f"{path}:{number}: byte {line[exc.start]:#04x} is not UTF-8 text; save "
                        "the file as UTF-8, or pass --on-bad-sample skip to leave such rows out"
                    ) from None
                bad.append(number)
    if not bad:
        return str(path)
    clean = scratch() / path.name
    skip = set(bad)
    with path.open("rb") as src, clean.open("wb") as dst:
        dst.writelines(line for number, line in enumerate(src, 1) if number not in skip)
    warnings.warn(
        f"{path}: left out {len(bad)} line(s) that are not UTF-8 text (first: line {bad[0]})",
        RuntimeWarning,
        stacklevel=2,
    )
    return str(clean)


def _check_csv_rows(path: Path, fields: int) -> None:
    """Refuse a CSV row whose field count is not the header's: a reader would shift its
    columns (an extra field becomes an index, and prompts become answers) or fill them with
    nothing. The error names the line."""
    with path.open(newline="", encoding="utf-8-sig") as f:
        rows = csv.reader(f)
        try:
            next(rows, None)
            for row in rows:
                if row and len(row) != fields:
                    raise ValueError(
                        f"{path}:{rows.line_num}: this row has {len(row)} fields and the header "
                        f'names {fields}; quote a field that holds a comma ("a, b") and give '
                        "every row one value per column"
                    )
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{path}: after line {rows.line_num}, byte {exc.object[exc.start]:#04x} is not "
                "UTF-8; save the file as UTF-8"
            ) from None


def _parquet_rows(path: Path) -> int:
    """The row count a Parquet file's footer states (a reader fails on a file of none)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def _first_bad_json_line(path: Path) -> str | None:
    """Why the first line of a JSON Lines file that is not one JSON object fails, naming the
    line (counted from 1), or None when every line is one."""
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line, object_pairs_hook=_no_duplicate_keys)
                json.dumps(row, ensure_ascii=False).encode("utf-8")
            except json.JSONDecodeError as exc:
                return f"{path}:{number}: not JSON ({exc.msg} at column {exc.colno}); write one JSON object per line"
            except ValueError as exc:  # a key twice, or a lone surrogate (\\ud800)
                return f"{path}:{number}: {exc}"
            if not isinstance(row, dict):
                return f"{path}:{number}: a JSON {type(row).__name__}, not an object; write one JSON object per line"
    return None


def _twice(names: list[str]) -> list[str]:
    """The names that appear more than once, sorted."""
    return sorted({n for n in names if names.count(n) > 1})


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    if twice := _twice([k for k, _ in pairs]):
        raise ValueError(f"the key(s) {', '.join(map(repr, twice))} appear twice in one object")
    return dict(pairs)
