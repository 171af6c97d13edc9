"""Where this process stands in a run that spans hosts: how many nodes, which one this is, and
the driver's address. Pure functions of the flags and an environment mapping (docs/SCALE_OUT.md).

Read from the flags ``--nnodes N --node-rank R --master HOST:PORT`` first; what they leave
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
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "Launch",
    "LaunchError",
    "add_launch_arguments",
    "controller_shares",
    "expand_nodelist",
    "resolve_launch",
    "split_host_port",
]


class LaunchError(ValueError):
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
        "--data-host", default=None, metavar="ADDRESS",
        help="the address this host's controllers listen on for their peers (default: the "
        "interface that routes to the master)",
    )  # fmt: skip
