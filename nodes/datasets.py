"""A data node that reads a local dataset: JSONL/JSON, Parquet, CSV or a ``save_to_disk`` folder.

Each call gives ``batch_size`` rows as the shapes source does (:class:`nodes.data.ShapesSource`):
``prompts`` (list[str]), ``images`` (one PIL RGB image per prompt, or None for text-only data)
and ``meta`` (one dict per row: ``"answer"`` from the answer column, plus every other column but
the prompt and the image). Rows come in a seeded permutation per epoch, epoch after epoch; the
state (epoch, position, skipped) resumes the stream exactly.

The constructor is cheap: it checks the path, the format and the columns from the schema alone
(a Parquet schema, the first JSONL line, the CSV header, a saved folder's ``dataset_info.json``).
``build()`` loads the rows with the ``datasets`` library, imported there.

Rows are numbered from 1 in messages (``data.jsonl row 17``): the 17th data row of the file.
"""

from __future__ import annotations

import io
import logging
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nodes.chat import chat_messages
from nodes.dataset_files import (
    _check_csv_rows,
    _first_bad_json_line,
    _parquet_rows,
    _utf8_lines,
    dataset_columns,
)
from yatt_graph import ANY, Node, UsageError
from yatt_graph.node import Port

__all__ = ["DatasetSource", "dataset_columns"]

_BAD = ("raise", "skip")


def _open_image(cell: Any, base: Path) -> Any:
    """A PIL RGB image from one image cell (path, bytes, {"bytes", "path"} or PIL image)."""
    from PIL import Image

    if isinstance(cell, Image.Image):
        return cell.convert("RGB")
    if isinstance(cell, Mapping):
        cell = cell.get("bytes") or cell.get("path")
        if cell is None:
            raise ValueError("the image has neither bytes nor a path")
    if isinstance(cell, (bytes, bytearray, memoryview)):
        image = Image.open(io.BytesIO(bytes(cell)))
    elif isinstance(cell, (str, Path)):
        file = Path(cell)
        image = Image.open(file if file.is_absolute() else base / file)
    else:
        raise TypeError(f"expected a path, bytes or an image, got {type(cell).__name__}")
    image.load()
    return image.convert("RGB")


def _quietly(load: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``load(*args, **kwargs)`` with the ``datasets`` loggers' errors held back: a file its
    reader refuses is logged there ("Failed to load JSON ...") before it raises, and the
    caller says it once, naming the line (the level is back after)."""
    from datasets.utils import logging as ds_logging

    level = ds_logging.get_verbosity()
    ds_logging.set_verbosity(logging.CRITICAL)
    try:
        return load(*args, **kwargs)
    finally:
        ds_logging.set_verbosity(level)


def _root(exc: BaseException) -> str:
    """The innermost cause of ``exc``, as ``Type: message`` (a reader's own reason)."""
    seen: list[BaseException] = []
    while exc not in seen and (exc.__cause__ or exc.__context__) is not None:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return f"{type(exc).__name__}: {exc}"


class DatasetSource(Node):
    """Per call, ``batch_size`` rows of a local dataset, shuffled per epoch with the seed.

    Args:
        path: a ``.jsonl``/``.json``, ``.parquet`` or ``.csv`` file, or a ``save_to_disk``
            folder (a saved DatasetDict gives its ``train`` split).
        batch_size: rows per call; never more than the dataset holds (a smaller dataset gives
            all its rows each call, once each; with skipped rows, a call reads each row at
            most once, so data with fewer good rows than ``batch_size`` gives shorter batches).
        seed: the per-epoch permutation is a function of ``(seed, epoch)``.
        prompt_key, image_key, answer_key: the columns of the prompt, image and answer.
        shuffle: False keeps file order.
        images: ``"auto"`` (read the image column when there is one), True (it must exist)
            or False (ignore it; ``images`` is None).
        on_bad_sample: ``"raise"`` a ValueError naming file, row and column, or ``"skip"`` the
            row (filled from the next rows, counted in ``skipped``).
        emit_stats: add the ``stats`` output, ``{"epoch": int, "skipped": int}``.
        emit_rows: add the ``rows`` output, one ``{"file": name, "row": index}`` per prompt
            (the file's name and the row's 0-based index in it): where each sample came from,
            for the run's samples (:mod:`runtime.train.samples`).

    State (``state_dict``): ``{"epoch", "position", "skipped"}``; loading it resumes the
    stream exactly. :meth:`rows` reads a range in file order without moving it (validation).
    """

    kind = "data"
    outputs = {"images": ANY, "prompts": ANY, "meta": ANY}  # noqa: RUF012

    def __init__(
        self,
        path: str,
        batch_size: int = 8,
        seed: int = 0,
        prompt_key: str = "prompt",
        image_key: str = "image",
        answer_key: str = "answer",
        shuffle: bool = True,
        images: bool | str = "auto",
        on_bad_sample: str = "raise",
        emit_stats: bool = False,
        emit_rows: bool = False,
        name: str | None = None,
    ):
        super().__init__(name=name)
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(
                f"node {self.name!r}: batch_size must be an int >= 1, got {batch_size!r}"
            )
        if on_bad_sample not in _BAD:
            raise ValueError(
                f"node {self.name!r}: on_bad_sample must be one of {_BAD}, got {on_bad_sample!r}"
            )
        if not (images is True or images is False or images == "auto"):
            raise ValueError(
                f"node {self.name!r}: images must be 'auto', True or False, got {images!r}"
            )
        self.path = str(path)
        self.format, self.data_path, self.columns = dataset_columns(path)
        self.file_label = Path(path).name
        self.base = self.data_path if self.format == "disk" else self.data_path.parent
        found = f"the columns found are {self.columns}"
        if prompt_key == image_key:
            raise ValueError(
                f"{self.file_label}: prompt_key and image_key both name column {prompt_key!r}; "
                "a column is the prompt or the image: pass --set image_key=<the image column>"
            )
        if prompt_key not in self.columns:
            raise ValueError(
                f"{self.file_label}: no prompt column {prompt_key!r}; {found}; "
                f"pass --set prompt_key=<column>"
            )
        for option, value, default in (
            ("answer_key", answer_key, "answer"),
            ("image_key", image_key, "image"),
        ):
            if value != default and value not in self.columns:  # a named column, mistyped
                raise ValueError(
                    f"{self.file_label}: no column {value!r} ({option}); {found}; "
                    f"pass --set {option}=<column>"
                )
        if images is True and image_key not in self.columns:
            raise ValueError(
                f"{self.file_label}: no image column {image_key!r} (images are required); {found}; "
                f"pass --set image_key=<column>, or use text-only data"
            )
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.prompt_key, self.image_key, self.answer_key = prompt_key, image_key, answer_key
        self.use_images = images is not False and image_key in self.columns
        self.on_bad_sample, self.emit_stats = on_bad_sample, emit_stats
        if emit_stats:
            self.outputs["stats"] = Port(ANY, doc="{'epoch': int, 'skipped': int}")
        self.emit_rows = emit_rows
        if emit_rows:
            self.outputs["rows"] = Port(ANY, doc="[{'file': str, 'row': int}], one per prompt")
        self.epoch = self.position = self.skipped = 0
        self._perm: list[int] | None = None
        self._perm_epoch = -1

    def _scratch(self) -> Path:
        """A folder of this node's for cleaned copies of its data, removed with the node."""
        if self.__dict__.get("_tmp") is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="yatt-data-")
        return Path(self._tmp.name)

    def build(self) -> None:
        import datasets

        datasets.disable_progress_bars()  # the run's own progress bar is the one to read
        path = str(self.data_path)
        if self.format == "disk":
            ds = datasets.load_from_disk(path)
        else:
            extra: dict[str, Any] = {}
            if self.format == "csv":  # CSV has no types: every column is text
                _check_csv_rows(self.data_path, len(self.columns))
                extra["features"] = datasets.Features(
                    {c: datasets.Value("string") for c in self.columns}
                )
            elif self.format == "json":
                path = _utf8_lines(self.data_path, self.on_bad_sample, self._scratch)
            elif _parquet_rows(self.data_path) == 0:
                raise ValueError(f"{self.file_label}: the dataset has no rows")
            try:
                ds = _quietly(
                    datasets.load_dataset, self.format, data_files=path, split="train", **extra
                )
            except Exception as exc:  # say which line, as a reader of the file would count
                if self.format == "json" and (why := _first_bad_json_line(Path(path))):
                    raise ValueError(why) from exc
                if "corresponds to no data" in str(exc):  # a header (or nothing) and no rows
                    raise ValueError(f"{self.file_label}: the dataset has no rows") from exc
                raise ValueError(
                    f"{self.file_label}: the {self.format} reader refused it: {_root(exc)}"
                ) from exc
        if self.use_images:  # decode images here, row by row, so a bad one names its row
            feature = ds.features.get(self.image_key)
            inner = getattr(feature, "feature", None)
            if isinstance(feature, datasets.Image):
                ds = ds.cast_column(self.image_key, datasets.Image(decode=False))
            elif isinstance(inner, datasets.Image):
                ds = ds.cast_column(self.image_key, datasets.List(datasets.Image(decode=False)))
        if len(ds) == 0:
            raise ValueError(f"{self.file_label}: the dataset has no rows")
        if self.prompt_key not in ds.column_names:
            raise ValueError(
                f"{self.file_label}: no prompt column {self.prompt_key!r}; the columns found are "
                f"{ds.column_names}; pass --set prompt_key=<column>"
            )
        self.dataset = ds
        self.answer_in_data = self.answer_key in ds.column_names

    # --- order ---------------------------------------------------------------------
    def _order(self) -> list[int]:
        if self._perm_epoch != self.epoch or self._perm is None:
            n = len(self.dataset)
            if self.shuffle:
                import numpy as np

                rng = np.random.default_rng([int(self.seed) & 0xFFFFFFFF, self.epoch])
                self._perm = rng.permutation(n).tolist()
            else:
                self._perm = list(range(n))
            self._perm_epoch = self.epoch
        return self._perm

    def _next_index(self) -> int:
        index = self._order()[self.position]
        self.position += 1
        if self.position >= len(self.dataset):
            self.epoch, self.position = self.epoch + 1, 0
        return index

    # --- rows ----------------------------------------------------------------------
    def _where(self, index: int, column: str) -> str:
        return f"{self.file_label} row {index + 1}, column {column!r}"

    def _read(self, index: int) -> tuple[tuple[Any, str, dict[str, Any]] | None, str]:
        """``(sample, "")`` for a good row, ``(None, why)`` for a bad one."""
        row = self.dataset[index]
        prompt = row.get(self.prompt_key)
        if isinstance(prompt, list | tuple) and prompt:  # chat messages, as TRL's datasets hold
            try:
                prompt = chat_messages(prompt)
            except ValueError as exc:
                return None, f"{self._where(index, self.prompt_key)}: {exc}"
        elif not isinstance(prompt, str) or not prompt.strip():
            empty = prompt is None or isinstance(prompt, str | list | tuple)
            what = "is empty" if empty else f"is not text: {prompt!r}"
            return None, f"{self._where(index, self.prompt_key)}: the prompt {what}"
        image = None
        if self.use_images:
            cell = row.get(self.image_key)
            if isinstance(cell, (list, tuple)):
                if len(cell) > 1:
                    return None, (
                        f"{self._where(index, self.image_key)}: {len(cell)} images in one row "
                        "(one image per prompt is read: keep one, or split the row)"
                    )
                cell = cell[0] if cell else None
            if cell is None:
                return None, f"{self._where(index, self.image_key)}: no image"
            try:
                image = _open_image(cell, self.base)
            except Exception as exc:
                shown = cell if isinstance(cell, str) else f"<{type(cell).__name__}>"
                if isinstance(cell, Mapping) and isinstance(cell.get("path"), str):
                    shown = cell["path"] if not cell.get("bytes") else "<image bytes>"
                return None, (
                    f"{self._where(index, self.image_key)}: cannot read {shown!r} "
                    f"({type(exc).__name__}: {exc})"
                )
        meta = {
            k: v
            for k, v in row.items()
            if k not in (self.prompt_key, self.image_key, self.answer_key)
        }
        if self.answer_in_data:
            answer = row.get(self.answer_key)
            if answer is None:
                return None, f"{self._where(index, self.answer_key)}: the answer is missing"
            meta["answer"] = answer
        return (image, prompt, meta), ""

    def forward(self) -> dict[str, Any]:
        self.setup()
        n = len(self.dataset)
        want = min(self.batch_size, n)
        if not 0 <= self.position < n:
            raise UsageError(
                f"{self.file_label}: the state's position {self.position} is outside its {n} rows "
                "(the data changed since the checkpoint?); resume with the same data"
            )
        start = self.state_dict()
        samples: list[tuple[Any, str, dict[str, Any]]] = []
        indices: list[int] = []
        bad: set[int] = set()
        first_problem = ""
        consumed = 0
        try:
            while len(samples) < want:
                if consumed >= n and samples:  # one call reads each row at most once
                    break
                index = self._next_index()
                consumed += 1
                sample, why = self._read(index)
                if sample is not None:
                    samples.append(sample)
                    indices.append(index)
                    continue
                if self.on_bad_sample == "raise":
                    raise UsageError(f"{why}; fix the row or pass --on-bad-sample skip")
                self.skipped += 1
                first_problem = first_problem or why
                bad.add(index)
                if len(bad) >= n:
                    raise UsageError(
                        f"{self.file_label}: no usable row among its {n} rows (every one is bad; "
                        f"the first: {first_problem}); fix the data"
                    )
        except BaseException:
            self.load_state_dict(start)  # a failed call leaves the stream where it was
            raise
        return self._outputs(samples, self.skipped, indices)

    def _outputs(
        self, samples: list[tuple[Any, str, dict[str, Any]]], skipped: int, indices: list[int]
    ) -> dict:
        out: dict[str, Any] = {
            "images": [s[0] for s in samples] if self.use_images else None,
            "prompts": [s[1] for s in samples],
            "meta": [s[2] for s in samples],
        }
        if self.emit_stats:
            out["stats"] = {"epoch": self.epoch, "skipped": skipped}
        if self.emit_rows:
            out["rows"] = [{"file": self.file_label, "row": i} for i in indices]
        return out

    # --- one pass in file order (validation) --------------------------------------------
    @property
    def num_rows(self) -> int:
        """How many rows the dataset holds (good or bad); loads it on first use."""
        self.setup()
        return len(self.dataset)

    def rows(self, start: int = 0, count: int | None = None) -> dict[str, Any]:
        """File rows ``start .. start + count - 1`` (to the end when ``count`` is None), as
        :meth:`forward`'s outputs, in file order whatever ``shuffle`` says.

        For a validation pass that reads every row once::

            for start in range(0, source.num_rows, k):
                batch = source.rows(start, k)

        It never moves the stream (epoch, position and ``skipped`` stay as they are), so a
        training source and a validation pass do not disturb each other. Bad rows raise as in
        :meth:`forward`, or with ``on_bad_sample="skip"`` are left out: the batch is then
        shorter (possibly empty), and ``stats["skipped"]`` counts the rows left out of it.
        """
        n = self.num_rows
        if not isinstance(start, int) or not 0 <= start <= n:
            raise ValueError(f"{self.file_label}: rows(start={start!r}) is outside 0..{n}")
        if count is not None and (not isinstance(count, int) or count < 0):
            raise ValueError(f"{self.file_label}: rows(count={count!r}) must be an int >= 0")
        stop = n if count is None else min(n, start + count)
        samples: list[tuple[Any, str, dict[str, Any]]] = []
        indices: list[int] = []
        skipped = 0
        for index in range(start, stop):
            sample, why = self._read(index)
            if sample is not None:
                samples.append(sample)
                indices.append(index)
            elif self.on_bad_sample == "raise":
                raise UsageError(f"{why}; fix the row or pass --on-bad-sample skip")
            else:
                skipped += 1
        return self._outputs(samples, skipped, indices)

    # --- state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "skipped": self.skipped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key in ("epoch", "position", "skipped"):
            if key not in state:
                raise ValueError(
                    f"node {self.name!r}: state has no {key!r} (keys: {sorted(state)}); "
                    "pass a DatasetSource.state_dict()"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.skipped = int(state["skipped"])
