"""A run across two hosts, on one machine (docs/SCALE_OUT.md).

The two "hosts" are network namespaces joined by a veth pair (``ip netns``; the test needs
root), the driver's side keeping the root namespace: a process in the other namespace can
only bind and reach that namespace's own address, so its controllers really talk tcp across
the pair. Without the rights the hosts are distinct loopback addresses instead (127.0.0.1 for
the driver, 127.0.0.2 for the other host's controllers, which bind and advertise it:
``--data-host``). Every value between hosts goes as zmq frames with CURVE. Each test waits on
processes and conditions with generous limits, never on a sleep.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from metrics_helpers import learning_values
from zmq_graphs import assert_same

from runtime.children import stop
from runtime.cli import main
from runtime.engine.engine import LocalExecutor
from runtime.errors import ControllerError
from runtime.zmq.controllers import Controllers
from runtime.zmq.driver import ZmqExecutor
from runtime.zmq.hosts import HostShare
from runtime.zmq.keys import generate_keys, load_keys
from yatt_graph.refs import load_graph

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
for _name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_NODEID"):
    ENV.pop(_name, None)


@dataclass
class Hosts:
    """Two hosts: the driver's (this process's) and another one."""

    mode: str
    """``netns`` or ``loopback``."""
    driver_ip: str
    remote_ip: str
    remote_prefix: list[str]
    """What runs a command on the other host (``ip netns exec NS``, or nothing)."""
    remote_flags: list[str]
    """Flags a controller host needs there (``--data-host 127.0.0.2`` on loopback)."""
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self, cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        """A command on the other host, its output in ``log``."""
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*self.remote_prefix, *cmd], stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, env=env or ENV, cwd=ROOT,
            )  # fmt: skip
        self.procs.append(proc)
        return proc


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def _netns_hosts() -> Iterator[Hosts | None]:
    """A namespace with a veth pair to this one, or None where that is not allowed."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        yield None
        return
    tag = os.getpid() % 100_000
    ns, here, there = f"yatt{tag}", f"yv{tag}a", f"yv{tag}b"
    net = f"10.{200 + tag % 50}.{tag % 250}"
    if _ip("netns", "add", ns).returncode != 0:
        yield None
        return
    try:
        steps = [
            ("link", "add", here, "type", "veth", "peer", "name", there, "netns", ns),
            ("addr", "add", f"{net}.1/24", "dev", here),
            ("link", "set", here, "up"),
            ("-n", ns, "addr", "add", f"{net}.2/24", "dev", there),
            ("-n", ns, "link", "set", there, "up"),
            ("-n", ns, "link", "set", "lo", "up"),
        ]
        made = all(_ip(*step).returncode == 0 for step in steps)
        hosts = Hosts("netns", f"{net}.1", f"{net}.2", ["ip", "netns", "exec", ns], [])
        try:
            yield hosts if made else None
        finally:
            stop(hosts.procs)
    finally:
        _ip("netns", "del", ns)  # removes the veth pair with it
        if _ip("link", "show", here).returncode == 0:
            _ip("link", "del", here)


def _loopback_hosts() -> Hosts:
    return Hosts("loopback", "127.0.0.1", "127.0.0.2", [], ["--data-host", "127.0.0.2"])


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    """Two namespaces where the test has the rights, else two loopback addresses (also with
    ``YATT_TEST_HOSTS=loopback``)."""
    with _netns_hosts() as found:
        if os.environ.get("YATT_TEST_HOSTS") == "loopback":
            found = None
        if found is not None:
            yield found
            return
    found = _loopback_hosts()
    try:
        yield found
    finally:
        stop(found.procs)


@pytest.fixture
def loopback() -> Iterator[Hosts]:
    found = _loopback_hosts()
    try:
        yield found
    finally:
        stop(found.procs)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> str:
    return str(generate_keys(tmp_path_factory.mktemp("multihost") / "keys"))


def _free_port(ip: str, pair: bool = False) -> int:
    """A free port on ``ip`` (and, with ``pair``, the next one free too)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        if not pair or port >= 65535:
            return port
        with socket.socket() as s:
            try:
                s.bind((ip, port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port pair on {ip}")


def _wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what} after {timeout_s:.0f}s"
        time.sleep(0.05)


def _metrics(path: Path) -> list[dict]:
    """The rows of metrics.jsonl without wall-clock and scheduling figures."""
    rows = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        rows.append(learning_values(row))
    return rows


def _assert_same_results(got: list[dict], want: list[dict]) -> None:
    """Every result both runs report is equal, bit for bit; loss and scores are among them."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):
        common = a.keys() & b.keys()
        assert {"loss", "scores/mean", "scores/std", "samples_total"} <= common
        assert {k: a[k] for k in common} == {k: b[k] for k in common}


def _one_host_metrics(tmp_path: Path, steps: int) -> list[dict]:
    out = tmp_path / "one_host"
    assert main(["run", "graphs.toy", "--steps", str(steps), "--out", str(out), "--quiet"]) == 0
    return _metrics(out / "metrics.jsonl")


def _finish(proc: subprocess.Popen, log: Path, timeout_s: float = 240.0) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        raise AssertionError(f"{proc.args} did not finish:\n{log.read_text()}") from None
    return code, log.read_text(errors="replace")


def test_the_two_hosts_are_apart(hosts):
    """A process on the other host cannot listen on the driver's address (namespaces only)."""
    if hosts.mode != "netns":
        pytest.skip("no network namespaces here (not root, or no `ip netns`): loopback addresses")
    probe = f"import socket; socket.socket().bind(({hosts.driver_ip!r}, 0))"
    there = subprocess.run([*hosts.remote_prefix, PYTHON, "-c", probe], capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert there.returncode != 0 and "Cannot assign requested address" in there.stderr
    here = subprocess.run([PYTHON, "-c", probe], capture_output=True, text=True, timeout=60)
    assert here.returncode == 0, here.stderr


# --- the launchers ------------------------------------------------------------------------------
@pytest.mark.timeout(420)
def test_a_torchrun_launch_across_two_hosts_equals_the_one_host_run(hosts, keys, tmp_path):
    """torchrun on each host (its store on MASTER_PORT, the driver on MASTER_PORT + 1)."""
    port = _free_port(hosts.driver_ip, pair=True)
    out = tmp_path / "run"
    torchrun = [str(Path(PYTHON).parent / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1"]
    torchrun += ["--master-addr", hosts.driver_ip, "--master-port", str(port)]
    yatt = ["-m", "runtime.cli", "run", "graphs/toy.py", "--steps", "3", "--controllers", "3"]
    yatt += ["--keys", keys, "--out", str(out), "--quiet"]
    remote_log, local_log = tmp_path / "node1.log", tmp_path / "node0.log"
    remote = hosts.start([*torchrun, "--node-rank", "1", *yatt, *hosts.remote_flags], remote_log)
    with open(local_log, "wb") as f:
        local = subprocess.Popen(
            [*torchrun, "--node-rank", "0", *yatt], stdin=subprocess.DEVNULL, stdout=f,
            stderr=subprocess.STDOUT, env=ENV, cwd=ROOT,
        )  # fmt: skip
    hosts.procs.append(local)
    code0, log0 = _finish(local, local_log)
    code1, log1 = _finish(remote, remote_log)
    assert code0 == 0, log0
    assert code1 == 0, log1
    driver = f"driver at {hosts.driver_ip}:{port + 1}"
    assert "node 0 of 2 (torchrun environment" in log0 and driver in log0
    assert "node 1 of 2 (torchrun environment" in log1 and "controllers 2 run here" in log1
    _assert_same_results(_metrics(out / "metrics.jsonl"), _one_host_metrics(tmp_path, 3))


@pytest.mark.timeout(420)
def test_an_srun_launch_on_loopback_addresses_equals_the_one_host_run(loopback, keys, tmp_path):
    """The Slurm variables srun sets on each node, the controllers of node 1 on 127.0.0.2."""
    port = _free_port("127.0.0.1")
    out = tmp_path / "run"
    slurm = {"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "SLURM_NTASKS": "2"}
    slurm["MASTER_PORT"] = str(port - 1)  # the driver takes MASTER_PORT + 1
    yatt = [PYTHON, "-m", "runtime.cli", "run", "graphs/toy.py", "--steps", "3"]
    yatt += ["--controllers", "3", "--keys", keys, "--out", str(out), "--quiet"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    procs = [
        loopback.start(
            yatt + (loopback.remote_flags if node else []),
            logs[node],
            env={**ENV, **slurm, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node)},
        )  # fmt: skip
        for node in (1, 0)
    ][::-1]
    results = [_finish(p, log) for p, log in zip(procs, logs, strict=True)]
    for code, log in results:
        assert code == 0, log
    assert "node 0 of 2 (Slurm environment" in results[0][1]
    assert "SLURM_JOB_NODELIST=127.0.0.[1-2] (first host)" in results[1][1]
    _assert_same_results(_metrics(out / "metrics.jsonl"), _one_host_metrics(tmp_path, 3))


# --- a training node whose ranks span the hosts --------------------------------------------------
_RANKED = ["graphs.mm_grpo", "--set", "batch_size=4", "--quiet", "--train-ranks", "4",
           "--set", "shard_reference=true", "--threads", "1"]  # fmt: skip


def _ranked_across_hosts(hosts, keys, tmp_path, steps: int) -> tuple[subprocess.Popen, ...]:
    """``yatt-graph run`` on both hosts, as a user types it: 2 controllers (one a host), the
    update trained by 4 ranks, 2 on each host; returns (node 0, node 1) and their logs."""
    port = _free_port(hosts.driver_ip)
    cmd = [str(Path(PYTHON).with_name("yatt-graph")), "run", *_RANKED, "--steps", str(steps)]
    cmd += ["--controllers", "2", "--ranks-per-host", "2", "--keys", keys, "--nnodes", "2"]
    cmd += ["--master", f"{hosts.driver_ip}:{port}"]
    logs = (tmp_path / "node0.log", tmp_path / "node1.log")
    remote = hosts.start([*cmd, "--node-rank", "1", *hosts.remote_flags], logs[1])
    with open(logs[0], "wb") as f:
        local = subprocess.Popen(
            [*cmd, "--node-rank", "0", "--out", str(tmp_path / "run"), "--checkpoint-every", "2"],
            stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=ENV, cwd=tmp_path,
        )  # fmt: skip
    hosts.procs.append(local)
    return local, remote, *logs


def _trained_policy(run: Path) -> dict:
    from runtime.train.checkpoint import load_checkpoint

    _, state = load_checkpoint(run / "checkpoints" / "step_000002")
    return state["nodes"]["grpo"]["policy"]


@pytest.mark.timeout(600)
def test_an_update_trained_by_ranks_on_two_hosts_equals_the_one_host_group(hosts, keys, tmp_path):
    """FSDP2 over 2 hosts x 2 ranks, the group meeting at the driver's store, the reference
    sharded over the same ranks, equals the same 4 ranks on one host: the weights within
    float tolerance (the sums of the gradient reduction may run in another order), the
    learning figures alike."""
    local, remote, log0, log1 = _ranked_across_hosts(hosts, keys, tmp_path, steps=2)
    code0, text0 = _finish(local, log0, timeout_s=400)
    code1, text1 = _finish(remote, log1, timeout_s=60)
    assert code0 == 0, text0
    assert code1 == 0, text1
    lines = [
        line for text in (text0, text1) for line in text.splitlines() if "of 4 on this host" in line
    ]
    assert len(lines) == 2, (text0, text1)
    assert all(line.split(": ")[1] == "nodes 'grpo', 'reference'" for line in lines), lines
    held = sorted(line.split("ranks ")[1].split(" of")[0] for line in lines)
    assert held == ["0, 1", "2, 3"]
    assert {hosts.driver_ip, hosts.remote_ip} == {
        line.split("(")[1].split(")")[0] for line in lines
    }
    one = tmp_path / "one_host"
    args = ["run", *_RANKED, "--steps", "2", "--out", str(one), "--checkpoint-every", "2"]
    assert main(args) == 0
    spread, alone = _trained_policy(tmp_path / "run"), _trained_policy(one)
    assert max(float((spread[k] - alone[k]).abs().max()) for k in alone) <= 1e-5
    got, want = _metrics(tmp_path / "run" / "metrics.jsonl"), _metrics(one / "metrics.jsonl")
    for a, b in zip(got, want, strict=True):
        for k in ("loss", "scores/mean", "grad_norm", "kl_ref"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def _process(module: str, *args: str) -> int | None:
    """The pid of the process running ``module`` with ``args`` in its command line (any host:
    the namespaces share pids)."""
    want = "".join(f"{a}\0" for a in args).encode()
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if module.encode() in cmd and want in cmd:
            return int(entry.name)
    return None


@pytest.mark.timeout(600)
def test_a_killed_rank_on_the_other_host_is_named(hosts, keys, tmp_path):
    """Rank 3 runs on the host without the update: its controller sees it die and tells rank
    0 through the group's store, and the run stops naming it (not at a collective timeout)."""
    local, remote, log0, log1 = _ranked_across_hosts(hosts, keys, tmp_path, steps=10_000)
    metrics = tmp_path / "run" / "metrics.jsonl"
    _wait_until(lambda: metrics.exists() and metrics.read_text().strip(), "a first step", 400)
    said = re.search(r"the store at (\S+)", log0.read_text() + log1.read_text())
    assert said is not None, log0.read_text()
    pid = _process("runtime.ranks.worker", "--store", said.group(1), "--rank", "3")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    try:
        code0, text0 = _finish(local, log0, timeout_s=120)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- node 1:\n{log1.read_text()}") from None
    assert code0 != 0
    hosts_ = "|".join(re.escape(ip) for ip in (hosts.driver_ip, hosts.remote_ip))
    assert re.search(
        rf"rank 3 \(pid {pid}\) was killed by SIGKILL \(9\) on host ({hosts_})", text0
    ), text0
    _finish(remote, log1, timeout_s=120)


# --- rollout replicas on both hosts ---------------------------------------------------------------
_REPLICATED = ["graphs.mm_grpo", "--set", "batch_size=4", "--quiet", "--threads", "1",
               "--no-adaptive", "--replicas", "rollout=2", "--samples-every", "1"]  # fmt: skip


@pytest.mark.timeout(600)
def test_a_replica_on_the_other_host_serves_its_share_and_a_lost_one_is_named(
    hosts, keys, tmp_path
):
    """``--replicas rollout=2 --replicas-per-host 1`` over two hosts: the second copy runs on
    the host without the rollout's controller and samples its pieces; killed after two steps,
    it is named with its host, its pieces go to the node's own copy, and the run ends as the
    one-host run does."""
    port = _free_port(hosts.driver_ip)
    cmd = [str(Path(PYTHON).with_name("yatt-graph")), "run", *_REPLICATED, "--steps", "4"]
    cmd += ["--controllers", "2", "--keys", keys, "--nnodes", "2", "--replicas-per-host", "1"]
    cmd += ["--master", f"{hosts.driver_ip}:{port}"]
    log0, log1 = tmp_path / "node0.log", tmp_path / "node1.log"
    remote = hosts.start([*cmd, "--node-rank", "1", *hosts.remote_flags], log1)
    out = tmp_path / "run"
    with open(log0, "wb") as f:
        local = subprocess.Popen(
            [*cmd, "--node-rank", "0", "--out", str(out)],
            stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=ENV, cwd=tmp_path,
        )  # fmt: skip
    hosts.procs.append(local)
    metrics = out / "metrics.jsonl"
    _wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2,
                "two steps", 400)  # fmt: skip
    pattern = r"replicas 1 of 2 on this host \((\S+)\), replica 0 on controller \d+ \((\S+)\)"
    said = re.search(pattern + r", the store at (\S+)", log0.read_text() + log1.read_text())
    assert said is not None, (log0.read_text(), log1.read_text())
    assert {said.group(1), said.group(2)} == {hosts.driver_ip, hosts.remote_ip}  # hosts apart
    pid = _process("runtime.zmq.replica_main", "--store", said.group(3))
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    code0, text0 = _finish(local, log0, timeout_s=300)
    code1, text1 = _finish(remote, log1, timeout_s=60)
    assert code0 == 0, text0
    assert code1 == 0, text1
    killed = rf"replica 1 of node 'rollout' \(pid {pid}\) was killed by SIGKILL \(9\) on host "
    assert re.search(killed + re.escape(said.group(1)), text0 + text1), text0 + text1
    assert "its pieces go to the node's 1 other copy" in text0 + text1
    import pyarrow.parquet as pq

    rows = pq.read_table(out / "samples").to_pylist()
    assert {r["replica"] for r in rows if r["step"] == 0} == {0, 1}  # the other host sampled
    assert {r["replica"] for r in rows if r["step"] == 3} == {0}  # its share, on the node
    one = tmp_path / "one_host"
    flags = ["--steps", "4", "--controllers", "2", "--out", str(one)]
    assert main(["run", *_REPLICATED, *flags]) == 0
    # weight_sync/bytes is what the copy that ran a step's first piece loaded (a copy that
    # has the version loads nothing): which copy that is, is the scheduler's, not a result.
    moved = lambda rows: [{k: v for k, v in r.items() if k != "weight_sync/bytes"} for r in rows]  # noqa: E731
    _assert_same_results(moved(_metrics(metrics)), moved(_metrics(one / "metrics.jsonl")))


# --- the driver in this process, controllers on both hosts --------------------------------------
def _remote_node(hosts: Hosts, graph: str, address_port: int, controllers: int, keys: str,
                 log: Path) -> subprocess.Popen:  # fmt: skip
    """Node 1 of 2 on the other host: ``yatt-graph run`` with only controller work to do."""
    cmd = [PYTHON, "-m", "runtime.cli", "run", graph, "--nnodes", "2", "--node-rank", "1"]
    cmd += ["--master", f"{hosts.driver_ip}:{address_port}", "--controllers", str(controllers)]
    return hosts.start([*cmd, "--keys", keys, *hosts.remote_flags], log)


@contextlib.contextmanager
def _across_hosts(hosts, keys, tmp_path, kind, **options):
    """A driver here for ``zmq_graphs`` ``kind`` on 2 controllers, controller 1 started on the
    other host: yields (the executor, the remote node's process, its log)."""
    port = _free_port(hosts.driver_ip)
    address = f"tcp://{hosts.driver_ip}:{port}"
    log = tmp_path / "node1.log"
    remote = _remote_node(hosts, "zmq_graphs", port, 2, keys, log)
    here = HostShare([0], address, keys_dir=keys, allow_remote=hosts.mode == "netns")
    try:
        with ZmqExecutor(
            load_graph("zmq_graphs", kind=kind).plan(2), spawn=False, address=address,
            allow_tcp=True, allow_remote=hosts.mode == "netns", keys=keys, **options,
        ) as ex:  # fmt: skip
            yield ex, remote, log
    finally:
        here.stop()


@pytest.mark.timeout(300)
def test_controllers_on_two_hosts_carry_every_value_bitwise(hosts, keys, tmp_path):
    """Images, a 2.4 MB tensor, bfloat16, strided views and Structs cross the hosts as frames."""
    reference = LocalExecutor(load_graph("zmq_graphs", kind="rich").plan(2)).run(3)
    with _across_hosts(hosts, keys, tmp_path, "rich") as (ex, remote, log):
        assert ex.controllers[0].data_address.startswith(f"tcp://{hosts.driver_ip}:")
        assert ex.controllers[1].data_address.startswith(f"tcp://{hosts.remote_ip}:")
        results = ex.run(3)
    code, text = _finish(remote, log)
    assert code == 0, text
    for ref, got in zip(reference, results, strict=True):
        assert_same(ref.outputs, got.outputs)


@pytest.mark.timeout(300)
def test_a_killed_remote_controller_is_detected_and_named(hosts, keys, tmp_path):
    with _across_hosts(hosts, keys, tmp_path, "feedback", heartbeat_timeout_s=10.0) as (
        ex, remote, log,
    ):  # fmt: skip
        ex.run(2)
        victim = ex.controllers[1]
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(ControllerError) as caught:
            ex.run(10_000)  # every step needs the dead controller's node
    assert caught.value.controller == 1 and caught.value.nodes == ["acc"]
    assert f"controller 1 (pid {victim.pid}) has sent nothing" in str(caught.value)
    code, text = _finish(remote, log)
    assert code == 1
    assert f"controller 1 (pid {victim.pid} on node 1) was killed by SIGKILL" in text


@pytest.mark.timeout(300)
def test_controllers_with_the_wrong_keys_are_refused_and_the_driver_says_so(
    hosts, keys, tmp_path, caplog
):
    """Other keys altogether, and the run's public driver key with a key pair of one's own."""
    theirs = generate_keys(tmp_path / "theirs")
    forged = generate_keys(tmp_path / "forged")
    shutil.copy(Path(keys) / "driver.key", forged / "driver.key")  # public: on every host
    port = _free_port(hosts.driver_ip)
    address = f"tcp://{hosts.driver_ip}:{port}"
    with caplog.at_level(logging.WARNING, logger="yatt_graph.runtime"):
        group = Controllers(2, address=address, keys=load_keys(keys, "driver"),
                                keys_dir=keys, spawn=False)  # fmt: skip
        try:
            for name, folder in (("theirs", theirs), ("forged", forged)):
                log = tmp_path / f"{name}.log"
                cmd = [PYTHON, "-m", "runtime.zmq.controller_main", "--connect", address]
                cmd += ["--index", "1", "--keys", str(folder), "--startup-timeout", "120"]
                if hosts.mode == "netns":
                    cmd += ["--allow-remote"]
                else:
                    cmd += ["--bind", f"tcp://{hosts.remote_ip}:*"]
                code, text = _finish(hosts.start(cmd, log), log)
                assert code == 3, text
                assert "the CURVE handshake with the driver" in text, text
            _wait_until(lambda: group.link.handshake_failures >= 2, "the driver's count")
            assert group.res.auth.denied >= 1  # the forged key pair: refused by the authenticator
            assert all(c.identity is None for c in group.controllers)  # nobody was admitted
            # The run's own controllers still get in, and the run goes on.
            log = tmp_path / "node1.log"
            remote = _remote_node(hosts, "graphs.toy", port, 2, keys, log)
            here = HostShare([0], address, keys_dir=keys, allow_remote=hosts.mode == "netns")
            try:
                with ZmqExecutor(load_graph("graphs.toy", seed=1).plan(2), group=group) as ex:
                    results = ex.run(2)
            finally:
                here.stop()
        finally:
            group.shutdown("the test ended")
    assert "a peer whose handshake failed" in caplog.text
    assert "refused a CURVE client" in caplog.text
    code, text = _finish(remote, log)
    assert code == 0, text
    reference = LocalExecutor(load_graph("graphs.toy", seed=1).plan(1)).run(2)
    for ref, got in zip(reference, results, strict=True):
        assert torch.equal(ref.outputs["scores"], got.outputs["scores"])


@pytest.mark.timeout(180)
def test_sigterm_to_a_controller_host_stops_its_controllers_and_names_them(tmp_path):
    """What srun does to a cancelled job: the host's yatt-graph run passes SIGTERM on."""
    import psutil

    log = tmp_path / "node1.log"
    port = _free_port("127.0.0.1")  # no driver there: the controllers wait for one
    cmd = [PYTHON, "-m", "runtime.cli", "run", "graphs.toy", "--nnodes", "2", "--node-rank", "1"]
    cmd += ["--master", f"127.0.0.1:{port}", "--controllers", "3"]
    with open(log, "wb") as out:
        agent = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)  # fmt: skip
    try:
        _wait_until(lambda: "controllers 2 run here" in log.read_text(), "the host's line")
        [child] = psutil.Process(agent.pid).children()
        agent.send_signal(signal.SIGTERM)
        code, text = _finish(agent, log, timeout_s=60)
    finally:
        stop([agent])
    assert code == 1, text
    assert f"controller 2 (pid {child.pid} on node 1) was killed by SIGTERM" in text
    assert not psutil.pid_exists(child.pid) or child.status() == psutil.STATUS_ZOMBIE
