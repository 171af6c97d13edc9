"""Every notebook runs top to bottom, and its drawing cells draw a picture."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ has no .ipynb files"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_draws(path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    drawing = [c for c in nb.cells if "draw" in c.get("metadata", {}).get("tags", [])]
    assert drawing, f"{path.name} has no cell tagged 'draw'"
    for cell in drawing:
        kinds = {k for out in cell.outputs for k in out.get("data", {})}
        assert kinds & {"image/svg+xml", "image/png"}, (
            f"{path.name}: a 'draw' cell gave {sorted(kinds)}"
        )
