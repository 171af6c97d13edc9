"""The samples of a run, kept for people to read after it: every N steps, each response of the
step with where it came from and what became of it, as one Parquet file in ``OUT/samples/``.

A sample is identified by ``(step, sample)``: its row among the responses sampled that step.
The responses of a prompt are consecutive, so ``prompt_index = sample // n`` is the prompt's
row among the step's prompts, which the data node labelled with its file and row. Every
graph output below is read by name; each must hold one entry per response (per prompt for
the per-prompt ones), else :class:`SampleAlignmentError` names it: a column is never
silently shifted onto other samples.

Per response: ``texts`` (one a response), ``scores`` (its reward), ``response_lengths``,
``truncated`` (1.0: cut at ``max_new_tokens``; the ``stop_reason`` column), and
``reward_components`` (a dict of name -> one number a response: a ``reward/<name>`` column
each) and, from a multi-turn rollout, ``trajectories`` (one record a response: its ``turns``,
and the names of the ``tool_calls`` it made and its ``tool_errors``, each a column; its
``prompt``, the first observation its environment's ``reset`` showed the policy, is the
``prompt`` column in place of the data row's, and its ``env_error``, why a failure of its
environment ended it, a column). Per prompt: ``prompts``, ``data_rows`` (``{"file", "row"}``: the ``data_file`` and
``data_row`` columns) and ``images`` (PIL images: a PNG thumbnail of each, its hash in the
``image`` column; see below). ``sample_stats``
(:class:`nodes.sample_stats.SampleStats`: ``sample``, the row of each trained response, and
its ``advantage``, ``ref_kl``, ``logprob_gap``) fills those columns for the rows it names
(null for responses dynamic sampling dropped). From the step's result: ``weight_version``
(the updates in the weights the rollout sampled with: ``step - age`` of its ``weights``
input, 0 before the first update reached it), ``staleness`` (versions behind the newest,
``step - weight_version``), ``controller`` (the one that ran the rollout) and, where rollout
replicas run (``--replicas rollout=R``), ``replica`` (the one that sampled the prompt: 0 the
node itself, i replica process i).

A graph that does not output ``texts``, ``prompts`` and ``scores`` keeps no samples; each
other column is left out where its output is absent. The folder stops growing at
:data:`MAX_BYTES`.

Thumbnails are written once per distinct image: each kept step's new ones (not written by an
earlier step) go to ``samples/_images/step-NNNNNN.parquet`` (columns ``hash`` and ``png``), one
file a step rather than one a picture, since a file costs a filesystem block and about 0.2 ms
to create, many times a 32-pixel PNG's 120 bytes and encoding. The leading ``_`` keeps
``pandas.read_parquet("OUT/samples")`` reading the samples as one table;
``pandas.read_parquet("OUT/samples/_images")`` gives the thumbnails. A resumed run drops the
files of the steps it runs again.
"""

from __future__ import annotations

import hashlib
import io
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "IMAGES",
    "MAX_BYTES",
    "ROLLOUT",
    "THUMBNAIL_PX",
    "SampleAlignmentError",
    "SampleWriter",
    "image_hash",
    "lineage_columns",
    "sample_rows",
]

MAX_BYTES = 64 * 2**20
"""The most the samples folder holds; later steps are not written (the run says so once)."""

IMAGES = "_images"
"""The thumbnails' folder in ``OUT/samples/``."""

THUMBNAIL_PX = 64
"""The longest side of an image's thumbnail."""

ROLLOUT = "rollout"
"""The node whose weights input, controller and responses the lineage columns describe."""


class SampleAlignmentError(ValueError):
    """A per-sample graph output whose row count does not match the step's responses."""


def _rows(name: str, value: Any, want: int, per: str) -> list[Any]:
    """``value`` as a list of ``want`` entries, else a SampleAlignmentError naming it."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, Mapping) or not hasattr(value, "__len__"):
        raise SampleAlignmentError(
            f"samples: graph output '{name}' is a {type(value).__name__}; it must hold one "
            f"entry per {per}"
        )
    value = list(value)
    if len(value) != want:
        raise SampleAlignmentError(
            f"samples: graph output '{name}' has {len(value)} rows, and the step has {want} "
            f"{per}s; each must hold one entry per {per}, in the rollout's order (fix the "
            f"graph output '{name}', or leave it out)"
        )
    return value


def prompt_text(prompt: Any) -> str:
    """A prompt as people read it: text as it is; chat messages (a list of ``{"role",
    "content"}``) one ``role: content`` line each."""
    if isinstance(prompt, list | tuple) and all(
        isinstance(m, Mapping) and "role" in m for m in prompt
    ):
        return "\n".join(f"{m['role']}: {m.get('content', '')}" for m in prompt)
    return str(prompt)


def sample_rows(step: int, outputs: dict[str, Any]) -> dict[str, list[Any]] | None:
    """A step's samples as columns (text, reward, length, stop reason), or None where the graph
    does not output them; a misaligned output is a :class:`SampleAlignmentError`."""
    texts, prompts, scores = (outputs.get(k) for k in ("texts", "prompts", "scores"))
    if texts is None or prompts is None or scores is None or not len(prompts):
        return None
    B, N = len(texts), len(prompts)
    if B % N:
        raise SampleAlignmentError(
            f"samples: {B} texts for {N} prompts; graph output 'texts' must hold the same "
            "number of responses for each prompt, those of a prompt consecutive"
        )
    n = B // N
    cols: dict[str, list[Any]] = {
        "step": [step] * B,
        "sample": list(range(B)),
        "prompt_index": [i // n for i in range(B)],
        "prompt": [prompt_text(prompts[i // n]) for i in range(B)],
        "response": [str(t) for t in texts],
        "reward": [float(x) for x in _rows("scores", scores, B, "response")],
    }
    trajectories = outputs.get("trajectories")  # a multi-turn rollout's, one a response
    if trajectories is not None:  # what each was shown first: its environment's reset
        records = _rows("trajectories", trajectories, B, "response")
        for i, record in enumerate(records):
            if isinstance(record, Mapping) and isinstance(record.get("prompt"), str):
                cols["prompt"][i] = record["prompt"]
    lengths = outputs.get("response_lengths")
    cols["length"] = (
        [int(x) for x in _rows("response_lengths", lengths, B, "response")]
        if lengths is not None
        else [None] * B
    )
    truncated = outputs.get("truncated")
    if truncated is not None:
        cut = _rows("truncated", truncated, B, "response")
        cols["stop_reason"] = ["max_new_tokens" if x else "stop" for x in cut]
    return cols


def image_hash(image: Any) -> str:
    """16 hex digits of a BLAKE2b digest of a PIL image's mode, size and pixels."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{image.mode}:{image.size}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def thumbnail_png(image: Any, px: int = THUMBNAIL_PX) -> bytes:
    """A PNG of ``image`` shrunk to at most ``px`` on its longest side."""
    small = image.convert("RGB") if image.mode not in ("RGB", "L") else image.copy()
    small.thumbnail((px, px))
    buffer = io.BytesIO()
    small.save(buffer, format="PNG")
    return buffer.getvalue()


def lineage_columns(
    step: int,
    outputs: dict[str, Any],
    cols: dict[str, list[Any]],
    *,
    staleness: Mapping[str, int | None] | None = None,
    controllers: Mapping[str, int] | None = None,
    replicas: Mapping[str, list[int]] | None = None,
) -> dict[str, Any]:
    """Add the lineage columns (see the module) to ``cols``, the step's :func:`sample_rows`.

    Returns the images of the step by hash (PIL images, for the caller to write once each)."""
    B = len(cols["sample"])
    N = len(outputs["prompts"])
    prompt = cols["prompt_index"]
    rows = outputs.get("data_rows")
    if rows is not None:
        rows = _rows("data_rows", rows, N, "prompt")
        cols["data_file"] = [str(rows[p].get("file")) for p in prompt]
        cols["data_row"] = [int(rows[p].get("row")) for p in prompt]
    images: dict[str, Any] = {}
    pictures = outputs.get("images")
    if pictures is not None:
        hashes = []
        for image in _rows("images", pictures, N, "prompt"):
            key = image_hash(image) if hasattr(image, "tobytes") else None
            if key is not None:
                images.setdefault(key, image)
            hashes.append(key)
        cols["image"] = [hashes[p] for p in prompt]
    components = outputs.get("reward_components")
    if isinstance(components, Mapping):
        for name, values in components.items():
            where = f"reward_components.{name}"
            cols[f"reward/{name}"] = [float(x) for x in _rows(where, values, B, "response")]
    stats = outputs.get("sample_stats")
    if isinstance(stats, Mapping) and stats.get("sample") is not None:
        sample = stats["sample"]
        at = [int(i) for i in (sample.tolist() if hasattr(sample, "tolist") else sample)]
        if any(not 0 <= i < B for i in at) or len(set(at)) != len(at):
            raise SampleAlignmentError(
                f"samples: graph output 'sample_stats' names samples {sorted(at)}, and the step "
                f"has responses 0..{B - 1}, each at most once; its 'sample' must say which "
                "response each row is"
            )
        for name in ("advantage", "ref_kl", "logprob_gap"):
            if stats.get(name) is None:
                continue
            values = _rows(f"sample_stats.{name}", stats[name], len(at), "trained response")
            column: list[float | None] = [None] * B
            for i, x in zip(at, values):
                column[i] = float(x)
            cols[name] = column
    trajectories = outputs.get("trajectories")  # a multi-turn rollout's, one a response
    if trajectories is not None:
        records = _rows("trajectories", trajectories, B, "response")
        cols["turns"] = [int(r.get("turns", 0)) for r in records]
        cols["tool_calls"] = [" ".join(r.get("tool_calls", ())) for r in records]
        cols["tool_errors"] = ["; ".join(r.get("tool_errors", ())) for r in records]
        if any("env_error" in r for r in records):  # why its environment ended it, if it did
            cols["env_error"] = [r.get("env_error") or "" for r in records]
    if staleness and f"{ROLLOUT}.weights" in staleness:
        age = staleness[f"{ROLLOUT}.weights"]  # None: it read no update yet
        version = 0 if age is None else step - int(age)
        cols["weight_version"] = [version] * B
        cols["staleness"] = [step - version] * B
    if controllers and ROLLOUT in controllers:
        cols["controller"] = [int(controllers[ROLLOUT])] * B
    if replicas and replicas.get(ROLLOUT):
        ran = _rows(f"{ROLLOUT} replicas", replicas[ROLLOUT], N, "prompt")
        cols["replica"] = [int(ran[p]) for p in prompt]
    return images


class SampleWriter:
    """Writes ``OUT/samples/step-NNNNNN.parquet`` every ``every`` steps, and each distinct
    image's thumbnail once under ``OUT/samples/_images/`` (see the module).

    :meth:`write` reads the step's outputs into columns on the caller's thread (so a
    misaligned output raises there, and later steps cannot change what is kept) and leaves
    the thumbnails' encoding and the files to a thread of its own, one step at a time, so that
    they overlap the next step; its failure raises at the next :meth:`write` or at
    :meth:`close`, which waits for the files."""

    def __init__(self, out: Path, every: int) -> None:
        self.folder, self.every = Path(out) / "samples", int(every)
        self.full = False
        self._used: int | None = None  # bytes in the folder, counted once, then added to
        self._written: set[str] = set()
        self._checked = False
        self._pool: Any = None
        self._pending: Any = None

    def due(self, step: int) -> bool:
        return self.every > 0 and (step + 1) % self.every == 0 and not self.full

    def write(self, step: int, outputs: dict[str, Any], **lineage: Any) -> Path | None:
        """The path the step's samples go to once written (:meth:`flush`), or None where the
        step is not kept; ``lineage``: :func:`lineage_columns`' keywords."""
        # The first step is checked whether or not it is kept: a misaligned output fails
        # the run at once, not at the first kept step.
        if not (self.due(step) or (self.every > 0 and not self._checked)):
            return None
        self._checked = True
        cols = sample_rows(step, outputs)
        if cols is None:
            return None
        images = lineage_columns(step, outputs, cols, **lineage)
        if not self.due(step):
            return None
        self.flush()  # one step in flight: files in step order, memory bounded
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="yatt-samples")
        self._pending = self._pool.submit(self._store, step, cols, images)
        return self.folder / f"step-{step:06d}.parquet"

    def flush(self) -> None:
        """Wait for the files of the steps written so far (raising what writing them raised)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """:meth:`flush`, then end the thread."""
        try:
            self.flush()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def _store(self, step: int, cols: dict[str, list[Any]], images: dict[str, Any]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.folder.mkdir(parents=True, exist_ok=True)
        if self._used is None:
            self._start(step)
        if self._used >= MAX_BYTES:
            self.full = True
            print(
                f"yatt-graph run: {self.folder} holds {self._used >> 20} MB; no more samples are "
                "written this run (raise --samples-every to keep fewer)",
                file=sys.stderr,
            )
            return
        new = {k: thumbnail_png(v) for k, v in images.items() if k not in self._written}
        if new:
            pictures = self.folder / IMAGES / f"step-{step:06d}.parquet"
            pictures.parent.mkdir(exist_ok=True)
            table = pa.table({"hash": list(new), "png": list(new.values())})
            pq.write_table(table, pictures, compression="none")  # PNG is compressed already
            self._used += pictures.stat().st_size
            self._written |= set(new)
        path = self.folder / f"step-{step:06d}.parquet"
        pq.write_table(pa.table(cols), path, compression="zstd")
        self._used += path.stat().st_size

    def _start(self, step: int) -> None:
        """Before the first file: drop those of ``step`` and later (a resumed run writes them
        again), count the bytes the folder holds and the thumbnails it has."""
        import pyarrow.parquet as pq

        pictures = self.folder / IMAGES
        for path in [*self.folder.glob("step-*.parquet"), *pictures.glob("step-*.parquet")]:
            if _step_of(path) >= step:
                path.unlink()
        self._used = sum(p.stat().st_size for p in self.folder.rglob("*") if p.is_file())
        for path in sorted(pictures.glob("step-*.parquet")):
            try:
                self._written |= set(pq.read_table(path, columns=["hash"])["hash"].to_pylist())
            except Exception:  # a file a crash cut short: its images are written again
                path.unlink()


def _step_of(path: Path) -> int:
    try:
        return int(path.stem.removeprefix("step-"))
    except ValueError:
        return -1
