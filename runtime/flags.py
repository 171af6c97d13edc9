"""The flags of ``yatt-graph run`` and ``yatt-graph controller``, their checks
(:func:`check_flags`: every number and choice, before the graph is built), and where this
process stands in a run that spans hosts (:func:`resolve_launch`).

The launch: how many nodes, which one this is, and the driver's address; pure functions of
the flags and an environment mapping (docs/SCALE_OUT.md). Read from the flags ``--nnodes N --node-rank R --master HOST:PORT`` first; what they leave
out comes from the launcher's environment, when there is one:

* torchrun-style: ``RANK`` of ``WORLD_SIZE`` (else ``GROUP_RANK`` of ``GROUP_WORLD_SIZE``,
  else ``NODE_RANK`` of ``NNODES``), ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``;
* Slurm (under ``srun``, one task per node): ``SLURM_NODEID`` of ``SLURM_NNODES`` (or
  ``SLURM_JOB_NUM_NODES``); the master is ``MASTER_ADDR``, else the first host of
  ``SLURM_NODELIST`` (or ``SLURM_JOB_NODELIST``), expanded here (:func:`expand_nodelist`).

torchrun-style variables win over Slurm's (``srun torchrun ...`` sets both). A port read
from ``MASTER_PORT`` is the driver's port plus one: torchrun's own store listens on
``MASTER_PORT`` itself, and torch.distributed groups may use it. ``--master HOST:PORT`` is
the driver's address exactly.

Node 0 runs the driver and its share of the controllers; every other node runs only its
share (:func:`controller_shares`: contiguous blocks of controller indices, in node order).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from runtime.engine.config import DEFAULT_MAX_MESSAGE_BYTES, OFFLOAD_MODES, RunConfig
from runtime.sched.placement import SIDES
from runtime.train.run_folder import run_folder_of
from runtime.train.wandb_log import NO_WANDB
from runtime.zmq import STARTUP_TIMEOUT_S
from yatt_graph import UsageError

__all__ = [
    "add_controller_arguments",
    "Launch",
    "LaunchError",
    "NO_RAY",
    "add_launch_arguments",
    "add_run_arguments",
    "GraphArgs",
    "LaunchSettings",
    "NAMED_OPTIONS",
    "RunSpec",
    "TrainSettings",
    "CheckedFlags",
    "check_flags",
    "graph_args",
    "run_spec",
    "controller_shares",
    "expand_nodelist",
    "parse_slots",
    "parse_pins",
    "refuse_per_host",
    "resolve_launch",
    "same_folder",
    "split_host_port",
]


class LaunchError(UsageError):
    """A launch that cannot work (a missing, bad or contradictory value); names the flag or
    variable and says what to do."""


@dataclass(frozen=True)
class Launch:
    """This process's place in a run across hosts."""

    nnodes: int
    """How many nodes (hosts, or launcher processes) the run spans."""
    node_rank: int
    """Which of them this is; 0 runs the driver."""
    host: str
    """The driver's host, as given (a name or an address); "" for a one-node run."""
    port: int
    """The driver's port (0 for a one-node run)."""
    source: str
    """Where the values came from: ``flags``, ``torchrun environment``, ``Slurm environment``,
    or flags and one of those."""
    detail: str
    """The variables and flags read, as ``NAME=value`` pairs, for the one line that says so."""
    local_rank: int | None = None
    """``LOCAL_RANK`` (torchrun) or ``SLURM_LOCALID``, when set: for messages only."""

    @property
    def master(self) -> str:
        """``HOST:PORT`` of the driver."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def describe(self) -> str:
        """One line: node R of N, from where, and the driver's address."""
        where = f"; driver at {self.master}" if self.nnodes > 1 else "; one node: a one-host run"
        return f"node {self.node_rank} of {self.nnodes} ({self.source}: {self.detail}){where}"


def split_host_port(text: str, who: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as ``(host, port)``; LaunchError naming ``who``."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"{who} {text!r}: expected HOST:PORT with a port in 1..65535")
    return host, int(port)


# --- Slurm node lists ---------------------------------------------------------------------------
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _top_level_split(text: str, who: str) -> list[str]:
    """``a[1,2],b`` -> ``["a[1,2]", "b"]``: commas inside brackets stay."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise LaunchError(f"{who}={text!r}: nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"{who}={text!r}: ']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise LaunchError(f"{who}={text!r}: a '[' is not closed")
    parts.append(text[start:])
    return parts


def _expand_brackets(spec: str, text: str, who: str) -> list[str]:
    """``gpu[01-03,07]-ib`` -> every name; each bracket is one or more ranges."""
    names = [""]
    for literal, inside in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", spec):
        values = [literal]
        if inside:
            values = []
            for item in inside.split(","):
                match = _RANGE.match(item.strip())
                if not match:
                    raise LaunchError(
                        f"{who}={text!r}: {item!r} in [{inside}] is not N or N-M (numbers only)"
                    )
                first, last = match.group(1), match.group(2) or match.group(1)
                if int(last) < int(first):
                    raise LaunchError(f"{who}={text!r}: the range {item!r} runs backwards")
                width = len(first)  # zero padding as written: 01-03 -> 01, 02, 03
                values += [literal + str(n).zfill(width) for n in range(int(first), int(last) + 1)]
        names = [n + v for n in names for v in values]
    return names


def expand_nodelist(text: str, who: str = "SLURM_NODELIST") -> list[str]:
    """A Slurm host list (``gpu[01-03,07],cpu5``) as host names in order, without scontrol."""
    hosts: list[str] = []
    for spec in _top_level_split(text.strip(), who):
        if not spec.strip():
            raise LaunchError(f"{who}={text!r}: an empty host name (two commas in a row?)")
        hosts += _expand_brackets(spec.strip(), text, who)
    return hosts


# --- the environment ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Value:
    value: int | str
    label: str  # e.g. "RANK=1" or "--nnodes 2"


def _int(env: Mapping[str, str], name: str) -> _Value | None:
    text = env.get(name)
    if text is None or text == "":
        return None
    try:
        return _Value(int(text), f"{name}={text}")
    except ValueError:
        raise LaunchError(
            f"{name}={text!r} is not an integer; fix the launcher's environment"
        ) from None


_TORCHRUN_PAIRS = (
    ("RANK", "WORLD_SIZE"),
    ("GROUP_RANK", "GROUP_WORLD_SIZE"),
    ("NODE_RANK", "NNODES"),
)


def _from_torchrun(env: Mapping[str, str]) -> dict[str, _Value] | None:
    for rank_name, size_name in _TORCHRUN_PAIRS:
        rank, size = _int(env, rank_name), _int(env, size_name)
        if rank is None and size is None:
            continue
        if rank is None or size is None:
            have, missing = (rank_name, size_name) if rank is not None else (size_name, rank_name)
            raise LaunchError(
                f"{have}={env[have]} is set but {missing} is not; a launch across hosts needs "
                f"both (torchrun sets them), or pass --nnodes and --node-rank"
            )
        found = {"nnodes": size, "node_rank": rank, "local_rank": _int(env, "LOCAL_RANK")}
        return {k: v for k, v in found.items() if v is not None}
    return None


def _from_slurm(env: Mapping[str, str]) -> dict[str, _Value] | None:
    rank = _int(env, "SLURM_NODEID")
    if rank is None:  # no srun task (a login node, an salloc shell): not a launch
        return None
    size = _int(env, "SLURM_NNODES") or _int(env, "SLURM_JOB_NUM_NODES")
    if size is None:
        raise LaunchError(
            f"{rank.label} is set but SLURM_NNODES and SLURM_JOB_NUM_NODES are not; "
            "launch with srun inside an allocation, or pass --nnodes"
        )
    found = {"nnodes": size, "node_rank": rank}
    tasks = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
    if tasks is not None and int(tasks.value) > int(size.value):
        raise LaunchError(
            f"{tasks.label} on {size.label}: each task would start its node's controllers again; "
            "start one task per node (srun --ntasks-per-node=1)"
        )
    for name in ("SLURM_NODELIST", "SLURM_JOB_NODELIST"):
        if env.get(name):
            hosts = expand_nodelist(env[name], name)
            found["host"] = _Value(hosts[0], f"{name}={env[name]} (first host)")
            if len(hosts) != int(size.value):
                raise LaunchError(
                    f"{name}={env[name]} names {len(hosts)} hosts but {size.label}; "
                    "run inside one allocation"
                )
            break
    found["local_rank"] = _int(env, "SLURM_LOCALID")
    return {k: v for k, v in found.items() if v is not None}


def _master_from_env(env: Mapping[str, str], found: dict[str, _Value]) -> None:
    if env.get("MASTER_ADDR"):
        found["host"] = _Value(env["MASTER_ADDR"], f"MASTER_ADDR={env['MASTER_ADDR']}")
    port = _int(env, "MASTER_PORT")
    if port is not None:
        if not 0 < int(port.value) < 65535:
            raise LaunchError(f"{port.label} is not a port in 1..65534")
        found["port"] = _Value(
            int(port.value) + 1, f"{port.label} (the driver takes MASTER_PORT + 1)"
        )


def resolve_launch(
    nnodes: int | None, node_rank: int | None, master: str | None, env: Mapping[str, str]
) -> Launch | None:
    """The launch the flags and ``env`` describe; None when neither describes one (a plain
    one-host run). LaunchError for a missing, bad or contradictory value."""
    kind, found = "", None
    for name, read in (
        ("torchrun environment", _from_torchrun),
        ("Slurm environment", _from_slurm),
    ):
        found = read(env)
        if found is not None:
            kind = name
            break
    given = nnodes is not None or node_rank is not None or master is not None
    if found is None and not given:
        return None
    found = dict(found or {})
    _master_from_env(env, found)
    for field, flag, value in (
        ("nnodes", "--nnodes", nnodes),
        ("node_rank", "--node-rank", node_rank),
    ):
        if value is None:
            continue
        if field in found and found[field].value != value:
            raise LaunchError(
                f"{flag} {value} contradicts {found[field].label} ({kind}); drop the flag or fix "
                "the launcher's settings"
            )
        found[field] = _Value(value, f"{flag} {value}")
    if master is not None:  # the flag names the driver's address exactly
        host, port = split_host_port(master, "--master")
        found["host"], found["port"] = _Value(host, f"--master {master}"), _Value(port, "")
    for field, flag, var in (
        ("nnodes", "--nnodes", "WORLD_SIZE"),
        ("node_rank", "--node-rank", "RANK"),
    ):
        if field not in found:
            raise LaunchError(
                f"{flag} is missing: a run across hosts needs --nnodes, --node-rank and --master "
                f"(or a launcher that sets {var}: torchrun, or srun's SLURM_* variables)"
            )
    size, rank = int(found["nnodes"].value), int(found["node_rank"].value)
    if size < 1:
        raise LaunchError(f"{found['nnodes'].label}: the node count must be 1 or more")
    if not 0 <= rank < size:
        raise LaunchError(
            f"{found['node_rank'].label} is not in 0..{size - 1} ({found['nnodes'].label})"
        )
    host, port = found.get("host"), found.get("port")
    if size > 1 and (host is None or port is None):
        missing = "MASTER_ADDR" if host is None else "MASTER_PORT"
        raise LaunchError(
            f"{missing} is not set, so the nodes do not know the driver's address: set MASTER_ADDR "
            "and MASTER_PORT (the driver listens on MASTER_PORT + 1), or pass --master HOST:PORT"
        )
    labels = [v.label for k, v in found.items() if k != "local_rank" and v.label]
    source = "flags" if not kind else kind if not given else f"flags and {kind}"
    local = found.get("local_rank")
    return Launch(
        nnodes=size, node_rank=rank,
        host=str(host.value) if host is not None and size > 1 else "",
        port=int(port.value) if port is not None and size > 1 else 0,
        source=source, detail=", ".join(labels),
        local_rank=int(local.value) if local is not None else None,
    )  # fmt: skip


def controller_shares(controllers: int, nnodes: int) -> list[list[int]]:
    """Controller indices per node: contiguous blocks in node order, the first ones one larger
    when ``controllers`` does not divide evenly (``5, 2 -> [[0, 1, 2], [3, 4]]``)."""
    if controllers < nnodes:
        idle = list(range(controllers, nnodes))
        raise LaunchError(
            f"--controllers {controllers} on {nnodes} nodes leaves node(s) {idle} with no "
            f"controller; pass --controllers {nnodes} or more (every node runs at least one)"
        )
    base, extra = divmod(controllers, nnodes)
    shares, start = [], 0
    for node in range(nnodes):
        size = base + (1 if node < extra else 0)
        shares.append(list(range(start, start + size)))
        start += size
    return shares


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """The ``run`` flags of a launch across hosts, in one group."""
    group = p.add_argument_group("multi-host (docs/SCALE_OUT.md)")
    group.add_argument(
        "--nnodes", type=int, default=None, metavar="N",
        help="hosts the run spans (default: WORLD_SIZE or SLURM_NNODES when a launcher set them)",
    )  # fmt: skip
    group.add_argument(
        "--node-rank", type=int, default=None, metavar="R",
        help="this host's rank; 0 runs the driver (default: RANK or SLURM_NODEID)",
    )  # fmt: skip
    group.add_argument(
        "--master", default=None, metavar="HOST:PORT",
        help="where node 0's driver listens (default: MASTER_ADDR, or the first host of "
        "SLURM_NODELIST, and MASTER_PORT + 1)",
    )  # fmt: skip
    group.add_argument(
        "--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
        help="launch on a Ray cluster (auto: the one this machine belongs to, or HOST:PORT of "
        "its head): one `yatt-graph run` per node, in Ray actors of one placement group "
        "(--nnodes of them, default the cluster's nodes); needs the ray extra",
    )  # fmt: skip
    group.add_argument(
        "--data-host", default=None, metavar="ADDRESS",
        help="the address this host's controllers listen on for their peers (default: the "
        "interface that routes to the master)",
    )  # fmt: skip


MAX_MESSAGE_MB = 4096.0
"""``--max-message-mb``'s default: the largest frame a runtime socket accepts (4 GiB)."""


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The run command's flags (the graph and its options are the caller's)."""
    p.add_argument(
        "--steps", type=int, default=30, help="total steps (a resumed run counts restored ones)"
    )
    p.add_argument("--seed", type=int, help="passed to build_graph(seed=...)")
    p.add_argument(
        "--out",
        help="the run folder: metrics.jsonl, trace.json, checkpoints/ (one run at a time; "
        "default with --resume: the folder it resumes)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in an --out that holds a run: its files move into "
        "OUT/previous-<time>/ (nothing is deleted)",
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=0, metavar="K", help="checkpoint every K steps"
    )
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="continue a run folder from its newest good checkpoint (or DIR/checkpoints/step_N); "
        "the checkpoint must be of this graph with the same options",
    )
    p.add_argument(
        "--controllers", type=int, default=1, help="run the plan on N controller processes"
    )
    p.add_argument(
        "--placement",
        choices=("colocated", "partial"),
        default="colocated",
        help="colocated: roles share the controllers; partial: rollout side and training side "
        "on separate controllers (needs --controllers >= 2)",
    )
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="NODE=SIDE",
        help="with --placement partial: keep NODE on the rollout or the train side (e.g. "
        "reference=rollout); repeatable. Unpinned inference nodes (reward, reference, critic) "
        "move to the less busy side once the first steps are measured (not with --no-adaptive)",
    )
    p.add_argument(
        "--slots",
        metavar="N|auto",
        help="cut the calls of splittable nodes (vision, reference, critic) into pieces "
        "across N CPU slots per process (auto: $YATT_CPU_SLOTS or the cores); default: none",
    )
    p.add_argument(
        "--replicas",
        metavar="NODE=R,...",
        help="run R copies of an inference node (rollout, vision, reference, critic, reward), "
        "each on its own core or GPU; each step's batch is cut across them by cost "
        "(e.g. rollout=2)",
    )
    p.add_argument(
        "--ranks-per-host",
        type=int,
        default=0,
        metavar="M",
        help="with --train-ranks K across hosts: M ranks on each host, the update's host the "
        "first M, the next hosts the rest (K <= M x hosts; default 0: all K on the update's host)",
    )
    p.add_argument(
        "--replicas-per-host",
        type=int,
        default=0,
        metavar="M",
        help="with --replicas across hosts: M copies of a node on each host, the node's host "
        "the first M (the node and M-1 replicas), the next hosts the rest (R <= M x hosts; "
        "default 0: every replica on the node's host)",
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        metavar="K",
        help="async mode: a rollout may use weights at most K versions old, so sources run "
        "up to K steps ahead of the update (0: on-policy)",
    )
    p.add_argument(
        "--staleness",
        choices=("bound", "fixed"),
        default="bound",
        help="with --max-staleness K: bound (default) reads the newest weights at most K "
        "versions old; fixed always reads the ones exactly K+1 steps back, whatever the "
        "timing (a bitwise rerun also needs fixed thread counts: --no-adaptive)",
    )
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch threads of the process that runs the nodes (with controllers: of each one, "
        "fixed for the run); default: one per core that other processes leave free, measured "
        "at start, with idle OpenMP threads spinning only where the run owns its cores "
        "(OMP_NUM_THREADS and OMP_WAIT_POLICY are kept when set)",
    )
    p.add_argument(
        "--no-adaptive",
        action="store_true",
        help="keep each controller's starting cores; by default the driver moves cores between "
        "controllers between steps, toward the busiest (sched/* metrics)",
    )
    p.add_argument(
        "--offload",
        choices=OFFLOAD_MODES,
        default="auto",
        help="when roles take turns on a device, move a role's weights and optimizer state to "
        "host memory when its turn ends and back before its next call, timed (sched/switch_s); "
        "auto: when controllers share a GPU under colocated placement; on: always (in-process: "
        "between model roles); off: never",
    )
    p.add_argument(
        "--listen",
        metavar="tcp://HOST:PORT",
        help="bind the driver on tcp so controllers on other hosts can join (opt-in)",
    )
    p.add_argument(
        "--no-spawn",
        action="store_true",
        help="start no local controllers; wait for `yatt-graph controller --connect`",
    )
    p.add_argument(
        "--window", type=int, default=5, help="steps averaged in the closing reward line"
    )
    p.add_argument(
        "--export",
        metavar="DIR",
        help="save the trained policy there with save_pretrained",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar (and no glances)")
    p.add_argument(
        "--glance-every",
        type=int,
        default=50,
        metavar="N",
        help="every N steps print a few responses with their prompts and rewards (ready "
        "graphs; 0: never)",
    )
    p.add_argument(
        "--wandb",
        nargs="?",
        const="yatt-graph",
        metavar="PROJECT",
        help="with --out: also log the scalars and the kept samples to Weights & Biases "
        "(project PROJECT, default yatt-graph; needs the wandb extra); offline in OUT/wandb/ "
        "unless a key is configured (WANDB_API_KEY or wandb login)",
    )
    p.add_argument(
        "--samples-every",
        type=int,
        default=10,
        metavar="N",
        help="with --out: every N steps write the step's samples to OUT/samples/ as Parquet: "
        "each response with its prompt, data row, image, reward, length, stop reason, "
        "advantage, KL, weight version (ready graphs; default 10; 0: never)",
    )
    p.add_argument(
        "--no-check-finite",
        action="store_true",
        help="do not stop the run at a node output holding NaN or inf (checked by default)",
    )
    p.add_argument(
        "--show-graph", action="store_true", help="print the graph's text form before running"
    )
    faults = p.add_argument_group("faults and bad input (docs/RELIABILITY.md)")
    faults.add_argument(
        "--restart",
        choices=["never", "on-failure"],
        default="never",
        help="on-failure: when a controller dies, restart the controllers and resume from the "
        "newest good checkpoint (needs --out; default never: stop with the error)",
    )
    faults.add_argument(
        "--max-restarts", type=int, default=3, metavar="N", help="give up after N restarts"
    )
    faults.add_argument(
        "--node-timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="stop the run when one node call runs longer than S seconds (nodes whose "
        "BatchPolicy.timeout_s is 0; 0: no limit)",
    )
    faults.add_argument(
        "--on-bad-sample",
        choices=["raise", "skip"],
        help="passed to a graph that has the on_bad_sample option: a NaN/inf/non-number "
        "reward stops the run (raise) or scores 0 and is counted (skip)",
    )
    faults.add_argument(
        "--max-message-mb",
        type=float,
        default=MAX_MESSAGE_MB,
        metavar="MB",
        help="largest frame a runtime socket accepts; larger ones are dropped (0: no limit)",
    )
    security = p.add_argument_group("security (docs/RELIABILITY.md)")
    security.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow --listen on a non-loopback address (other hosts can connect: use --keys)",
    )
    security.add_argument("--keys", metavar="DIR", help="CURVE keys from `yatt-graph keys DIR`")


def _check_numbers(args: Any) -> None:
    """Numbers and flag pairs that cannot work, refused before anything is built."""
    least = {"steps": 1, "controllers": 1, "checkpoint_every": 0, "max_staleness": 0,
             "max_restarts": 0, "window": 1, "glance_every": 0, "samples_every": 0,
             "threads": 1}  # fmt: skip
    for name, low in least.items():
        value = getattr(args, name)
        if value is not None and value < low:  # (--threads: None is one per free core)
            raise UsageError(f"--{name.replace('_', '-')} must be {low} or more, got {value}")
    for flag, value in (
        ("--node-timeout", args.node_timeout),
        ("--max-message-mb", args.max_message_mb),
    ):
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{flag} takes 0 (no limit) or a finite number above it, got {value}")
    if 0 < args.max_message_mb * (1 << 20) < 1:
        raise UsageError(
            f"--max-message-mb {args.max_message_mb} is under one byte (0 is no limit); "
            "give at least 0.001 (about 1 KB)"
        )
    for flag in ("out", "resume", "export"):  # (an empty one: an unset shell variable)
        value = getattr(args, flag, None)
        if isinstance(value, str) and not value.strip():
            raise UsageError(f"--{flag} was given an empty path; name a folder")
    if args.no_spawn and not args.listen:
        raise UsageError(
            "--no-spawn waits for controllers started by hand, which join a driver on tcp; "
            "add --listen tcp://HOST:PORT (or drop --no-spawn)"
        )
    if args.resume and args.overwrite and (not args.out or same_folder(args.out, args.resume)):
        raise UsageError(
            "--resume continues the run in its folder and --overwrite starts it afresh; "
            "choose one (or --out ANOTHER_DIR to continue into another folder)"
        )


def same_folder(out: str, resume: str) -> bool:
    return run_folder_of(Path(resume)).resolve() == Path(out).resolve()


def _check_run_flags(args: Any, checked: CheckedFlags) -> None:
    if args.restart == "on-failure":
        if (
            not checked.distributed
            and not checked.replicas
            and (getattr(args, "train_ranks", None) or 1) < 2
        ):
            raise UsageError(
                "--restart on-failure restarts controller, replica or training-rank processes; it "
                "needs --controllers N (N > 1), --listen, --replicas or --train-ranks"
            )
        if not args.out and not args.resume:
            raise UsageError("--restart on-failure needs --out DIR, where checkpoints are kept")
        if not args.checkpoint_every:
            print(
                "yatt-graph run: --restart on-failure without --checkpoint-every: a restart runs "
                "again from the first step",
                file=sys.stderr,
            )
    if args.wandb is not None:
        if not args.out and not args.resume:
            raise UsageError("--wandb needs --out DIR: the W&B run is kept beside the run folder")
        if not args.wandb.strip():
            raise UsageError("--wandb was given an empty project name (an unset shell variable?)")
        if importlib.util.find_spec("wandb") is None:
            raise UsageError(NO_WANDB)
    if checked.pins and args.placement != "partial":
        raise UsageError(
            "--pin keeps a node on one side of --placement partial; add --placement partial "
            "(colocated placement has no sides)"
        )
    if args.placement == "partial" and args.controllers < 2:
        raise UsageError(
            "--placement partial puts the rollout side and the training side on separate "
            "controllers; it needs --controllers 2 or more"
        )
    if args.staleness == "fixed" and not args.max_staleness:
        raise UsageError(
            "--staleness fixed chooses which old weights a rollout reads within --max-staleness "
            "K; without it (K=0, on-policy) every step reads the step before: add "
            "--max-staleness K (K >= 1) or drop --staleness"
        )
    if args.listen and args.controllers < 2:
        raise UsageError(
            "--listen binds the driver for controllers that join over tcp; say how many with "
            "--controllers N (N > 1), e.g. --controllers 2 --no-spawn for two started by hand"
        )
    if not checked.distributed and (
        args.keys or args.allow_remote or args.node_timeout or args.max_message_mb != MAX_MESSAGE_MB
    ):
        raise UsageError(
            "--keys, --allow-remote, --node-timeout and --max-message-mb apply to controller "
            "processes and their sockets; add --controllers N (N > 1) or --listen"
        )


def parse_slots(value: str | None) -> int | str | None:
    if value is None or value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 1:
        raise UsageError(f"--slots takes a CPU slot count >= 1 or 'auto', got {value!r}")
    return n


def parse_pins(values: list[str]) -> dict[str, str]:
    """``["reference=rollout"]`` as ``{"reference": "rollout"}`` (the names are checked
    against the graph once it is built)."""
    out: dict[str, str] = {}
    for item in (i for value in values for i in value.split(",")):
        name, sep, side = item.partition("=")
        if not sep or not name.strip() or side.strip() not in SIDES:
            raise UsageError(
                f"--pin takes NODE=rollout or NODE=train (reference=rollout), got {item!r}"
            )
        out[name.strip()] = side.strip()
    return out


def parse_replicas(value: str | None) -> dict[str, int]:
    """``rollout=2,reference=2`` as ``{"rollout": 2, "reference": 2}``."""
    out: dict[str, int] = {}
    for item in (value or "").split(","):
        if not item.strip():
            continue
        name, sep, count = item.partition("=")
        try:
            r = int(count)
        except ValueError:
            r = 0
        if not sep or not name.strip() or r < 1:
            raise UsageError(
                f"--replicas takes NODE=R pairs with R >= 1, separated by commas "
                "(--replicas rollout=2), "
                f"got {item!r}"
            )
        out[name.strip()] = r
    return out


@dataclass(frozen=True)
class CheckedFlags:
    """The ``run`` flags that :func:`check_flags` parses, as parsed."""

    slots: int | str | None
    """``--slots``: a CPU slot count, ``"auto"`` or None (:func:`parse_slots`)."""
    replicas: dict[str, int]
    """``--replicas`` by node (:func:`parse_replicas`)."""
    pins: dict[str, str]
    """``--pin`` by node: ``rollout`` or ``train`` (:func:`parse_pins`)."""
    distributed: bool
    """Whether the nodes run on controller processes (``--controllers N``, N > 1, or
    ``--listen``)."""


def check_flags(args: Any) -> CheckedFlags:
    """Every flag that cannot work, refused before anything is built; the ones it parses."""
    _check_numbers(args)
    checked = CheckedFlags(
        slots=parse_slots(args.slots),
        replicas=parse_replicas(args.replicas),
        pins=parse_pins(args.pin),
        distributed=args.controllers > 1 or bool(args.listen),
    )
    _check_run_flags(args, checked)
    return checked


# --- the parsed command line ----------------------------------------------------------------

NAMED_OPTIONS = (
    "policy", "vision", "reward", "env", "seed", "data", "val_data", "rollout", "device",
    "train_ranks", "train_backend", "on_bad_sample", "teacher",
)  # fmt: skip
"""The flags that name a graph option (``--val-data`` is the option ``val_data``)."""


class GraphArgs(msgspec.Struct, frozen=True, kw_only=True):
    """The graph a command names and the options typed for it, as typed: what
    :func:`runtime.run.graph_options` checks against the graph's options and types."""

    ref: str
    """The graph: a ready graph's module (``graphs.text_grpo``), a module or a file."""
    command: str = "run"
    """The command that names it (``run``, ``show``, ``viz``), for messages."""
    sets: dict[str, str] = {}
    """``--set KEY=VALUE`` pairs, key -> the text after ``=``."""
    named: dict[str, Any] = {}
    """The flags that name an option (:data:`NAMED_OPTIONS`) that were given, by option;
    ``--reward-model DIR`` and ``--judge DIR`` give ``reward`` (``model:DIR``, ``judge:DIR``)."""
    typed: dict[str, str] = {}
    """How each of :attr:`named` was typed (``--reward-model DIR``), for messages."""
    flags: dict[str, bool] = {}
    """The command's other flags by name, True for a switch (``quiet``): a ``--set`` key that
    is one of them is said to be a flag."""


class LaunchSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Where the run's processes run and how they meet."""

    controllers: int = 1
    pins: dict[str, str] = {}
    """``--pin NODE=SIDE`` with ``--placement partial`` (the placement is the
    :class:`RunConfig`'s, as are the torch threads)."""
    listen: str | None = None
    spawn: bool = True
    """False with ``--no-spawn``: the controllers are started by hand."""
    allow_remote: bool = False
    keys: str | None = None
    ray: str | None = None
    """``--ray ADDRESS``: the Ray cluster that starts the run's nodes (runtime.ray_launch);
    None outside one."""
    ray_nodes: int = 0
    """With :attr:`ray`: how many nodes (``--nnodes``); 0: the cluster's nodes, at most
    ``controllers``."""
    hosts: Launch | None = None
    """The run's place in a launch (:func:`resolve_launch`: the flags ``--nnodes``,
    ``--node-rank``, ``--master`` and the launcher's environment); None outside one."""
    data_host: str | None = None

    @property
    def distributed(self) -> bool:
        """Whether the nodes run on controller processes (not in this one)."""
        return self.controllers > 1 or bool(self.listen)


class TrainSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The training loop's settings and the run folder's."""

    steps: int = 30
    out: str | None = None
    resume: str | None = None
    overwrite: bool = False
    export: str | None = None
    checkpoint_every: int = 0
    restart: str = "never"
    max_restarts: int = 3
    progress: bool = True
    """False with ``--quiet``."""
    glance_every: int = 50
    samples_every: int = 10
    wandb: str | None = None
    window: int = 5
    show_graph: bool = False


class RunSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One ``yatt-graph run``, parsed once from its command line (:func:`run_spec`): the graph
    and its options, the :class:`~runtime.engine.config.RunConfig` both executors take, the
    launch and the training loop. ``OUT/settings.json`` records it."""

    graph: GraphArgs
    options: dict[str, Any] = {}
    """The graph's options, typed (:func:`runtime.run.graph_options`); empty until the graph's
    module is loaded, which comes after the thread policy is set (``with_options``)."""
    engine: RunConfig
    launch: LaunchSettings
    train: TrainSettings

    def with_options(self, options: dict[str, Any]) -> RunSpec:
        return msgspec.structs.replace(self, options=options)


def _set_texts(pairs: list[str]) -> dict[str, str]:
    """``--set`` pairs as key -> text; a pair without ``=``, or a key given twice with two
    values, is refused."""
    texts: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(
                f"--set {pair!r}: expected KEY=VALUE (the graph goes before --set, which takes "
                "every KEY=VALUE after it)"
            )
        if key in texts and texts[key] != value:
            raise UsageError(
                f"--set gives {key!r} twice ({texts[key]!r} and {value!r}); give it once"
            )
        texts[key] = value
    return texts


_NOT_FLAGS = ("set", "graph", "func", "command")
"""Names in the parsed flags that are no flag a user types."""


def graph_args(args: argparse.Namespace) -> GraphArgs:
    """The graph and the options typed for it, from a command's parsed flags (``run``,
    ``show``, ``viz``)."""
    given = {key: getattr(args, key, None) for key in ("reward", "reward_model", "judge")}
    said = [f"--{key.replace('_', '-')}" for key, value in given.items() if value is not None]
    if len(said) > 1:
        raise UsageError(f"{' and '.join(said)}: give one reward")
    named: dict[str, Any] = {}
    typed: dict[str, str] = {}
    for key in NAMED_OPTIONS:
        value = getattr(args, key, None)
        if value is not None:
            named[key], typed[key] = value, f"--{key.replace('_', '-')} {value}"
    for flag, kind in (("reward_model", "model"), ("judge", "judge")):
        if given[flag] is not None:
            named["reward"] = f"{kind}:{given[flag]}"
            typed["reward"] = f"--{flag.replace('_', '-')} {given[flag]}"
    flags = {
        key: isinstance(value, bool)
        for key, value in vars(args).items()
        if key not in _NOT_FLAGS and not key.startswith("_")
    }
    return GraphArgs(
        ref=args.graph, command=args.command, sets=_set_texts(args.set), named=named,
        typed=typed, flags=flags,
    )  # fmt: skip


def refuse_per_host(ranks_per_host: int, replicas_per_host: int) -> None:
    """A UsageError for ``--ranks-per-host`` or ``--replicas-per-host`` given to a run (or a
    plan) of one host, where every copy is on its node's host."""
    for flag, value, what in (
        ("--ranks-per-host", ranks_per_host, "ranks of --train-ranks"),
        ("--replicas-per-host", replicas_per_host, "copies of --replicas"),
    ):
        if value:
            raise UsageError(
                f"{flag} {value} spreads the {what} over the hosts of a run across hosts "
                "(--nnodes N, torchrun, Slurm or --ray); on one host every copy is on its "
                "node's host: drop it"
            )


def _hosts(args: argparse.Namespace, env: Mapping[str, str]) -> Launch | None:
    """The launch the flags and ``env`` describe (:func:`resolve_launch`), with the flags that
    cannot go with a run across hosts refused; None with ``--ray`` (Ray places the nodes)."""
    if args.ray is not None:
        _check_ray(args)
        return None
    launch = resolve_launch(args.nnodes, args.node_rank, args.master, env)  # (a UsageError)
    if launch is None or launch.nnodes < 2:
        if args.data_host:
            raise UsageError("--data-host applies to a run across hosts (--nnodes 2 or more)")
        refuse_per_host(args.ranks_per_host, args.replicas_per_host)
        return launch
    for flag, value in (("--listen", args.listen), ("--no-spawn", args.no_spawn)):
        if value:
            raise UsageError(
                f"{flag} and a run across hosts ({launch.source}): the driver's address comes "
                f"from --master (or MASTER_ADDR/MASTER_PORT); drop {flag}"
            )
    if args.restart == "on-failure":
        raise UsageError(
            "--restart on-failure restarts controllers this process started; across hosts let "
            "the launcher restart the job (torchrun --max-restarts, Slurm --requeue) with --resume"
        )
    return launch


NO_RAY = "--ray needs Ray, an optional extra: pip install 'yatt-graph[ray]'"


def _check_ray(args: argparse.Namespace) -> None:
    """``--ray``'s flags: Ray places the nodes and picks the master, so the flags that say
    where a node is are refused; Ray must be importable."""
    if not args.ray.strip():
        raise LaunchError("--ray was given an empty address; give HOST:PORT, or no value (auto)")
    for flag, value in (
        ("--node-rank", args.node_rank), ("--master", args.master),
        ("--data-host", args.data_host), ("--listen", args.listen),
        ("--no-spawn", args.no_spawn),
    ):  # fmt: skip
        if value:
            raise LaunchError(
                f"--ray and {flag}: Ray starts every node and tells each its rank and the "
                f"driver's address; drop {flag}"
            )
    if args.nnodes is not None and args.nnodes < 1:
        raise LaunchError(f"--nnodes {args.nnodes}: the node count must be 1 or more")
    if args.nnodes is not None:
        controller_shares(args.controllers, args.nnodes)  # every node runs a controller
    if args.restart == "on-failure":
        raise LaunchError(
            "--restart on-failure restarts controllers one process started; on Ray rerun the "
            "job with --resume OUT, which continues from the newest good checkpoint"
        )
    if importlib.util.find_spec("ray") is None:
        raise LaunchError(NO_RAY)


def run_spec(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> RunSpec:
    """``yatt-graph run``'s flags (and the launcher's environment ``env``, default this
    process's) as one :class:`RunSpec`, every flag that cannot work refused first (before
    anything is built). The graph's options are typed later (:meth:`RunSpec.with_options`),
    once its module may load."""
    hosts = _hosts(args, os.environ if env is None else env)
    graph = graph_args(args)
    checked = check_flags(args)
    device = graph.named.get("device") or graph.sets.get("device") or "auto"
    engine = RunConfig(
        max_staleness=args.max_staleness,
        staleness=args.staleness,
        slots=checked.slots,
        check_finite=not args.no_check_finite,
        replicas=checked.replicas,
        offload=args.offload,
        node_timeout_s=args.node_timeout,
        max_message_bytes=int(args.max_message_mb * (1 << 20)),
        num_threads=args.threads,
        placement=args.placement,
        device=str(device) if checked.distributed else "auto",
        adaptive=not args.no_adaptive,
        ranks_per_host=args.ranks_per_host,
        replicas_per_host=args.replicas_per_host,
    ).verify("yatt-graph run")
    launch = LaunchSettings(
        controllers=args.controllers, pins=checked.pins, listen=args.listen,
        spawn=not args.no_spawn, allow_remote=args.allow_remote, keys=args.keys, hosts=hosts,
        data_host=args.data_host, ray=args.ray,
        ray_nodes=(args.nnodes or 0) if args.ray is not None else 0,
    )  # fmt: skip
    train = TrainSettings(
        steps=args.steps, out=args.out, resume=args.resume, overwrite=args.overwrite,
        export=args.export, checkpoint_every=args.checkpoint_every, restart=args.restart,
        max_restarts=args.max_restarts, progress=not args.quiet, glance_every=args.glance_every,
        samples_every=args.samples_every, wandb=args.wandb, window=args.window,
        show_graph=args.show_graph,
    )  # fmt: skip
    return RunSpec(graph=graph, engine=engine, launch=launch, train=train)


def add_controller_arguments(p: argparse.ArgumentParser) -> None:
    """The controller's flags, for ``python -m runtime.zmq.controller_main`` and
    ``yatt-graph controller`` alike (the ones a driver passes to its own are hidden)."""
    p.add_argument(
        "--connect", required=True, help="the driver's address, ipc://PATH or tcp://HOST:PORT"
    )
    p.add_argument(
        "--index", type=int, default=-1, help="controller index (default: the driver assigns one)"
    )
    p.add_argument("--bind", default=None, help="address of this controller's data socket")
    p.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help=argparse.SUPPRESS,  # exit when this process is no longer the parent
    )
    p.add_argument(
        "--spawned",
        action="store_true",
        help=argparse.SUPPRESS,  # started by a local driver: ignore Ctrl-C (it stops us)
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=STARTUP_TIMEOUT_S,
        help=f"seconds to wait for the driver's SETUP (default {STARTUP_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--keys", default=None, metavar="DIR", help="CURVE keys from `yatt-graph keys DIR`"
    )
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="let the data socket listen on a non-loopback interface (a driver on another host)",
    )
    p.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help=argparse.SUPPRESS,  # import this module or file while waiting for the driver
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help=argparse.SUPPRESS,  # largest data frame from peers until the driver's limit is known
    )
