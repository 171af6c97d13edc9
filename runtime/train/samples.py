"""The samples of a run, kept for people to read after it: every N steps, each response of the
step with its prompt, reward and length, as one Parquet file in ``OUT/samples/``.

A graph that outputs ``texts`` (one a response), ``prompts`` (one a prompt; the responses of a
prompt are consecutive) and ``scores`` (one a response) has its samples kept; ``response_lengths``
joins them where the graph outputs it. The folder stops growing at :data:`MAX_BYTES`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = ["MAX_BYTES", "SampleWriter", "sample_rows"]

MAX_BYTES = 64 * 2**20
"""The most the samples folder holds; later steps are not written (the run says so once)."""


def sample_rows(step: int, outputs: dict[str, Any]) -> dict[str, list[Any]] | None:
    """A step's samples as columns, or None where the graph does not output them."""
    texts, prompts, scores = (outputs.get(k) for k in ("texts", "prompts", "scores"))
    if texts is None or prompts is None or scores is None or not len(prompts):
        return None
    B = len(texts)
    n = max(B // len(prompts), 1)
    lengths = outputs.get("response_lengths")
    return {
        "step": [step] * B,
        "sample": list(range(B)),
        "prompt_index": [i // n for i in range(B)],
        "prompt": [str(prompts[i // n]) for i in range(B)],
        "response": [str(t) for t in texts],
        "reward": [float(x) for x in scores],
        "length": [int(x) for x in lengths] if lengths is not None else [None] * B,
    }


class SampleWriter:
    """Writes ``OUT/samples/step-NNNNNN.parquet`` every ``every`` steps (see the module)."""

    def __init__(self, out: Path, every: int) -> None:
        self.folder, self.every = Path(out) / "samples", int(every)
        self.full = False

    def write(self, step: int, outputs: dict[str, Any]) -> Path | None:
        if self.every <= 0 or (step + 1) % self.every or self.full:
            return None
        rows = sample_rows(step, outputs)
        if rows is None:
            return None
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.folder.mkdir(parents=True, exist_ok=True)
        used = sum(p.stat().st_size for p in self.folder.glob("*.parquet"))
        if used >= MAX_BYTES:
            self.full = True
            print(
                f"yatt-graph run: {self.folder} holds {used >> 20} MB; no more samples are "
                "written this run (raise --samples-every to keep fewer)",
                file=sys.stderr,
            )
            return None
        path = self.folder / f"step-{step:06d}.parquet"
        pq.write_table(pa.table(rows), path, compression="zstd")
        return path
