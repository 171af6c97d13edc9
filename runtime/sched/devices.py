"""The device pool: CUDA devices when present, else CPU worker slots; busy/idle accounting;
and the :class:`Resources` each controller process owns.

A :class:`Slot` is what one worker of the scheduler runs on: ``cuda:i`` or a CPU slot
``cpu:i`` (on a machine without GPUs, slots are threads that each own a share of the
cores). The :class:`SlotPool` keeps, per device, how long it was busy running node calls,
how long it spent switching roles (offload/reload when roles time-share a device), and so
how long it sat idle, over a window that starts with :meth:`SlotPool.start`. For every
device ``busy_s + switch_s + idle_s == window_s``.

:class:`Resources` is what one process computes on: a set of CPU cores (its affinity), the
torch threads of the thread that runs its nodes, and the GPUs it may use
(``CUDA_VISIBLE_DEVICES``). :func:`assign_resources` gives each controller of a run its share
(:mod:`runtime.sched.affinity` applies it in the process; :mod:`runtime.sched.adaptive`
re-balances it between steps).

How many torch threads a process computes with, and whether its idle OpenMP threads spin
(:func:`decide`, :func:`run_policy`): more threads than free cores make every parallel region
wait for a preempted thread; OpenMP threads that sleep after each region make a small model's
thousands of short regions pay a wake-up each (the demo's step 2.3x slower), while spinning
ones burn cores another busy process needs. So a process spins only where it owns its cores:
:func:`busy_elsewhere` measures, before torch loads, how much of them other processes use
(``/proc/stat``, the least of three 0.1 s windows), and the run gets one torch thread per free
core, spinning when those cores are free and no other process of the run computes on them at
the same time. The spin is bounded (:data:`SPIN_COUNT`). The wait policy is read once, when
torch loads OpenMP, so it travels in the environment (:func:`openmp_env`), inherited by the
controllers; a user's ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or ``OMP_NUM_THREADS`` is kept,
and ``yatt-graph run --threads N`` fixes the count.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = [
    "DEVICES",
    "Slot",
    "SlotPool",
    "SlotStats",
    "PLACEMENTS",
    "Resources",
    "SPIN_COUNT",
    "ThreadPolicy",
    "assign_resources",
    "busy_elsewhere",
    "check_choice",
    "cpu_slot_count",
    "cuda_visible_devices",
    "decide",
    "openmp_env",
    "passive_env",
    "run_policy",
    "split_evenly",
    "usable_core_ids",
    "usable_cores",
    "visible_gpus",
]

CPU_SLOTS_ENV = "YATT_CPU_SLOTS"
PLACEMENTS = ("colocated", "partial")
"""How controllers share the host (:func:`assign_resources`)."""
DEVICES = ("auto", "cpu", "cuda")
"""What controllers compute on (:func:`assign_resources`)."""


def check_choice(who: str, name: str, value: Any, choices: Sequence[str]) -> None:
    """A ValueError ``{who}: {name} must be 'a', 'b' or 'c', got {value!r}`` unless ``value``
    is one of ``choices``."""
    if value not in choices:
        *rest, last = map(repr, choices)
        raise ValueError(f"{who}: {name} must be {', '.join(rest)} or {last}, got {value!r}")


@dataclass(frozen=True)
class Slot:
    """One device a worker runs on."""

    kind: str
    """``"cuda"`` or ``"cpu"``."""
    index: int
    """The CUDA ordinal, or the CPU slot number."""

    @property
    def name(self) -> str:
        """``cuda:0`` or ``cpu:0``: the key in summaries."""
        return f"{self.kind}:{self.index}"

    @property
    def torch_device(self) -> str:
        """What to pass to ``tensor.to()``: ``cuda:i``, or ``cpu`` for every CPU slot."""
        return self.name if self.kind == "cuda" else "cpu"

    def __str__(self) -> str:
        return self.name


@dataclass
class SlotStats:
    """Accounting for one device."""

    busy_s: float = 0.0
    switch_s: float = 0.0
    calls: int = 0
    switches: int = 0
    node_busy_s: dict[str, float] = field(default_factory=dict)
    running: str | None = None
    """The node running now (None when idle)."""
    since: float = 0.0


def cpu_slot_count() -> int:
    """CPU worker slots: ``$YATT_CPU_SLOTS``, else the usable cores."""
    env = os.environ.get(CPU_SLOTS_ENV)
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"${CPU_SLOTS_ENV} must be an integer, got {env!r}") from None
        if n < 1:
            raise ValueError(f"${CPU_SLOTS_ENV} must be >= 1, got {n}")
        return n
    return usable_cores()


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(usable_core_ids())


def usable_core_ids() -> tuple[int, ...]:
    """The ids of the cores this thread may run on (its affinity), in order."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return tuple(range(os.cpu_count() or 1))


class Resources(msgspec.Struct, frozen=True, omit_defaults=True):
    """What one process computes on. Crosses processes (SETUP, RESOURCES, READY, STEP_DONE)."""

    cores: tuple[int, ...] = ()
    """CPU ids (its affinity); ``()``: every core of its host it may use."""
    threads: int = 0
    """``torch.set_num_threads`` on the thread that runs its nodes; 0: one per core."""
    cuda: tuple[int, ...] = ()
    """GPU ordinals among the driver's visible GPUs (its ``CUDA_VISIBLE_DEVICES``); ``()``: none
    assigned (the process keeps the environment it was started with)."""

    def describe(self) -> str:
        """``cores 0-1, 2 threads, cuda 0``: for logs and errors."""
        cores = _ranges(self.cores) if self.cores else "all"
        text = f"cores {cores}, {self.threads or 'one per core'} threads"
        return text + (f", cuda {_ranges(self.cuda)}" if self.cuda else "")


def _ranges(ids: Sequence[int]) -> str:
    """``0-3,6``: sorted ids as ranges."""
    out: list[str] = []
    for i in sorted(ids):
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


def visible_gpus() -> int:
    """How many GPUs this process sees, without initializing CUDA (torch asks NVML)."""
    import torch

    return torch.cuda.device_count() if torch.backends.cuda.is_built() else 0


def assign_resources(
    controllers: int,
    *,
    cores: Sequence[int],
    placement: str = "colocated",
    max_staleness: int = 0,
    device: str = "cpu",
    gpus: int = 0,
) -> list[Resources]:
    """Each controller's :class:`Resources` for a run (a pure function).

    CPU cores (``cores``: the ids the run may use):

    * ``colocated`` and on-policy (``max_staleness`` 0): every controller gets every core,
      with one torch thread per core. A step's nodes wait on each other, so the controllers
      take turns: when one role's phase ends, its cores are in effect the next one's.
    * ``partial``, or ``max_staleness`` > 0: the sides run at once, so each controller gets a
      disjoint, even share (contiguous, at least one core; with more controllers than cores,
      core ``c mod len(cores)``), one thread per core of it. The adaptive partitioner moves
      them from there.

    GPUs (``device`` ``cuda``, or ``auto`` with ``gpus`` > 0): controller c gets an even,
    contiguous share of the ``gpus`` visible ones, or GPU ``c mod gpus`` when there are fewer
    GPUs than controllers (those controllers share it). ``device="cuda"`` with no GPU is an
    error; ``cpu`` assigns none.
    """
    if controllers < 1:
        raise ValueError(f"assign_resources: controllers must be >= 1, got {controllers}")
    check_choice("assign_resources", "placement", placement, PLACEMENTS)
    check_choice("assign_resources", "device", device, DEVICES)
    if device == "cuda" and gpus < 1:
        raise RuntimeError(
            "device=cuda, but no CUDA device is visible to the driver; use --device cpu "
            "(or auto: CUDA where present)"
        )
    ids = tuple(sorted(set(cores)))
    if not ids:
        raise ValueError("assign_resources: no CPU cores to assign")
    if placement == "colocated" and max_staleness == 0:
        shares = [ids] * controllers
    else:
        shares = split_evenly(ids, controllers)
    use_gpus = gpus if device != "cpu" else 0
    gpu_shares = split_evenly(tuple(range(use_gpus)), controllers) if use_gpus else None
    return [
        Resources(share, len(share), gpu_shares[c] if gpu_shares else ())
        for c, share in enumerate(shares)
    ]


def split_evenly(ids: tuple[int, ...], parts: int) -> list[tuple[int, ...]]:
    """``ids`` cut into ``parts`` contiguous runs as even as possible (the first ones get the
    extra); with fewer ids than parts, part c gets ``ids[c mod len(ids)]``."""
    if len(ids) < parts:
        return [(ids[c % len(ids)],) for c in range(parts)]
    return [ids[c * len(ids) // parts : (c + 1) * len(ids) // parts] for c in range(parts)]


def cuda_visible_devices(cuda: Sequence[int], parent: str | None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value for a child that may use GPUs ``cuda`` (ordinals
    among the parent's visible GPUs): the parent's own entries when it has the variable set
    (ids or UUIDs), else the ordinals."""
    entries = [e.strip() for e in parent.split(",")] if parent else None
    if entries is not None:
        bad = [i for i in cuda if not 0 <= i < len(entries)]
        if bad:
            raise ValueError(
                f"GPU ordinals {bad} are not among the {len(entries)} in "
                f"CUDA_VISIBLE_DEVICES={parent!r}"
            )
        return ",".join(entries[i] for i in cuda)
    return ",".join(str(i) for i in cuda)


class SlotPool:
    """The devices of this process, with per-device busy/switch/idle accounting (thread-safe)."""

    def __init__(self, slots: Sequence[Slot]):
        if not slots:
            raise ValueError("SlotPool needs at least one device")
        names = [d.name for d in slots]
        if len(set(names)) != len(names):
            raise ValueError(f"SlotPool: duplicate devices in {names}")
        self.slots = list(slots)
        self._lock = threading.Lock()
        self._stats = {d.name: SlotStats() for d in self.slots}
        self._t0 = time.monotonic()

    @classmethod
    def detect(cls, cpu_slots: int | None = None, kind: str = "any") -> SlotPool:
        """CUDA devices when present (``torch.cuda.device_count()``), else CPU slots.

        ``kind="cpu"`` forces CPU slots, ``kind="cuda"`` fails without a GPU. ``cpu_slots``
        sets the slot count (default: ``$YATT_CPU_SLOTS``, else the usable cores).
        """
        check_choice("SlotPool.detect", "kind", kind, ("any", "cpu", "cuda"))
        n_cuda = 0
        if kind != "cpu":
            import torch

            n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n_cuda:
            return cls([Slot("cuda", i) for i in range(n_cuda)])
        if kind == "cuda":
            raise RuntimeError("SlotPool.detect(kind='cuda'): no CUDA device is visible")
        n = cpu_slot_count() if cpu_slots is None else cpu_slots
        if n < 1:
            raise ValueError(f"SlotPool.detect: cpu_slots must be >= 1, got {n}")
        return cls([Slot("cpu", i) for i in range(n)])

    @classmethod
    def cpu(cls, slots: int) -> SlotPool:
        """``slots`` CPU worker slots, whatever the machine has."""
        return cls([Slot("cpu", i) for i in range(slots)])

    # --- the devices ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self) -> Iterator[Slot]:
        return iter(self.slots)

    def __getitem__(self, index: int) -> Slot:
        return self.slots[index]

    def __repr__(self) -> str:
        return f"SlotPool([{', '.join(d.name for d in self.slots)}])"

    # --- accounting ----------------------------------------------------------------------
    def start(self) -> None:
        """Start a new accounting window (clears the counts; a call running now is counted
        from the start of the window)."""
        with self._lock:
            fresh = {d.name: SlotStats() for d in self.slots}
            for name, st in self._stats.items():
                fresh[name].running, fresh[name].since = st.running, st.since
            self._stats = fresh
            self._t0 = time.monotonic()

    @contextlib.contextmanager
    def busy(self, device: Slot, node: str) -> Iterator[None]:
        """Count the time inside the block as ``device`` busy running ``node``."""
        self._begin(device, node)
        try:
            yield
        finally:
            self._end(device, node, switch=False)

    @contextlib.contextmanager
    def switching(self, device: Slot, node: str) -> Iterator[None]:
        """Count the time inside the block as ``device`` switching roles to ``node``."""
        self._begin(device, f"switch->{node}")
        try:
            yield
        finally:
            self._end(device, node, switch=True)

    def _begin(self, device: Slot, what: str) -> None:
        with self._lock:
            st = self._stats[device.name]
            if st.running is not None:
                raise RuntimeError(
                    f"device {device.name} asked to run {what!r} while still running "
                    f"{st.running!r}; one worker per device"
                )
            st.running, st.since = what, time.monotonic()

    def _end(self, device: Slot, node: str, switch: bool) -> None:
        with self._lock:
            st = self._stats[device.name]
            now = time.monotonic()
            # Time before the window started (a call spanning start()) is not counted.
            dt = now - max(st.since, self._t0)
            st.running = None
            if switch:
                st.switch_s += dt
                st.switches += 1
            else:
                st.busy_s += dt
                st.calls += 1
                st.node_busy_s[node] = st.node_busy_s.get(node, 0.0) + dt

    def summary(self) -> dict[str, Any]:
        """Per device: busy, switch and idle seconds, utilization (busy / window) and calls.

        A call still running is counted up to now. JSON-able.
        """
        with self._lock:
            now = time.monotonic()
            window = now - self._t0
            slots: dict[str, Any] = {}
            for name, st in self._stats.items():
                busy, switch = st.busy_s, st.switch_s
                if st.running is not None:
                    extra = now - max(st.since, self._t0)
                    if st.running.startswith("switch->"):
                        switch += extra
                    else:
                        busy += extra
                slots[name] = {
                    "busy_s": busy,
                    "switch_s": switch,
                    "idle_s": max(0.0, window - busy - switch),
                    "utilization": busy / window if window > 0 else 0.0,
                    "calls": st.calls,
                    "switches": st.switches,
                    "node_busy_s": dict(st.node_busy_s),
                }
        utils = [d["utilization"] for d in slots.values()]
        return {
            "window_s": window,
            "slots": slots,
            "mean_utilization": sum(utils) / len(utils),
        }


SPIN_COUNT = 300_000
"""``GOMP_SPINCOUNT`` of a spinning process: busy-wait iterations before an idle OpenMP thread
sleeps (a few ms; libgomp's own default). Long enough for colocated controllers that take turns
to find their threads awake when a step's values come back: on the demo (mm_ppo, AMD EPYC, 2
cores, idle) two controllers stepped at 1.3-1.6x the in-process time with 100 000 and at
1.0-1.1x with 300 000, and in-process the two counts measure alike
(``python -m bench.e2e --workloads a``)."""

_WAIT, _SPIN, _THREADS = "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS"
_MARK = "YATT_OPENMP"
"""Set beside the OpenMP variables yatt-graph chose, so a child tells them from a user's."""


class ThreadPolicy(msgspec.Struct, frozen=True):
    """What one run's processes compute with, and why."""

    threads: int
    """torch threads of the process that runs the nodes (in-process), or of each controller
    when fixed (``--threads``); 0: each controller's share of cores decides."""
    spin: bool
    """Idle OpenMP threads spin (bounded) instead of sleeping at once."""
    cores: int
    """Cores this process may run on (its affinity)."""
    free: float
    """Of those, how many other processes left free (measured), in cores."""
    reason: str
    """Why: what was measured or set."""

    def describe(self) -> str:
        """One line for the log: ``2 torch threads, spinning OpenMP (2.0 of 2 cores free)``."""
        if self.threads:
            threads = f"{self.threads} torch thread{'s' * (self.threads != 1)}"
        else:
            threads = "each controller's torch threads from its cores"
        wait = "spinning" if self.spin else "sleeping"
        return f"{threads}, {wait} OpenMP threads ({self.reason})"

    def metrics(self) -> dict[str, float]:
        """``sched/threads`` and ``sched/spin`` for each metrics row."""
        out = {"sched/spin": float(self.spin)}
        if self.threads:
            out["sched/threads"] = float(self.threads)
        return out


def _cpu_ticks(cores: Sequence[int]) -> tuple[int, int]:
    """(busy, total) clock ticks of ``cores`` since boot, from ``/proc/stat``."""
    busy = total = 0
    wanted = {f"cpu{c}" for c in cores}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name in wanted:
                # user nice system idle iowait irq softirq steal
                ticks = [int(x) for x in fields[:8]]
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total


def busy_elsewhere(cores: Sequence[int], window_s: float = 0.1, windows: int = 3) -> float | None:
    """How many of ``cores`` other processes keep busy (in cores, 0 to ``len(cores)``), this
    process's own CPU time taken out: the least of ``windows`` back-to-back windows of
    ``window_s`` seconds, so a moment's work elsewhere (a shell command) does not count as a
    busy core, while a process that computes all along does. None where ``/proc/stat``
    cannot be read (not Linux)."""
    seen = []
    try:
        busy0, total0 = _cpu_ticks(cores)
        own0 = sum(os.times()[:2])
        for _ in range(windows):
            time.sleep(window_s)
            busy1, total1 = _cpu_ticks(cores)
            own1 = sum(os.times()[:2])
            if total1 > total0:
                share = (busy1 - busy0) / (total1 - total0)  # of all the ticks of these cores
                own = (own1 - own0) / window_s  # cores' worth of this process's own time
                seen.append(share * len(cores) - own)
            busy0, total0, own0 = busy1, total1, own1
    except (OSError, ValueError):
        return None
    return min(float(len(cores)), max(0.0, min(seen))) if seen else None


def decide(
    cores: int,
    busy: float | None,
    *,
    threads: int | None = None,
    shared: bool = False,
    env: Mapping[str, str] | None = None,
) -> ThreadPolicy:
    """The policy of a run on ``cores`` cores of which others keep ``busy`` busy (a pure
    function).

    ``threads``: the user's fixed count (``--threads``), else ``OMP_NUM_THREADS`` in ``env``,
    else one per free core (at least one). ``shared``: other processes of this run compute on
    these cores at the same time, so none spins. Spinning needs a free core for every thread;
    a user's ``OMP_WAIT_POLICY``/``GOMP_SPINCOUNT`` in ``env`` decides it instead.
    """
    env = os.environ if env is None else env
    free = float(cores) if busy is None else max(0.0, cores - busy)
    measured = "not measured" if busy is None else f"{free:.1f} of {cores} cores free"
    reason = [measured]
    if threads:
        n = threads
        reason.append("--threads")
    elif (env.get(_THREADS) or "").strip().isdigit() and int(env[_THREADS]) > 0:
        n = int(env[_THREADS])
        reason.append(f"{_THREADS}={env[_THREADS]}")
    else:
        n = max(1, min(cores, int(free + 0.5)))
    spin = n > 1 and not shared and free >= n - 0.5
    if shared and n > 1:
        reason.append("other processes of the run share the cores")
    user = _user_openmp(env)
    if user:
        spin = user.get(_WAIT, "").upper() != "PASSIVE" and user.get(_SPIN, "1") != "0"
        reason.append(", ".join(f"{k}={v}" for k, v in user.items()))
    return ThreadPolicy(n, spin, cores, free, "; ".join(reason))


def run_policy(
    cores: Sequence[int], *, threads: int | None, shared: bool, controllers: bool
) -> ThreadPolicy:
    """The policy of a run started in this process on ``cores``, measured now
    (:func:`busy_elsewhere`, :func:`decide`), and made true for it: the OpenMP setting goes
    into this process's environment before torch loads (libgomp reads it then), where the
    controllers started later inherit it. With ``controllers`` the thread count is each
    controller's share (0) unless ``threads`` fixes it, and the policy is theirs: they start
    later and take it whatever this process loaded. Where torch is loaded already in a run
    without controllers (a caller's), its OpenMP setting holds and the policy says so."""
    policy = decide(len(cores), busy_elsewhere(cores), threads=threads, shared=shared)
    if controllers:
        policy = msgspec.structs.replace(policy, threads=threads or 0)
    if "torch" in sys.modules and not controllers:
        spins = os.environ.get(_WAIT, "").upper() != "PASSIVE" and policy.threads != 1
        reason = f"{policy.reason}; OpenMP was loaded before the run"
        return msgspec.structs.replace(policy, spin=spins, reason=reason)
    os.environ.update(openmp_env(os.environ, policy.spin))
    return policy


def _user_openmp(env: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP wait settings in ``env`` that a user made (not yatt-graph)."""
    if _MARK in env:
        return {}
    return {k: env[k] for k in (_WAIT, _SPIN) if k in env}


def openmp_env(env: Mapping[str, str], spin: bool | None) -> dict[str, str]:
    """``env`` for a process whose idle OpenMP threads spin (bounded) or sleep at once; None:
    as the run decided (the setting ``env`` already carries: a controller takes its driver's),
    sleeping where nothing did. A user's own ``OMP_WAIT_POLICY``/``GOMP_SPINCOUNT`` stays."""
    out = dict(env)
    if _user_openmp(env) or (spin is None and _MARK in env):
        return out
    spin = bool(spin)
    out.pop(_WAIT, None)
    out.pop(_SPIN, None)
    out.update({_SPIN: str(SPIN_COUNT)} if spin else {_WAIT: "PASSIVE"})
    out[_MARK] = "spin" if spin else "passive"
    return out


def passive_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a helper process that computes while others of the run do (a replica): it
    does not spin, unless the user said otherwise."""
    return openmp_env(env, spin=False)
