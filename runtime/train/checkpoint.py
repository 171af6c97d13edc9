"""Checkpoints: every node's state, the executor's carried values, RNG states and the step.

Layout: ``DIR/checkpoints/step_000010/{state.pt, meta.json}``. A checkpoint is written
into a temporary folder and renamed into place, so a crash never leaves half of one;
``meta.json`` holds the SHA-256 of ``state.pt``, and a checkpoint whose file does not
match is refused (with the reason) in favour of the newest one that does.

``state.pt`` is a torch file and is loaded with ``weights_only=False``: it holds
optimizer states and carried values, not just tensors. Load only checkpoints you wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CheckpointError",
    "checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]

FORMAT = 1


class CheckpointError(RuntimeError):
    """No usable checkpoint: each candidate and why it was refused."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoints(out_dir: str | Path) -> list[Path]:
    """Checkpoint folders under ``DIR/checkpoints``, oldest first."""
    root = Path(out_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []


def save_checkpoint(out_dir: str | Path, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    """Write ``state`` as the checkpoint after ``step`` steps; keep the newest ``keep``."""
    root = Path(out_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state, tmp / "state.pt")
    meta = {"format": FORMAT, "step": step, "sha256": _sha256(tmp / "state.pt")}
    (tmp / "meta.json").write_text(json.dumps(meta))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in checkpoints(out_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _verify(path: Path) -> str | None:
    meta_path, state_path = path / "meta.json", path / "state.pt"
    if not meta_path.is_file() or not state_path.is_file():
        return "meta.json or state.pt is missing"
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        return f"meta.json is not JSON ({exc})"
    if meta.get("format") != FORMAT:
        return f"format {meta.get('format')} is not {FORMAT}"
    if _sha256(state_path) != meta.get("sha256"):
        return "state.pt does not match its checksum (truncated or corrupted)"
    return None


def load_checkpoint(source: str | Path) -> tuple[Path, dict[str, Any]]:
    """Load the newest good checkpoint of a run folder (or the given checkpoint folder)."""
    source = Path(source)
    candidates = [source] if (source / "meta.json").exists() else checkpoints(source)[::-1]
    if not candidates:
        raise CheckpointError(
            f"no checkpoints in {source}: a run writes them with --checkpoint-every K"
        )
    refused = []
    for path in candidates:
        why = _verify(path)
        if why is None:
            if refused:
                warnings.warn(
                    "skipped bad checkpoint(s): "
                    + "; ".join(refused)
                    + f"; resuming from {path.name}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return path, torch.load(path / "state.pt", weights_only=False)
        refused.append(f"{path.name}: {why}")
    raise CheckpointError(f"no usable checkpoint in {source}: " + "; ".join(refused))
