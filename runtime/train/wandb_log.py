"""``yatt-graph run --wandb [PROJECT]``: the run's scalars and samples in Weights & Biases.

The same scalars as ``metrics.jsonl`` and TensorBoard, one ``log`` a step, and a ``samples``
table each time the run keeps a step's samples (``--samples-every``: the rows of that step's
``OUT/samples/step-N.parquet``). Offline unless a key is configured (``WANDB_API_KEY`` or a
``wandb login`` entry in ``~/.netrc``; ``WANDB_MODE`` set by the user wins): the run then lives in
``OUT/wandb/`` and ``wandb sync OUT/wandb/offline-run-*`` uploads it later. The run's id is kept
in ``OUT/wandb/run-id``, so a resumed or restarted run goes on in the same W&B run.
"""

from __future__ import annotations

import netrc
import os
import uuid
from pathlib import Path
from typing import Any

from yatt_graph import UsageError

__all__ = ["NO_WANDB", "WandbLog", "wandb_mode"]

NO_WANDB = (
    "--wandb needs the wandb package: pip install 'yatt-graph[wandb]' (or leave --wandb out; "
    "metrics.jsonl and TensorBoard have the same scalars)"
)
"""What a run with ``--wandb`` says where the wandb package is not installed."""


def wandb_mode() -> str | None:
    """``"online"`` with a configured key, ``"offline"`` without; None where the user set
    ``WANDB_MODE`` (wandb reads it itself)."""
    if os.environ.get("WANDB_MODE"):
        return None
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        found = netrc.netrc().authenticators("api.wandb.ai")
    except (OSError, netrc.NetrcParseError):
        found = None
    return "online" if found else "offline"


class WandbLog:
    """One W&B run beside a run folder (see the module docstring)."""

    def __init__(self, out: Path, project: str, config: dict[str, Any] | None = None) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise UsageError(NO_WANDB) from exc
        self._wandb = wandb
        folder = Path(out) / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "run-id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=project, name=Path(out).resolve().name, id=run_id, resume="allow",
            dir=str(out), mode=wandb_mode(), config=config or {},
        )  # fmt: skip

    def scalars(self, row: dict[str, Any]) -> None:
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, int | float)}
        self.run.log(numbers, step=int(row["step"]))

    def samples(self, step: int, path: Path) -> None:
        """The samples the run kept for ``step`` (its Parquet file) as a table."""
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        columns = [c for c in table.column_names if not c.startswith("_")]
        rows = table.select(columns).to_pylist()
        data = [[row[c] for c in columns] for row in rows]
        self.run.log({"samples": self._wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        """Finish the run and end wandb's service process (it would outlive the run)."""
        try:
            self.run.finish()
        finally:
            self._wandb.teardown()
