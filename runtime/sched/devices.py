"""The device pool: CUDA devices when present, else CPU worker slots; busy/idle accounting.

A :class:`Device` is what one worker of the scheduler runs on: ``cuda:i`` or a CPU slot
``cpu:i`` (on a machine without GPUs, slots are threads that each own a share of the
cores). The :class:`DevicePool` keeps, per device, how long it was busy running node calls,
how long it spent switching roles (offload/reload when roles time-share a device), and so
how long it sat idle, over a window that starts with :meth:`DevicePool.start`. For every
device ``busy_s + switch_s + idle_s == window_s``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Device", "DevicePool", "DeviceStats", "cpu_slot_count", "usable_cores"]

CPU_SLOTS_ENV = "YATT_CPU_SLOTS"


@dataclass(frozen=True)
class Device:
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
class DeviceStats:
    """Accounting for one device."""

    busy_s: float = 0.0
    switch_s: float = 0.0
    calls: int = 0
    switches: int = 0
    node_busy_s: dict[str, float] = field(default_factory=dict)
    running: str | None = None
    """The node running now (None when idle)."""
    since: float = 0.0


def cpu_slot_count(default: int | None = None) -> int:
    """CPU worker slots: ``$YATT_CPU_SLOTS``, else ``default``, else the usable cores."""
    env = os.environ.get(CPU_SLOTS_ENV)
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"${CPU_SLOTS_ENV} must be an integer, got {env!r}") from None
        if n < 1:
            raise ValueError(f"${CPU_SLOTS_ENV} must be >= 1, got {n}")
        return n
    if default is not None:
        return default
    return usable_cores()


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class DevicePool:
    """The devices of this process, with per-device busy/switch/idle accounting (thread-safe)."""

    def __init__(self, devices: Sequence[Device]):
        if not devices:
            raise ValueError("DevicePool needs at least one device")
        names = [d.name for d in devices]
        if len(set(names)) != len(names):
            raise ValueError(f"DevicePool: duplicate devices in {names}")
        self.devices = list(devices)
        self._lock = threading.Lock()
        self._stats = {d.name: DeviceStats() for d in self.devices}
        self._t0 = time.monotonic()

    @classmethod
    def detect(cls, cpu_slots: int | None = None, kind: str = "any") -> DevicePool:
        """CUDA devices when present (``torch.cuda.device_count()``), else CPU slots.

        ``kind="cpu"`` forces CPU slots, ``kind="cuda"`` fails without a GPU. ``cpu_slots``
        sets the slot count (default: ``$YATT_CPU_SLOTS``, else the usable cores).
        """
        if kind not in ("any", "cpu", "cuda"):
            raise ValueError(
                f"DevicePool.detect: kind must be 'any', 'cpu' or 'cuda', got {kind!r}"
            )
        n_cuda = 0
        if kind != "cpu":
            import torch

            n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n_cuda:
            return cls([Device("cuda", i) for i in range(n_cuda)])
        if kind == "cuda":
            raise RuntimeError("DevicePool.detect(kind='cuda'): no CUDA device is visible")
        n = cpu_slot_count(cpu_slots) if cpu_slots is None else cpu_slots
        if n < 1:
            raise ValueError(f"DevicePool.detect: cpu_slots must be >= 1, got {n}")
        return cls([Device("cpu", i) for i in range(n)])

    @classmethod
    def cpu(cls, slots: int) -> DevicePool:
        """``slots`` CPU worker slots, whatever the machine has."""
        return cls([Device("cpu", i) for i in range(slots)])

    # --- the devices ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.devices)

    def __iter__(self) -> Iterator[Device]:
        return iter(self.devices)

    def __getitem__(self, index: int) -> Device:
        return self.devices[index]

    def __repr__(self) -> str:
        return f"DevicePool([{', '.join(d.name for d in self.devices)}])"

    # --- accounting ----------------------------------------------------------------------
    def start(self) -> None:
        """Start a new accounting window (clears the counts; a call running now is counted
        from the start of the window)."""
        with self._lock:
            fresh = {d.name: DeviceStats() for d in self.devices}
            for name, st in self._stats.items():
                fresh[name].running, fresh[name].since = st.running, st.since
            self._stats = fresh
            self._t0 = time.monotonic()

    @contextlib.contextmanager
    def busy(self, device: Device, node: str) -> Iterator[None]:
        """Count the time inside the block as ``device`` busy running ``node``."""
        self._begin(device, node)
        try:
            yield
        finally:
            self._end(device, node, switch=False)

    @contextlib.contextmanager
    def switching(self, device: Device, node: str) -> Iterator[None]:
        """Count the time inside the block as ``device`` switching roles to ``node``."""
        self._begin(device, f"switch->{node}")
        try:
            yield
        finally:
            self._end(device, node, switch=True)

    def _begin(self, device: Device, what: str) -> None:
        with self._lock:
            st = self._stats[device.name]
            if st.running is not None:
                raise RuntimeError(
                    f"device {device.name} asked to run {what!r} while still running "
                    f"{st.running!r}; one worker per device"
                )
            st.running, st.since = what, time.monotonic()

    def _end(self, device: Device, node: str, switch: bool) -> None:
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
            devices: dict[str, Any] = {}
            for name, st in self._stats.items():
                busy, switch = st.busy_s, st.switch_s
                if st.running is not None:
                    extra = now - max(st.since, self._t0)
                    if st.running.startswith("switch->"):
                        switch += extra
                    else:
                        busy += extra
                devices[name] = {
                    "busy_s": busy,
                    "switch_s": switch,
                    "idle_s": max(0.0, window - busy - switch),
                    "utilization": busy / window if window > 0 else 0.0,
                    "calls": st.calls,
                    "switches": st.switches,
                    "node_busy_s": dict(st.node_busy_s),
                }
        utils = [d["utilization"] for d in devices.values()]
        return {
            "window_s": window,
            "devices": devices,
            "mean_utilization": sum(utils) / len(utils),
        }
