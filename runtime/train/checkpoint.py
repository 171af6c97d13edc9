"""Checkpoints: every node's state, the executor's carried values, RNG states and the step.

Layout: ``DIR/checkpoints/step_000010/{state.pt, meta.json}``. A checkpoint is written
into a temporary folder and renamed into place, so a crash never leaves half of one;
``meta.json`` holds the SHA-256 of ``state.pt``, the step, and (when written by
:func:`runtime.train.loop.train`) the graph's identity and how to rebuild it. A checkpoint
whose file does not match, whose ``meta.json`` is not the expected object, or whose graph
is another one, is refused (with the reason) in favour of the newest one that is good.

``state.pt`` is a torch file and is loaded with ``weights_only=False``: it holds
optimizer states and carried values, not just tensors. Load only checkpoints you wrote.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.pids import pid_alive
from yatt_graph import UsageError
from yatt_graph.serialize import identity_differences

__all__ = [
    "CheckpointError",
    "checkpoint_step",
    "checkpoints",
    "distinct",
    "find_checkpoint",
    "load_checkpoint",
    "one_copy",
    "save_checkpoint",
]

FORMAT = 1
_NAME = re.compile(r"step_(\d+)")


class CheckpointError(UsageError, RuntimeError):
    """No usable checkpoint: each candidate and why it was refused."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_step(path: Path) -> int | None:
    """The step in a checkpoint folder's name (``step_000010`` -> 10); None for other names."""
    match = _NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def checkpoints(out_dir: str | Path) -> list[Path]:
    """Checkpoint folders under ``DIR/checkpoints``, oldest (lowest step) first."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    state: dict[str, Any],
    keep: int = 3,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write ``state`` as the checkpoint after ``step`` steps (``meta`` joins ``meta.json``);
    keep the newest ``keep`` by step, and always the one just written."""
    root = Path(out_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
    for left in root.glob(".tmp_step_*"):  # a write killed midway: its process is gone
        pid = left.name.rsplit("_", 1)[-1]
        if left == tmp or (pid.isdigit() and not pid_alive(int(pid))):
            shutil.rmtree(left, ignore_errors=True)
    tmp.mkdir()
    import torch  # here, not at import: the CLI starts controllers before it loads torch

    torch.save(one_copy(state), tmp / "state.pt")
    record = {**(meta or {}), "format": FORMAT, "step": step, "sha256": _sha256(tmp / "state.pt")}
    (tmp / "meta.json").write_text(json.dumps(record))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    others = [p for p in checkpoints(out_dir) if p != final]
    for old in others[: max(0, len(others) - (keep - 1))] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


SHARED_BYTES = 1 << 20
"""Tensors this large or larger are written once where the state holds them several times."""


def _map_tensors(state: Any, fn: Callable[[Any], Any]) -> Any:
    """``state`` with ``fn(t)`` in place of each tensor ``t`` in its dicts, lists, plain tuples
    and weight updates; those containers are new, everything else is as it was."""
    import msgspec
    import torch

    from yatt_graph.types import WeightUpdate

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if isinstance(x, dict | list):
            out = copy.copy(x)  # (an OrderedDict stays one)
            for k in x.keys() if isinstance(x, dict) else range(len(x)):
                out[k] = walk(x[k])
            return out
        if type(x) is tuple:
            return tuple(walk(v) for v in x)
        if isinstance(x, WeightUpdate):
            return msgspec.structs.replace(x, weights=walk(x.weights))
        return x

    return walk(state)


def one_copy(state: Any) -> Any:
    """``state`` with each set of equal CPU tensors (of ``SHARED_BYTES`` or more) given as one
    tensor, so that ``torch.save`` writes it once. A run's state holds many: the update's
    weights, the newest weight update still on its way to the rollout (a delayed edge, with
    ``max_staleness``), the critic's copy of the value model on another controller. Only the
    containers are new (dicts, lists, tuples, weight updates); no tensor is copied or changed.
    Candidates are grouped by dtype, shape and a strided sample of their values, and merged
    only when ``torch.equal``. :func:`distinct` undoes the sharing on load."""
    import torch

    kept: dict[tuple[Any, ...], list[torch.Tensor]] = {}

    def canonical(t: torch.Tensor) -> torch.Tensor:
        n = t.numel()
        if t.device.type != "cpu" or n * t.element_size() < SHARED_BYTES or t.is_sparse:
            return t
        sample = t.detach().reshape(-1)[:: max(1, n // 256)]
        values = sample.contiguous().view(torch.uint8).numpy().tobytes()
        key = (t.dtype, tuple(t.shape), hashlib.blake2b(values).digest())
        for other in kept.setdefault(key, []):
            if other is t or torch.equal(other, t):
                return other
        kept[key].append(t)
        return t

    return _map_tensors(state, canonical)


def distinct(state: Any) -> Any:
    """A loaded state with every tensor its own again (:func:`one_copy` wrote some once): a
    later in-place change to one (an optimizer's moments) must not reach another (the weights
    a delayed edge still carries)."""
    seen: set[int] = set()

    def own(t: Any) -> Any:
        if t.device.type != "cpu" or t.numel() == 0:
            return t
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            return t.clone()
        seen.add(ptr)
        return t

    return _map_tensors(state, own)


def _read_meta(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(meta, None) for a good checkpoint folder, else (None, why not)."""
    meta_path, state_path = path / "meta.json", path / "state.pt"
    if not meta_path.is_file() or not state_path.is_file():
        return None, "meta.json or state.pt is missing"
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, f"meta.json is not JSON ({exc})"
    if not isinstance(meta, dict):
        return None, f"meta.json holds a {type(meta).__name__}, not an object"
    if meta.get("format") != FORMAT:
        return None, f"format {meta.get('format')!r} is not {FORMAT}"
    if not isinstance(meta.get("step"), int) or isinstance(meta.get("step"), bool):
        return None, f"meta.json's step {meta.get('step')!r} is not a whole number"
    if _sha256(state_path) != meta.get("sha256"):
        return None, "state.pt does not match its checksum (truncated or corrupted)"
    return meta, None


def find_checkpoint(
    source: str | Path, identity: dict[str, Any] | None = None
) -> tuple[Path, dict[str, Any]]:
    """The newest good checkpoint of a run folder (or the given checkpoint folder) and its
    meta, without loading ``state.pt``. With ``identity`` (:func:`graph_identity`), a
    checkpoint recorded for another graph is refused, naming what differs."""
    source = Path(source)
    if not source.exists():
        raise CheckpointError(
            f"{source} does not exist; give a run folder (the --out of a run) or one of its "
            "checkpoints/step_N folders"
        )
    if source.is_file():
        raise CheckpointError(
            f"{source} is a file; a checkpoint is read from a run folder or one of its "
            "checkpoints/step_N folders"
        )
    if checkpoint_step(source) is not None and not (source / "meta.json").exists():
        raise CheckpointError(
            f"{source} has no meta.json: not a whole checkpoint (its write was cut short, or "
            f"the file was removed); give the run folder {source.parent.parent} to use its "
            "newest good one"
        )
    candidates = [source] if (source / "meta.json").exists() else checkpoints(source)[::-1]
    if not candidates:
        raise CheckpointError(
            f"no checkpoints in {source}: a run writes them with --checkpoint-every K"
        )
    refused: dict[str, list[str]] = {}  # why -> checkpoints refused for it
    for path in candidates:
        meta, why = _read_meta(path)
        if meta is not None and identity is not None and "graph" in meta:
            diffs = identity_differences(meta["graph"], identity)
            if diffs:
                meta, why = None, "written by another graph or other options: " + "; ".join(diffs)
        if meta is not None:
            if refused:
                warnings.warn(
                    f"skipped bad checkpoint(s): {_reasons(refused)}; resuming from {path.name}",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return path, meta
        refused.setdefault(why, []).append(str(path))
    raise CheckpointError(f"no usable checkpoint in {source}: {_reasons(refused)}")


def _reasons(refused: dict[str, list[str]]) -> str:
    return "; ".join(f"{', '.join(names)}: {why}" for why, names in refused.items())


def load_checkpoint(
    source: str | Path, identity: dict[str, Any] | None = None
) -> tuple[Path, dict[str, Any]]:
    """Load the newest good checkpoint (see :func:`find_checkpoint`): (its folder, its state)."""
    import torch

    path, _ = find_checkpoint(source, identity)
    try:
        return path, distinct(torch.load(path / "state.pt", weights_only=False))
    except Exception as exc:  # it matched its checksum: written damaged or by another torch
        raise CheckpointError(
            f"{path / 'state.pt'} does not load ({type(exc).__name__}: {exc})"
        ) from exc
