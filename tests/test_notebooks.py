"""Every notebook runs top to bottom, and its drawing cells draw a picture; the notebooks are
committed with those pictures, so they show when the repository is browsed."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ has no .ipynb files"


def test_the_zeromq_notebook_is_there():
    assert "03_zeromq_run.ipynb" in [p.name for p in NOTEBOOKS]


def _check_pictures(nb: nbformat.NotebookNode, name: str, when: str) -> None:
    drawing = [c for c in nb.cells if "draw" in c.get("metadata", {}).get("tags", [])]
    assert drawing, f"{name} has no cell tagged 'draw'"
    for cell in drawing:
        kinds = {k for out in cell.outputs for k in out.get("data", {})}
        assert kinds & {"image/svg+xml", "image/png"}, (
            f"{name}: a 'draw' cell {when} has {sorted(kinds) or 'no output'}; rerun the "
            "notebook and save it with its outputs (see the module docstring)"
        )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_with_its_pictures(path):
    nb = nbformat.read(path, as_version=4)
    _check_pictures(nb, path.name, "as committed")
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, f"{path.name} was saved with an error output: {errors[0].get('ename')}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_draws(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # run from a clean slate, not from the saved outputs
        if cell.cell_type == "code":
            cell.outputs = []
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    _check_pictures(nb, path.name, "after running")


# To save a notebook with its outputs after editing it (about 20-35 s each):
#   .venv/bin/python -c "import nbformat, sys; from nbclient import NotebookClient; \
#     nb = nbformat.read(sys.argv[1], 4); NotebookClient(nb, timeout=300, \
#     resources={'metadata': {'path': '.'}}).execute(); nbformat.write(nb, sys.argv[1])" \
#     notebooks/03_zeromq_run.ipynb
