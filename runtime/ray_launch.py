"""``yatt-graph run GRAPH --ray [ADDRESS]``: a Ray cluster as the launcher of a run across hosts.

Ray only starts and ends the processes; the run is the multi-host launch of
docs/SCALE_OUT.md, controllers joining the driver over tcp with CURVE keys and passing the
dataflow to each other over ZeroMQ. This process (the user's ``yatt-graph run``):

1. connects to the cluster (``ray.init(address)``) and makes a placement group of one bundle
   per node (``--nnodes N``, default: the cluster's nodes with CPUs, at most ``--controllers``):
   each bundle holds that node's share of the controllers (:func:`runtime.flags.controller_shares`),
   one CPU per controller and, where the run uses GPUs, one GPU per controller. The bundles go
   on N distinct nodes (``STRICT_SPREAD``) when the cluster has N nodes, else as spread as Ray
   can (``SPREAD``). Bundle 0 goes on this machine when it is a node of the cluster that can
   hold it, so that the run folder is written here;
2. starts one :class:`NodeProcess` actor per bundle, asks actor 0 for its node's address and a
   free port there (the master), and has every actor start the command line the user typed,
   but for ``--ray``, with ``--nnodes N --node-rank R --master HOST:PORT``
   (``python -m runtime.ray_node``, in this process's working folder, with this process's
   Python and ``sys.path``: every node runs the same code from the same folder);
3. prints their output as it comes (node 0's as it is, the others' behind ``[node R]``),
   returns node 0's exit code, and ends every node when node 0 ends, when one fails, on Ctrl-C
   or SIGTERM, and when this process dies (Ray ends a driver's actors, and each node's process
   exits with its actor).

Keys: ``--keys DIR`` is passed on as it is (the folder must be on every node). Without it, a
key folder is made for the run and its files travel to each actor through Ray, which writes
them into a private temporary folder on its node (node 0 alone gets the driver's secret) and
deletes it when the node ends: no shared filesystem is needed for them.

Ray is imported only here, and only for a run with ``--ray``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.children import exit_text, python_env
from runtime.flags import NO_RAY, LaunchError, RunSpec, controller_shares, split_host_port

__all__ = [
    "LAUNCHER_VARIABLES",
    "NodeProcess",
    "PLACEMENT_TIMEOUT_S",
    "node_argv",
    "node_bundles",
    "run_on_ray",
]

PLACEMENT_TIMEOUT_S = 120.0
"""How long Ray may take to place the bundles (an autoscaler may be adding nodes)."""
END_GRACE_S = 30.0
"""How long the other nodes may take to end once node 0 ended or one node failed (the driver
notices a dead controller by its heartbeats within seconds and stops the run)."""
READ_WAIT_S = 0.5
"""How long one read of an actor's output waits for a line."""
ACTOR_DIED = -1000
"""The exit code recorded for a node whose actor died (its Ray node went away)."""

LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "NODE_RANK", "NNODES", "LOCAL_RANK",
    "MASTER_ADDR", "MASTER_PORT", "SLURM_NODEID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
    "SLURM_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
    "SLURM_LOCALID", "SLURM_PROCID",
)  # fmt: skip
"""Another launcher's variables, left out of a node's environment: a raylet started under
srun or torchrun passes them to its actors, and a node would read them as its launch."""


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise LaunchError(NO_RAY) from None
    return ray


def node_argv(argv: Sequence[str], nnodes: int, rank: int, master: str) -> list[str]:
    """The command line a node runs: ``argv`` (``run GRAPH ...``, as typed) without ``--ray``
    and its address, with the node's place (the last of a flag given twice wins)."""
    words, out, i = list(argv), [], 0
    while i < len(words):
        word = words[i]
        if word == "--ray":
            nxt = words[i + 1] if i + 1 < len(words) else "-"
            i += 1 if nxt.startswith("-") else 2  # argparse took the next word if not a flag
            continue
        if not word.startswith("--ray="):
            out.append(word)
        i += 1
    return [*out, "--nnodes", str(nnodes), "--node-rank", str(rank), "--master", master]


def node_bundles(controllers: int, nnodes: int, gpus_per_controller: int) -> list[dict[str, float]]:
    """One Ray bundle per node: one CPU (and ``gpus_per_controller`` GPUs) per controller of
    the node's share (``5, 2, 0 -> [{CPU: 3}, {CPU: 2}]``)."""
    bundles = []
    for share in controller_shares(controllers, nnodes):
        bundle = {"CPU": float(len(share))}
        if gpus_per_controller:
            bundle["GPU"] = float(gpus_per_controller * len(share))
        bundles.append(bundle)
    return bundles


def _gpus_per_controller(device: str, cluster: dict[str, float], controllers: int) -> int:
    """``cuda``: one GPU per controller; ``auto``: the same when the cluster has that many."""
    if device == "cuda" or (device == "auto" and cluster.get("GPU", 0) >= controllers):
        return 1
    return 0


class NodeProcess:
    """A Ray actor on one node: starts that node's ``yatt-graph run``, hands its output lines
    to :meth:`read`, and ends it (:meth:`stop`). Made a Ray actor by :func:`run_on_ray`
    (threaded, so that :meth:`stop` runs while a :meth:`read` waits)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._lines: queue.Queue[tuple[int, str]] = queue.Queue()
        self._readers: list[threading.Thread] = []
        self._keys_dir: str | None = None

    def where(self) -> tuple[str, int]:
        """This node's address and a port free on it now (for the driver, on node 0)."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def start(
        self, python: str, cwd: str, args: list[str], env: dict[str, str | None],
        keys: dict[str, tuple[bytes, int]] | None,
    ) -> int:  # fmt: skip
        """``python -m runtime.ray_node`` with ``args`` in ``cwd``; this actor's environment
        without another launcher's variables, and ``env`` over it (None: removed); the key
        files ``keys`` (name -> content, mode), when given, in a private folder passed as
        ``--keys``. Returns the process id; ValueError when the node lacks the folder or
        the Python."""
        import ray

        ip = ray.util.get_node_ip_address()
        for path, what in ((python, "the Python"), (cwd, "the working folder")):
            if not os.path.exists(path):
                raise ValueError(
                    f"the Ray node at {ip} has no {path} ({what} of `yatt-graph run --ray`): "
                    "every node runs the same code from the same folder (docs/SCALE_OUT.md)"
                )
        child_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
        for name, value in env.items():
            if value is None:
                child_env.pop(name, None)
            else:
                child_env[name] = value
        if keys:
            self._keys_dir = tempfile.mkdtemp(prefix="yatt-graph-keys-")  # mode 0700
            for name, (content, mode) in keys.items():
                path = Path(self._keys_dir, name)
                path.parent.mkdir(mode=0o700, exist_ok=True)
                path.write_bytes(content)
                path.chmod(mode)
            args = [*args, "--keys", self._keys_dir]
        self._proc = subprocess.Popen(
            [python, "-m", "runtime.ray_node", str(os.getpid()), *args], cwd=cwd,
            env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        for stream, pipe in ((1, self._proc.stdout), (2, self._proc.stderr)):
            reader = threading.Thread(target=self._read, args=(stream, pipe), daemon=True)
            reader.start()
            self._readers.append(reader)
        return self._proc.pid

    def _read(self, stream: int, pipe: Any) -> None:
        for line in pipe:
            self._lines.put((stream, line.decode(errors="replace").rstrip("\r\n")))

    def read(self, wait_s: float) -> tuple[list[tuple[int, str]], int | None]:
        """The output lines since the last read as ``(stream, text)`` (1 stdout, 2 stderr),
        waiting up to ``wait_s`` for the first; and the exit code once the process ended and
        every line was read, else None."""
        lines = []
        with contextlib.suppress(queue.Empty):
            lines.append(self._lines.get(timeout=wait_s))
            while len(lines) < 1000:
                lines.append(self._lines.get_nowait())
        proc = self._proc
        ended = proc is not None and proc.poll() is not None
        if ended and not any(r.is_alive() for r in self._readers) and self._lines.empty():
            return lines, proc.returncode
        return lines, None

    def terminate(self) -> None:
        """SIGTERM to the node's process: node 0 stops the run at a step boundary, another
        node stops its controllers."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()

    def stop(self, grace_s: float) -> None:
        """End the node's process (SIGTERM, then SIGKILL after ``grace_s``) and delete its
        keys."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if self._keys_dir is not None:
            shutil.rmtree(self._keys_dir, ignore_errors=True)


def _connect(ray: Any, address: str) -> None:
    """``ray.init`` at ``address``; LaunchError when no cluster is there (a HOST:PORT with
    nothing listening is said at once, not after Ray's retries)."""
    probe = None if address == "auto" or "://" in address else split_host_port(address, "--ray")
    try:
        if probe is not None:
            socket.create_connection(probe, timeout=5).close()
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (OSError, RuntimeError, ValueError) as exc:  # (ConnectionError is an OSError)
        said = getattr(exc, "strerror", None) or str(exc).strip().partition("\n")[0]
        raise LaunchError(
            f"--ray {address}: no Ray cluster there ({said or type(exc).__name__}); start one "
            "(`ray start --head`) or give its address (--ray HOST:PORT, or RAY_ADDRESS)"
        ) from None


def _key_files(keys_dir: str | None) -> dict[str, tuple[bytes, int]] | None:
    """A new key folder's files as name -> (content, mode), for the nodes; None with
    ``--keys`` (passed on as it is)."""
    if keys_dir:
        return None
    from runtime.zmq.keys import generate_keys

    with tempfile.TemporaryDirectory() as tmp:
        root = generate_keys(Path(tmp, "keys"))
        return {
            str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mode & 0o777)
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }


class _Nodes:
    """The run's actors, one per node, and their output."""

    def __init__(self, ray: Any, actors: list[Any], ips: list[str]) -> None:
        self.ray, self.actors, self.ips = ray, actors, ips
        self.codes: dict[int, int] = {}
        self.stopping = False
        self._reads = {a.read.remote(READ_WAIT_S): r for r, a in enumerate(actors)}

    def _show(self, rank: int, lines: list[tuple[int, str]]) -> None:
        for stream, text in lines:
            out = sys.stdout if stream == 1 else sys.stderr
            print(text if rank == 0 else f"[node {rank}] {text}", file=out, flush=True)

    def pump(self, until: float | None = None) -> None:
        """Print output as it comes until every node ended (or ``until``, a monotonic
        time); the others get :data:`END_GRACE_S` once node 0 ended or one failed."""
        while self._reads and (until is None or time.monotonic() < until):
            ready, _ = self.ray.wait(list(self._reads), num_returns=1, timeout=1.0)
            for ref in ready:
                rank = self._reads.pop(ref)
                try:
                    lines, code = self.ray.get(ref)
                except self.ray.exceptions.RayError as exc:  # the actor or its node is gone
                    lines, code = [], ACTOR_DIED
                    print(f"yatt-graph run: node {rank} (at {self.ips[rank]}): its Ray actor "
                          f"died ({type(exc).__name__})", file=sys.stderr, flush=True)  # fmt: skip
                self._show(rank, lines)
                if code is None:
                    self._reads[self.actors[rank].read.remote(READ_WAIT_S)] = rank
                else:
                    self._ended(rank, code)
            if until is None and (0 in self.codes or any(self.codes.values())):
                until = time.monotonic() + END_GRACE_S
        for rank in sorted(self._reads.values()):
            print(f"yatt-graph run: node {rank} (at {self.ips[rank]}) is still running; "
                  "stopping it", file=sys.stderr, flush=True)  # fmt: skip

    def _ended(self, rank: int, code: int) -> None:
        self.codes[rank] = code
        if code not in (0, ACTOR_DIED) and not self.stopping:  # (a stop's SIGTERM: said)
            print(f"yatt-graph run: node {rank} (at {self.ips[rank]}) {exit_text(code)}",
                  file=sys.stderr, flush=True)  # fmt: skip

    def stop_run(self) -> None:
        """SIGTERM to node 0: its driver stops the run at a step boundary and sends every
        controller SHUTDOWN, so the other nodes end by themselves (a SIGTERM to them too
        would end their controllers first, and the driver would report them dead)."""
        self.stopping = True
        self.actors[0].terminate.remote()

    def exit_code(self) -> int:
        """Node 0's exit code, or 1 when it did not end cleanly or another node failed."""
        first = self.codes.get(0)
        if first is None or first < 0:
            return 1
        return first or (1 if any(self.codes.values()) else 0)


def run_on_ray(spec: RunSpec, argv: Sequence[str]) -> int:
    """``yatt-graph run ... --ray [ADDRESS]`` (``argv``: the words after ``yatt-graph``, as
    typed): the run on the Ray cluster at ``spec.launch.ray``, one node per bundle of a
    placement group (see the module's doc). Returns the exit code; LaunchError for a launch
    that cannot work (Ray missing, no cluster, bundles that Ray cannot place)."""
    from runtime.train.loop import sigterm_as_interrupt

    if (
        not argv
        or argv[0] != "run"
        or not any(w == "--ray" or w.startswith("--ray=") for w in argv)
    ):
        raise LaunchError(
            "--ray starts the command line it was typed on, on each node: run it as a command "
            "(`yatt-graph run GRAPH ... --ray`)"
        )
    ray = _ray()
    launch = spec.launch
    _connect(ray, launch.ray or "auto")
    nodes: _Nodes | None = None
    actors: list[Any] = []
    group = None
    try:
        group, actors, ips, master = _place(ray, spec)
        nnodes = len(actors)
        keys = _key_files(launch.keys) if nnodes > 1 else None  # (one node: a one-host run)
        env: dict[str, str | None] = {
            "PYTHONPATH": python_env()["PYTHONPATH"], "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),  # (Ray sets its own)
        }  # fmt: skip
        starts = [
            actor.start.remote(
                sys.executable,
                os.getcwd(),
                node_argv(argv, nnodes, rank, master),
                env,
                None
                if keys is None
                else {k: v for k, v in keys.items() if rank == 0 or k != "driver.key_secret"},
            )  # fmt: skip
            for rank, actor in enumerate(actors)
        ]
        try:
            ray.get(starts)
        except ray.exceptions.RayTaskError as exc:
            raise LaunchError(str(getattr(exc, "cause", exc))) from None
        nodes = _Nodes(ray, actors, ips)
        with sigterm_as_interrupt():
            try:
                nodes.pump()
            except KeyboardInterrupt:
                print("yatt-graph run: stopping every node", file=sys.stderr, flush=True)
                nodes.stop_run()
                nodes.pump(until=time.monotonic() + END_GRACE_S)
                raise
        return nodes.exit_code()
    finally:
        _close(ray, actors, group)


def _place(ray: Any, spec: RunSpec) -> tuple[Any, list[Any], list[str], str]:
    """The placement group, one actor per bundle, their nodes' addresses and the master
    (``IP:PORT`` on node 0); one line says it."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    launch = spec.launch
    alive = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0]
    nnodes = launch.ray_nodes or max(1, min(len(alive), launch.controllers))
    gpus = _gpus_per_controller(spec.engine.device, ray.cluster_resources(), launch.controllers)
    bundles = node_bundles(launch.controllers, nnodes, gpus)
    strategy = "STRICT_SPREAD" if len(alive) >= nnodes else "SPREAD"
    here = ray.util.get_node_ip_address()
    if any(
        n["NodeManagerAddress"] == here
        and all(n["Resources"].get(k, 0) >= v for k, v in bundles[0].items())
        for n in alive
    ):
        bundles[0][f"node:{here}"] = 0.001  # node 0 on this machine: its run folder is here
    group = placement_group(bundles, strategy=strategy)
    said = "; ".join(
        f"node {r}: " + ", ".join(f"{k} {v:g}" for k, v in b.items() if not k.startswith("node:"))
        for r, b in enumerate(bundles)
    )
    if not group.wait(PLACEMENT_TIMEOUT_S):
        have = ray.available_resources()
        raise LaunchError(
            f"Ray could not place {nnodes} bundles ({said}; {strategy}) within "
            f"{PLACEMENT_TIMEOUT_S:g} s: the cluster has {len(alive)} nodes with CPUs, "
            f"CPU {have.get('CPU', 0):g} and GPU {have.get('GPU', 0):g} free; lower --nnodes "
            "or --controllers, or add nodes"
        )
    actor_class = ray.remote(NodeProcess)
    actors = [
        actor_class.options(
            num_cpus=b["CPU"],
            num_gpus=b.get("GPU", 0),
            max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=r
            ),
        ).remote()  # fmt: skip
        for r, b in enumerate(bundles)
    ]
    places = ray.get([a.where.remote() for a in actors])
    ips = [ip for ip, _ in places]
    master = f"{places[0][0]}:{places[0][1]}"
    keys = f"--keys {launch.keys}" if launch.keys else "keys made for the run"
    print(
        f"yatt-graph run: Ray at {launch.ray}: {nnodes} nodes in a placement group ({said}; "
        f"{strategy}), at {', '.join(ips)}; the driver on node 0 at {master}; CURVE {keys}",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    return group, actors, ips, master


def _close(ray: Any, actors: list[Any], group: Any) -> None:
    """End every node's process, then its actor, the placement group and the connection."""
    with contextlib.suppress(Exception):
        ray.wait([a.stop.remote(5.0) for a in actors], num_returns=len(actors), timeout=20)
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor)
    if group is not None:
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):
            remove_placement_group(group)
    with contextlib.suppress(Exception):
        ray.shutdown()
