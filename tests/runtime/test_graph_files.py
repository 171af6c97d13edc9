"""A user's graph file runs on controllers whatever the working folder: named by path from
another folder, or run as a script (``python path/file.py``, its classes in ``__main__``),
imported once in each process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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
