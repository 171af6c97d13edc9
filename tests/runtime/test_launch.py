"""Reading a launch across hosts from flags and launcher environments (runtime/flags.py), and
``yatt-graph run``'s one-line refusals of launches that cannot work (nothing starts)."""

from __future__ import annotations

import re
import socket

import pytest

from runtime.cli import main
from runtime.flags import (
    Launch,
    LaunchError,
    controller_shares,
    expand_nodelist,
    resolve_launch,
    split_host_port,
)
from runtime.zmq.keys import generate_keys

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
SLURM = {"SLURM_NODEID": "2", "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "gpu[01-03]"}


# --- Slurm node lists ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, hosts",
    [
        ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
        ("node7", ["node7"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("n[001-002]-ib,x[3]", ["n001-ib", "n002-ib", "x3"]),
        ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),
        ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
    ],
)
def test_a_nodelist_expands_in_order(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    "text, why",
    [
        ("gpu[01-03", "is not closed"),
        ("gpu01-03]", "without '['"),
        ("gpu[3-1]", "runs backwards"),
        ("gpu[a-b]", "is not N or N-M"),
        ("a,,b", "an empty host name"),
        ("a[[1]]", "nested"),
    ],
)
def test_a_bad_nodelist_names_the_variable_and_the_fault(text, why):
    with pytest.raises(LaunchError, match=f"SLURM_JOB_NODELIST=.*{re.escape(why)}"):
        expand_nodelist(text, "SLURM_JOB_NODELIST")


# --- environments -------------------------------------------------------------------------------
def test_no_flags_and_no_launcher_is_a_one_host_run():
    assert resolve_launch(None, None, None, {}) is None
    assert resolve_launch(None, None, None, {"MASTER_ADDR": "h", "MASTER_PORT": "1"}) is None
    # an salloc shell on a login node: Slurm variables, but no srun task
    assert resolve_launch(None, None, None, {"SLURM_NNODES": "2", "SLURM_JOB_ID": "7"}) is None


def test_torchrun_variables_give_the_node_and_the_driver_on_master_port_plus_one():
    launch = resolve_launch(None, None, None, {**TORCHRUN, "LOCAL_RANK": "0"})
    assert launch == Launch(
        nnodes=2, node_rank=1, host="10.0.0.1", port=29501, source="torchrun environment",
        detail=launch.detail, local_rank=0,
    )  # fmt: skip
    line = launch.describe()
    assert "node 1 of 2 (torchrun environment: " in line and "RANK=1" in line
    assert "MASTER_PORT=29500 (the driver takes MASTER_PORT + 1)" in line
    assert line.endswith("driver at 10.0.0.1:29501")


@pytest.mark.parametrize(
    "env, rank, size",
    [
        ({"GROUP_RANK": "1", "GROUP_WORLD_SIZE": "3"}, 1, 3),
        ({"NODE_RANK": "2", "NNODES": "4"}, 2, 4),
        ({"RANK": "3", "WORLD_SIZE": "4", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}, 3, 4),
    ],
)
def test_the_other_rank_variables(env, rank, size):
    launch = resolve_launch(None, None, None, {**env, "MASTER_ADDR": "h", "MASTER_PORT": "9"})
    assert (launch.node_rank, launch.nnodes, launch.port) == (rank, size, 10)


def test_slurm_variables_give_the_node_and_the_first_host_as_master():
    launch = resolve_launch(None, None, None, {**SLURM, "MASTER_PORT": "29500"})
    assert (launch.nnodes, launch.node_rank, launch.host, launch.port) == (3, 2, "gpu01", 29501)
    assert launch.source == "Slurm environment"
    assert "SLURM_JOB_NODELIST=gpu[01-03] (first host)" in launch.describe()
    env = {"SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODELIST": "a,b"}
    other = resolve_launch(None, None, None, {**env, "MASTER_PORT": "5", "MASTER_ADDR": "10.1.1.1"})
    assert (other.nnodes, other.host, other.port) == (2, "10.1.1.1", 6)  # MASTER_ADDR wins


def test_torchrun_under_srun_reads_torchrun():
    launch = resolve_launch(None, None, None, {**SLURM, **TORCHRUN})
    assert launch.source == "torchrun environment" and launch.nnodes == 2


def test_flags_alone_are_a_hand_launch_and_may_agree_with_the_environment():
    launch = resolve_launch(2, 0, "10.0.0.1:7000", {})
    assert (launch.nnodes, launch.node_rank, launch.master, launch.source) == (
        2, 0, "10.0.0.1:7000", "flags",
    )  # fmt: skip
    both = resolve_launch(2, None, "h:7000", TORCHRUN)
    assert both.source == "flags and torchrun environment"
    assert (both.node_rank, both.port) == (1, 7000)  # --master is the driver's address exactly
    assert resolve_launch(1, 0, None, {}).nnodes == 1  # one node needs no master


@pytest.mark.parametrize(
    "flags, env, message",
    [
        ((3, None, None), TORCHRUN, r"--nnodes 3 contradicts WORLD_SIZE=2"),
        ((None, 0, None), TORCHRUN, r"--node-rank 0 contradicts RANK=1"),
        ((None, None, None), {**TORCHRUN, "RANK": "2"}, r"RANK=2 is not in 0\.\.1 \(WORLD_SIZE=2\)"),
        ((2, 5, "h:1"), {}, r"--node-rank 5 is not in 0\.\.1"),
        ((0, 0, "h:1"), {}, r"--nnodes 0: the node count must be 1 or more"),
        ((None, None, None), {"RANK": "1"}, r"RANK=1 is set but WORLD_SIZE is not"),
        ((None, None, None), {"WORLD_SIZE": "2"}, r"WORLD_SIZE=2 is set but RANK is not"),
        ((None, None, None), {**TORCHRUN, "RANK": "x"}, r"RANK='x' is not an integer"),
        ((2, 1, None), {}, r"MASTER_ADDR is not set.*--master HOST:PORT"),
        ((2, 1, None), {"MASTER_ADDR": "h"}, r"MASTER_PORT is not set"),
        ((None, None, None), SLURM, r"MASTER_PORT is not set"),
        ((2, 1, "host"), {}, r"--master 'host': expected HOST:PORT"),
        ((2, 1, "h:70000"), {}, r"--master 'h:70000': expected HOST:PORT with a port in 1\.\.65535"),
        ((2, None, "h:1"), {}, r"--node-rank is missing"),
        ((None, 1, "h:1"), {}, r"--nnodes is missing"),
        ((None, None, None), {"SLURM_NODEID": "0"}, r"SLURM_NNODES and SLURM_JOB_NUM_NODES are not"),
        ((None, None, None), {**SLURM, "SLURM_NTASKS": "6"}, r"SLURM_NTASKS=6 on SLURM_NNODES=3.*--ntasks-per-node=1"),
        ((None, None, None), {**SLURM, "SLURM_JOB_NODELIST": "a,b"}, r"names 2 hosts but SLURM_NNODES=3"),
    ],
)  # fmt: skip
def test_bad_or_contradictory_values_name_the_flag_or_variable(flags, env, message):
    with pytest.raises(LaunchError, match=message):
        resolve_launch(*flags, env)


def test_split_host_port_takes_ipv6_in_brackets():
    assert split_host_port("[::1]:5", "--master") == ("::1", 5)
    assert split_host_port("gpu01:29500", "--master") == ("gpu01", 29500)


# --- shares -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "controllers, nnodes, shares",
    [(5, 2, [[0, 1, 2], [3, 4]]), (3, 3, [[0], [1], [2]]), (4, 1, [[0, 1, 2, 3]]), (7, 3, [[0, 1, 2], [3, 4], [5, 6]])],
)  # fmt: skip
def test_controllers_are_shared_in_contiguous_blocks(controllers, nnodes, shares):
    assert controller_shares(controllers, nnodes) == shares


def test_every_controller_has_one_node_and_every_node_one_or_more():
    for nnodes in range(1, 6):
        for controllers in range(nnodes, 20):
            shares = controller_shares(controllers, nnodes)
            assert sorted(i for s in shares for i in s) == list(range(controllers))
            sizes = [len(s) for s in shares]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_a_node_with_no_controller_is_an_error():
    with pytest.raises(LaunchError, match=r"--controllers 1 on 3 nodes leaves node\(s\) \[1, 2\]"):
        controller_shares(1, 3)


# --- yatt-graph run: one line, nothing started ----------------------------------------------------
@pytest.fixture
def clean_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "NODE_RANK", "NNODES",
                 "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NODEID", "SLURM_NNODES",
                 "SLURM_JOB_NUM_NODES", "SLURM_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NTASKS",
                 "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _run_error(capsys, *flags: str) -> str:
    code = main(["run", "graphs.toy", "--steps", "1", "--quiet", *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("yatt-graph run: error: "), err
    return lines[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_run_refuses_launches_that_cannot_work_in_one_line(clean_env, capsys, tmp_path):
    keys = str(generate_keys(tmp_path / "keys"))
    hand = ["--nnodes", "2", "--controllers", "2"]
    assert "--node-rank 2 is not in 0..1" in _run_error(
        capsys, *hand, "--node-rank", "2", "--master", "127.0.0.1:5000"
    )
    assert "MASTER_ADDR is not set" in _run_error(capsys, *hand, "--node-rank", "1")
    line = _run_error(capsys, *hand, "--node-rank", "1", "--master", "10.9.8.7:5000")
    assert "not a loopback address, so the run needs CURVE keys" in line and "--keys DIR" in line
    line = _run_error(
        capsys, *hand, "--node-rank", "0", "--master", "10.255.255.1:5000", "--keys", keys
    )
    assert "node 0: the driver cannot listen on 10.255.255.1:5000" in line
    assert "not an address of this host" in line
    assert "leaves node(s) [1] with no controller" in _run_error(
        capsys, "--nnodes", "2", "--node-rank", "1", "--master", "127.0.0.1:5000"
    )
    line = _run_error(capsys, *hand, "--node-rank", "0", "--master", "127.0.0.1:5000", "--listen", "tcp://127.0.0.1:5001")  # fmt: skip
    assert "--listen and a run across hosts" in line
    line = _run_error(capsys, *hand, "--node-rank", "0", "--master", "127.0.0.1:5000", "--restart", "on-failure", "--out", str(tmp_path / "o"))  # fmt: skip
    assert "torchrun --max-restarts" in line
    assert "--data-host applies to a run across hosts" in _run_error(
        capsys, "--data-host", "127.0.0.2"
    )
    line = _run_error(capsys, *hand, "--node-rank", "0", "--master", "127.0.0.1:5000", "--keys", str(tmp_path / "none"))  # fmt: skip
    assert "keys folder" in line and "does not exist" in line


def test_run_says_when_the_driver_port_is_taken(clean_env, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _run_error(capsys, "--nnodes", "2", "--node-rank", "0", "--controllers", "2",
                          "--master", f"127.0.0.1:{port}")  # fmt: skip
    assert f"cannot listen on 127.0.0.1:{port}" in line and "the port is taken" in line


def test_run_refuses_a_master_name_that_resolves_to_loopback_here(clean_env, capsys):
    real = socket.getaddrinfo

    def fake(host, *args, **kwargs):
        if host == "gpu01":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]
        return real(host, *args, **kwargs)

    clean_env.setattr(socket, "getaddrinfo", fake)
    line = _run_error(capsys, "--nnodes", "2", "--node-rank", "0", "--controllers", "2",
                      "--master", "gpu01:5000")  # fmt: skip
    assert "the master 'gpu01' resolves to 127.0.1.1 here, a loopback address" in line


@pytest.mark.timeout(120)
def test_a_one_node_launcher_environment_is_a_one_host_run_and_says_so(clean_env, capsys):
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    assert main(["run", "graphs.toy", "--steps", "1", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert (
        "node 0 of 1 (torchrun environment: WORLD_SIZE=1, RANK=0); one node: a one-host run" in err
    )
