"""How many torch threads a process computes with, and whether its idle OpenMP threads spin.

Two settings decide how fast small torch ops run on a CPU:

* the **thread count**: more threads than free cores make every parallel region wait for a
  preempted thread; fewer leave cores idle;
* the **OpenMP wait policy**: after a parallel region, torch's OpenMP threads (libgomp) either
  spin for a while, ready for the next region, or sleep at once (``OMP_WAIT_POLICY=PASSIVE``),
  and every region then pays a wake-up. With a small model's thousands of short regions a
  step, sleeping threads made the demo's step 2.3x slower on an idle machine; spinning ones
  burn the cores that another busy process needs, which made a loaded machine's step
  several times slower.

So a process spins only where it owns its cores: :func:`decide` measures, before torch loads,
how much of this process's cores other processes use (:func:`busy_elsewhere`, from
``/proc/stat``: the least of three 0.1 s windows), and gives the run one torch thread per free core,
spinning when those cores are free and no other process of the run computes on them at the
same time (replica or rank processes, controllers that outnumber the cores). The spin is
bounded (:data:`SPIN_COUNT` iterations, a few milliseconds), so a process that stops computing
frees its cores soon even when the measurement was wrong.

The wait policy is read once, when torch loads OpenMP: it travels in the environment
(:func:`openmp_env`), set for this process before torch is imported and inherited by the
controllers it starts. A user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is kept, as is
an ``OMP_NUM_THREADS`` for the thread count, and ``yatt-graph run --threads N`` fixes it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence

import msgspec

__all__ = [
    "SPIN_COUNT",
    "ThreadPolicy",
    "busy_elsewhere",
    "decide",
    "openmp_env",
    "passive_env",
    "run_policy",
]

SPIN_COUNT = 100_000
"""``GOMP_SPINCOUNT`` of a spinning process: busy-wait iterations before an idle OpenMP thread
sleeps (about 1-5 ms; libgomp's own default is 300 000). Measured on the demo (mm_ppo, 2 cores,
idle): 43 ms a step, against 43 ms spinning for ever (ACTIVE) and 98 ms sleeping at once."""

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
    controller's share (0) unless ``threads`` fixes it. Where torch is loaded already (a
    caller's), its OpenMP setting holds and the policy says so."""
    policy = decide(len(cores), busy_elsewhere(cores), threads=threads, shared=shared)
    if controllers:
        policy = msgspec.structs.replace(policy, threads=threads or 0)
    if "torch" in sys.modules:
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
