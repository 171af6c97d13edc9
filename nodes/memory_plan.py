"""A memory plan before launch: the parts each model node says it will hold
(``Node.memory(load)``, :mod:`nodes.memory`) added up per process and device, and whether
each device has room for them.

A process's nodes run one at a time, so a process peaks at what its nodes hold between calls
(:data:`~nodes.memory.HELD`) plus its largest call's working set; a model of one share key
(:mod:`nodes.shared_models`) in one process counts once; each host process adds its runtime.

A node's other copies are processes of their own: the other ranks of a node trained as a
group (each holding what the node says it holds: a rank's shards), and a node's replicas
(each scoring its share of the step: the node's parts for ``1/copies`` of the load). Where
each copy runs (its host and its index there, its GPU on CUDA) is the runtime's to say
(:class:`Copy`); without it every copy is on its node's host, copy i on GPU i. With hosts,
each device is named with its host (``host 1 cuda:3``), so the plan adds up what shares one
GPU of one host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from nodes.memory import HELD, PARTS, Load

__all__ = ["Copy", "MemoryPlan", "plan_memory"]


class Copy(NamedTuple):
    """Where one copy of a node runs: its host's name ('' on a run of one host) and its index
    among its node's copies on that host (its GPU, counted from the node's own, on CUDA); a
    plain ``(host, local)`` pair reads the same."""

    host: str
    local: int


@dataclass
class MemoryPlan:
    """Rows of (node, process, device, parts) and the devices' room."""

    load: Load
    rows: list[tuple[str, str, str, dict[str, int]]] = field(default_factory=list)
    runtime: int = 0
    """A process's own memory before any model: Python, torch, transformers (host memory)."""
    room: dict[str, int] = field(default_factory=dict)
    """Bytes each device has (the host: MemAvailable plus this process's; a GPU: its total)."""
    processes: int = 1
    """Processes of the run (with controllers: theirs and the driver), on all its hosts."""
    per_host: dict[str, int] = field(default_factory=dict)
    """Processes on each host, by name, for a run of several ('' : one host, all of them)."""
    advice: Callable[[MemoryPlan, str], list[str]] | None = None
    """``advice(plan, device)``: the changes of the settings that would make ``device`` fit
    (a ready graph's config gives them: ``graphs.advice``); without it, none is said."""

    def peaks(self) -> dict[tuple[str, str], tuple[int, int, str]]:
        """Per (process, device): (bytes held between calls, the largest call's working
        set, the node of that call)."""
        out: dict[tuple[str, str], tuple[int, int, str]] = {}
        for node, process, device, parts in self.rows:
            held, work, who = out.get((process, device), (0, 0, ""))
            held += sum(parts.get(k, 0) for k in HELD)
            call = sum(v for k, v in parts.items() if k not in HELD)
            if call > work:
                work, who = call, node
            out[(process, device)] = (held, work, who)
        return out

    def device_totals(self) -> dict[str, int]:
        """Bytes each device holds at its peak: its processes' peaks added up (they run at
        once), and on the host each process's runtime."""
        hosts = self.per_host or {"": self.processes}
        totals = {_on(host, "cpu"): self.runtime * count for host, count in hosts.items()}
        for (_, device), (held, work, _) in self.peaks().items():
            totals[device] = totals.get(device, 0) + held + work
        return totals

    def lines(self) -> list[str]:
        """The plan as text: a table of nodes, then one line per device."""
        ld = self.load
        out = [
            f"memory plan (estimates) for a step of {ld.responses} responses of up to "
            f"{ld.response_tokens} tokens to {ld.prompts} prompts of up to {ld.prompt_tokens}"
        ]
        table = [["node", "process", "device", *[p.replace("_", " ") for p in PARTS]]]
        for node, process, device, parts in self.rows:
            table.append([node, process, device, *[_mb(parts.get(p, 0)) for p in PARTS]])
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        out += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
        return out + self.device_lines()

    def device_lines(self) -> list[str]:
        """One line per device: its peak, its largest call, and whether it fits."""
        out = []
        peaks = self.peaks()
        for device, total in sorted(self.device_totals().items()):
            calls = [
                f"{who} {_mb(w)}" for (_, d), (_, w, who) in peaks.items() if d == device and who
            ]
            text = f"{device}: {_mb(total)} at the peak"
            if device.endswith("cpu"):
                host = device[: -len("cpu")].strip()
                count = self.per_host.get(host, self.processes) if self.per_host else self.processes
                each = f" each of {count} processes" if count > 1 else " a process"
                text += f", with {_mb(self.runtime)}{each} for Python and torch"
            text += f"; largest call: {', '.join(calls) or 'none'}"
            room = self.room.get(device)
            if room is None:
                text += "; its room is unknown here"
            elif total > room:
                text += f"; WILL NOT FIT in {_mb(room)}"
                fixes = self.advice(self, device) if self.advice is not None else []
                if fixes:
                    last = f"or {fixes[-1]}" if len(fixes) > 1 else fixes[-1]
                    text += ": " + "; ".join([*fixes[:-1], last])
            else:
                text += f"; fits in {_mb(room)}"
            out.append(text)
        return out

    def fits(self) -> bool:
        """Whether every device whose room is known has room for its peak."""
        return all(t <= self.room.get(d, t) for d, t in self.device_totals().items())


def _mb(n: int) -> str:
    if n <= 0:
        return "-"
    if n < 2**20:
        return "<1 MB"
    return f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / 2**20:.0f} MB"


def _runtime_bytes() -> int:
    """This process's resident memory now (after importing torch and transformers): what any
    process of the run holds before its models."""
    import transformers  # noqa: F401  # imported by every model node's process

    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


def _room(devices: Iterable[str], runtime: int) -> dict[str, int]:
    room: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        room["cpu"] = info.get("MemAvailable", 0) + runtime
    except (OSError, ValueError, IndexError):
        pass
    import torch

    for named in devices:
        device = named.rpartition(" ")[2]  # on a run of hosts: as if each host were this one
        if named.endswith("cpu") and "cpu" in room:
            room[named] = room["cpu"]
        if device.startswith("cuda") and torch.cuda.is_available():
            index = int(device.partition(":")[2] or 0)
            if index < torch.cuda.device_count():
                room[named] = torch.cuda.get_device_properties(index).total_memory
    return room


def plan_memory(
    graph: Any,
    load: Load,
    processes: Mapping[str, str] | None = None,
    advice: Callable[[MemoryPlan, str], list[str]] | None = None,
    copies: Mapping[str, Sequence[Copy]] | None = None,
    hosts: Mapping[str, str] | None = None,
) -> MemoryPlan:
    """The memory plan of ``graph``'s nodes for ``load``; ``processes`` maps a node to the
    process (controller) that runs it (all in one, "0", by default); ``advice``: what to
    change where a device does not fit (:attr:`MemoryPlan.advice`); ``copies``: where each
    copy of a node with several runs (ranks or replicas, copy 0 the node itself; a node with
    ``ranks`` left out: all on its host); ``hosts``: each process's host, by process, on a
    run of several hosts.

    A node's ``weights`` part belongs to its share key (``node.share``); ``weights@KEY`` to the
    key KEY, ``weights@`` to none: the weights of one key in one process count once."""
    hosts = dict(hosts or {})
    count = len(set(processes.values())) + 1 if processes else 1  # the controllers and a driver
    plan = MemoryPlan(load, runtime=_runtime_bytes(), processes=count, advice=advice)
    if hosts:
        for host in hosts.values():
            plan.per_host[host] = plan.per_host.get(host, 0) + 1
        first = hosts.get("0", next(iter(hosts.values())))
        plan.per_host[first] += 1  # the driver, on the first host
    seen: set[tuple[str, str, str]] = set()  # (process, device, share) whose weights are counted
    for name, node in graph.nodes.items():
        process = (processes or {}).get(name, "0")
        device = str(getattr(node, "device", "cpu"))
        device = device if device == "cpu" or ":" in device else f"{device}:0"
        ranks = getattr(node, "ranks", 1)
        ranks = ranks if isinstance(ranks, int) else 1
        given = (copies or {}).get(name)
        spots = (
            [Copy(*c) for c in given]
            if given
            else [Copy(hosts.get(process, ""), r) for r in range(ranks)]
        )

        replicas = len(spots) if ranks == 1 else 1  # each replica scores its share of the step
        parts: dict[str, int] = {}
        spread = len({spot.host for spot in spots}) if ranks > 1 else 1  # hosts of its group
        for key, value in node.memory(replace(_share(load, replicas), hosts=spread)).items():
            if key.startswith("weights"):
                share = key.partition("@")[2] if "@" in key else getattr(node, "share", None)
                if share:
                    if (process, device, share) in seen:
                        continue  # one module for the nodes of a share key
                    seen.add((process, device, share))
                key = "weights"
            parts[key] = parts.get(key, 0) + int(value)
        if any(parts.values()):
            plan.rows.append((name, process, _on(spots[0].host, device), parts))
        what = "rank" if ranks > 1 else "replica"
        base = 0 if device == "cpu" else int(device.partition(":")[2] or 0)
        for i, spot in enumerate(spots[1:], 1):
            # the node's other copies: processes of their own (on CUDA, a GPU each); a rank
            # holds rank 0's parts (an upper bound: only rank 0 gathers the published weights)
            there = device if device == "cpu" else f"{device.partition(':')[0]}:{base + spot.local}"
            label = f"{process}/{i}" if ranks > 1 else f"{process}/r{i}"
            plan.rows.append((f"{name} {what} {i}", label, _on(spot.host, there), dict(parts)))
            if getattr(node, "rank_with", None) is None:  # (one that joins a group adds none)
                plan.processes += 1
                if hosts:
                    plan.per_host[spot.host] = plan.per_host.get(spot.host, 0) + 1
    devices = {d for _, _, d, _ in plan.rows} | {_on(host, "cpu") for host in plan.per_host}
    plan.room = _room(devices, plan.runtime)
    return plan


def _on(host: str, device: str) -> str:
    """``device`` named with its host on a run of several (``host 1 cuda:3``)."""
    return f"{host} {device}" if host else device


def _share(load: Load, copies: int) -> Load:
    """One copy's share of the step's ``load`` when ``copies`` share it (prompts rounded up)."""
    if copies <= 1:
        return load
    prompts = -(-load.prompts // copies)
    per_prompt = max(load.responses // max(load.prompts, 1), 1)
    return replace(load, prompts=prompts, responses=prompts * per_prompt)
