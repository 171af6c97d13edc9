"""``yatt-graph run GRAPH --ray [ADDRESS]`` on a local Ray cluster of two nodes (runtime/ray_launch.py).

The cluster is two raylets on this machine (``ray.cluster_utils.Cluster``, one CPU each, a
small object store, no dashboard), so the two nodes share an address: the run goes over tcp
with CURVE keys as across hosts, and STRICT_SPREAD puts each node's ``yatt-graph run`` on its
own raylet. Each run is the command a user types, from a folder outside the repository.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_multihost import _assert_same_results, _metrics, _one_host_metrics
from zmq_graphs import default_sigint

from runtime import ray_launch
from runtime.cli import main, parse_run
from runtime.flags import NO_RAY, LaunchError
from runtime.ray_launch import LAUNCHER_VARIABLES, node_argv, node_bundles
from runtime.zmq.keys import generate_keys

ROOT = Path(__file__).resolve().parents[2]
YATT = str(Path(sys.executable).parent / "yatt-graph")
ENV = {
    k: v for k, v in os.environ.items() if k not in (*LAUNCHER_VARIABLES, "RAY_ADDRESS")
}  # fmt: skip


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A Ray cluster of two nodes on this machine; its address."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (pip install 'yatt-graph[ray]')")
    from ray.cluster_utils import Cluster

    small = {"num_cpus": 1, "object_store_memory": 80 << 20}
    nodes = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    try:
        nodes.add_node(**small)
        nodes.wait_for_nodes()
        yield nodes.address
    finally:
        nodes.shutdown()


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> str:
    return str(generate_keys(tmp_path_factory.mktemp("ray") / "keys"))


def _yatt(args: list[str], cwd: Path, **popen) -> subprocess.Popen:
    cwd.mkdir(exist_ok=True)
    return subprocess.Popen(
        [YATT, *args], cwd=cwd, env=popen.pop("env", ENV), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint,
        **popen,
    )  # fmt: skip


def _finish(proc: subprocess.Popen, timeout_s: float = 120.0) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"{proc.args} did not finish:\n{out}\n{err}") from None
    return proc.returncode, out + err


def _nodes_running(out: Path) -> list[str]:
    """The command lines of the nodes' processes (``runtime.ray_node``) of the run in ``out``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "runtime.ray_node" in words and str(out) in words:
            found.append(" ".join(words))
    return found


@pytest.mark.timeout(240)
def test_a_ray_launch_on_two_nodes_equals_the_one_host_run(cluster, keys, tmp_path):
    out = tmp_path / "run"
    cmd = ["run", "graphs/toy.py", "--steps", "3", "--controllers", "2", "--ray", cluster]
    cmd += ["--nnodes", "2", "--keys", keys, "--out", str(out)]
    code, log = _finish(_yatt(cmd, tmp_path / "work"))
    assert code == 0, log
    assert f"Ray at {cluster}: 2 nodes in a placement group" in log and "STRICT_SPREAD" in log
    assert "[node 1] yatt-graph run: node 1 of 2 (flags: --nnodes 2, --node-rank 1" in log
    assert "controllers 1 run here" in log
    assert "node 0 of 2" in log and "the driver and controllers 0 run here" in log
    assert '"steps": 3' in log  # node 0's summary, on this process's stdout
    _assert_same_results(_metrics(out / "metrics.jsonl"), _one_host_metrics(tmp_path, 3))


@pytest.mark.timeout(240)
def test_without_keys_the_run_makes_its_own_and_auto_finds_the_cluster(cluster, tmp_path):
    """``--ray`` alone: RAY_ADDRESS names the cluster, its two nodes are the default
    ``--nnodes``, and the keys are made for the run and deleted with it."""
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("yatt-graph-keys-*"))
    cmd = ["run", "graphs/toy.py", "--steps", "2", "--controllers", "2", "--ray", "--quiet"]
    code, log = _finish(_yatt(cmd, tmp_path / "work", env={**ENV, "RAY_ADDRESS": cluster}))
    assert code == 0, log
    assert "Ray at auto: 2 nodes" in log and "CURVE keys made for the run" in log
    assert "[node 1] yatt-graph run: node 1 of 2" in log
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("yatt-graph-keys-*")) <= before


@pytest.mark.timeout(240)
def test_ctrl_c_stops_every_node(cluster, keys, tmp_path):
    out = tmp_path / "run"
    cmd = ["run", "graphs/toy.py", "--steps", "100000", "--controllers", "2", "--ray", cluster]
    cmd += ["--keys", keys, "--out", str(out), "--quiet"]
    proc = _yatt(cmd, tmp_path / "work")
    deadline = time.monotonic() + 90
    while not (out / "metrics.jsonl").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "the run wrote no metrics in 90 s"
        time.sleep(0.2)
    assert len(_nodes_running(out)) == 2
    proc.send_signal(signal.SIGINT)
    code, log = _finish(proc)
    assert code == 130, log
    assert "stopping every node" in log and "stopped by Ctrl-C" in log
    assert re.search(r"stopped by SIGTERM after step \d+; metrics and trace are in", log)
    assert "yatt-graph run: node 1 (at" not in log  # a stop is no failure to report
    deadline = time.monotonic() + 30
    while _nodes_running(out):
        assert time.monotonic() < deadline, _nodes_running(out)
        time.sleep(0.2)


@pytest.mark.timeout(120)
def test_bundles_ray_cannot_place_are_refused_after_the_timeout(cluster, monkeypatch):
    """Three one-CPU bundles on two one-CPU nodes (SPREAD: fewer nodes than bundles)."""
    monkeypatch.setattr(ray_launch, "PLACEMENT_TIMEOUT_S", 2.0)
    argv = ["run", "graphs/toy.py", "--controllers", "3", "--nnodes", "3", "--ray", cluster]
    with pytest.raises(LaunchError, match=r"could not place 3 bundles .*SPREAD.* within 2 s"):
        ray_launch.run_on_ray(parse_run(argv[1:]), argv)


@pytest.mark.timeout(60)
def test_no_cluster_at_the_address_is_one_line(tmp_path):
    cmd = ["run", "graphs/toy.py", "--controllers", "2", "--ray", "127.0.0.1:1"]
    code, log = _finish(_yatt(cmd, tmp_path / "work"), timeout_s=50)
    assert code == 2, log
    assert log.strip() == (
        "yatt-graph run: error: --ray 127.0.0.1:1: no Ray cluster there (Connection refused); "
        "start one (`ray start --head`) or give its address (--ray HOST:PORT, or RAY_ADDRESS)"
    )


def test_without_ray_the_flag_says_how_to_install_it(monkeypatch, capsys):
    spec = parse_run(["graphs/toy.py", "--ray"])
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a)
    )
    assert main(["run", "graphs/toy.py", "--controllers", "2", "--ray"]) == 2
    assert capsys.readouterr().err.strip() == f"yatt-graph run: error: {NO_RAY}"
    monkeypatch.setitem(sys.modules, "ray", None)  # an import of it fails
    with pytest.raises(LaunchError, match=r"pip install 'yatt-graph\[ray\]'"):
        ray_launch.run_on_ray(spec, ["run", "--ray"])


@pytest.mark.timeout(60)
def test_nothing_imports_ray_unless_asked():
    code = (
        "import sys, runtime.cli, runtime.ray_launch, runtime.ray_node; print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


def test_a_node_runs_the_typed_command_without_ray_and_with_its_place():
    place = ["--nnodes", "2", "--node-rank", "1", "--master", "10.0.0.1:5000"]
    for typed in (["--ray"], ["--ray", "10.0.0.1:6379"], ["--ray=10.0.0.1:6379"]):
        argv = ["run", "graphs/toy.py", *typed, "--controllers", "3"]
        assert node_argv(argv, 2, 1, "10.0.0.1:5000") == [
            "run", "graphs/toy.py", "--controllers", "3", *place,
        ]  # fmt: skip
    assert node_argv(["run", "g.py", "--ray"], 2, 1, "10.0.0.1:5000") == ["run", "g.py", *place]


def test_each_node_bundle_holds_its_share_of_the_controllers():
    assert node_bundles(5, 2, 0) == [{"CPU": 3.0}, {"CPU": 2.0}]
    assert node_bundles(2, 2, 1) == [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    with pytest.raises(LaunchError, match="leaves node"):
        node_bundles(1, 2, 0)


def test_flags_that_place_a_node_are_refused_with_ray(capsys):
    for extra, flag in ((["--node-rank", "1"], "--node-rank"), (["--master", "h:1"], "--master"),
                        (["--data-host", "10.0.0.2"], "--data-host")):  # fmt: skip
        assert main(["run", "graphs/toy.py", "--controllers", "2", "--ray", *extra]) == 2
        assert f"--ray and {flag}: Ray starts every node" in capsys.readouterr().err
    assert main(["run", "graphs/toy.py", "--controllers", "2", "--nnodes", "3", "--ray"]) == 2
    assert "leaves node(s) [2] with no controller" in capsys.readouterr().err
