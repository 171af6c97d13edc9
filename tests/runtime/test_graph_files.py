"""A user's graph file runs on controllers whatever the working folder: named by path from
another folder, or run as a script (``python path/file.py``, its classes in ``__main__``),
imported once in each process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

GRAPH_FILE = textwrap.dedent(
    """
    import torch
    from yatt_graph import Graph, Node, Tensor

    class Source(Node):
        kind = "data"
        outputs = {"x": Tensor("float32", "B")}

        def forward(self):
            return {"x": torch.arange(4, dtype=torch.float32) + self.step}

    class Twice(Node):
        inputs = {"x": Tensor("float32", "B")}
        outputs = {"y": Tensor("float32", "B")}

        def forward(self, x):
            return {"y": x * 2}

    def build_graph():
        with Graph("mine") as g:
            y = Twice(placement=1, name="twice")(Source(placement=0, name="source")())
            g.output("y", y)
        return g

    if __name__ == "__main__":
        from runtime.zmq.driver import ZmqExecutor

        with ZmqExecutor(build_graph().plan(2)) as ex:
            print([r.outputs["y"].tolist() for r in ex.run(2)])
    """
)


@pytest.mark.timeout(120)
def test_a_graph_file_named_by_path_from_another_folder_runs_on_two_controllers(tmp_path):
    (tmp_path / "graphs_of_mine").mkdir()
    path = tmp_path / "graphs_of_mine" / "my_graph.py"
    path.write_text(GRAPH_FILE)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cli = "import sys; from runtime.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", cli, "run", str(path), "--controllers", "2",
           "--steps", "2", "--out", str(tmp_path / "out"), "--quiet"]  # fmt: skip
    done = subprocess.run(cmd, cwd=elsewhere, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    rows = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2


@pytest.mark.timeout(120)
def test_a_graph_file_run_as_a_script_runs_on_two_controllers(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(GRAPH_FILE)
    done = subprocess.run(
        [sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[[0.0, 2.0, 4.0, 6.0], [2.0, 4.0, 6.0, 8.0]]"


@pytest.mark.timeout(120)
def test_a_graph_file_is_imported_once_per_process(tmp_path):
    """The driver reads the file's options, checks --set values and builds the graph; each
    controller preloads it and builds its nodes: one import each."""
    log = tmp_path / "imports.log"
    (tmp_path / "elsewhere").mkdir()
    path = tmp_path / "counted.py"  # not importable by name from the working folder
    path.write_text(
        f"import os\nopen({str(log)!r}, 'a').write(f'{{os.getpid()}}\\n')\n" + GRAPH_FILE
    )
    cli = "import sys; from runtime.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", cli, "run", str(path), "--controllers", "2", "--steps", "2",
           "--out", str(tmp_path / "out"), "--quiet", "--on-bad-sample", "raise"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        cmd, cwd=tmp_path / "elsewhere", capture_output=True, text=True, timeout=100, env=env
    )
    assert done.returncode == 0, done.stderr
    pids = log.read_text().split()
    assert len(pids) == 3 and len(set(pids)) == 3, pids  # the driver and two controllers


def test_import_roots_adds_only_folders_that_lead_back_to_a_module(tmp_path, monkeypatch):
    """torch.ops says its file is "_ops.py" (relative): counting from there added the working
    folder's parent to the controllers' path, and a graph file beside it then imported under
    another name there (``graphs_of_mine.my_graph``) than in the driver (``my_graph``)."""
    import types

    from yatt_graph.refs import import_roots

    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    odd = types.ModuleType("pkg.ops")
    odd.__file__ = "_ops.py"
    alias = types.ModuleType("alias_of_json")
    alias.__file__ = str(Path(json.__file__).resolve())
    own = tmp_path / "mine" / "graph_of_mine.py"
    own.parent.mkdir()
    own.write_text("")
    real = types.ModuleType("graph_of_mine")
    real.__file__ = str(own)
    for module in (odd, alias, real):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    roots = import_roots()
    assert str(tmp_path) not in roots and str(Path(json.__file__).resolve().parent) not in roots
    assert str(own.parent) in roots
