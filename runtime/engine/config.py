"""How a plan runs: :class:`RunConfig`, the one set of run options both executors take.

``LocalExecutor(plan, config)`` reads the options that apply to one process; ``ZmqExecutor(plan,
config)`` sends the whole struct to every controller inside its SETUP message, so an option is
one field here, read where it is used. The ``yatt-graph run`` flags parse into it once
(``runtime/flags.py``). Keyword arguments to an executor are fields of it:
``LocalExecutor(graph, slots=2)`` is ``LocalExecutor(graph, RunConfig(slots=2))``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from runtime.sched.devices import DEVICES, PLACEMENTS, check_choice

__all__ = [
    "OFFLOAD_MODES",
    "STALENESS_MODES",
    "check_offload",
    "check_staleness_mode",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "RunConfig",
    "merged_config",
]

DEFAULT_MAX_MESSAGE_BYTES = 4 << 30
"""The largest frame a runtime socket accepts by default (4 GiB)."""


STALENESS_MODES = ("fixed", "bound")


def check_staleness_mode(staleness: Any, who: str) -> str:
    """``staleness`` if it is one of :data:`STALENESS_MODES`, else a ValueError saying both."""
    if staleness not in STALENESS_MODES:
        raise ValueError(
            f"{who}: staleness must be 'fixed' (a delayed edge reads the value from exactly "
            f"max_staleness+1 steps back: reproducible) or 'bound' (the newest value at most "
            f"max_staleness versions old), got {staleness!r}"
        )
    return staleness


OFFLOAD_MODES = ("auto", "on", "off")


def check_offload(offload: Any, who: str) -> str:
    """``offload`` as one of ``auto``, ``on``, ``off``, or a ValueError saying what they mean."""
    if offload not in OFFLOAD_MODES:
        raise ValueError(
            f"{who}: offload must be 'auto' (offload when a CUDA device is time-shared under "
            f"colocated placement), 'on' or 'off', got {offload!r}"
        )
    return offload


class RunConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The options of a run, for both executors (``verify()`` checks them all)."""

    max_staleness: int = 0
    """0: on-policy (reference semantics); N: a delayed edge may carry a value from up to N+1
    steps back, so the graph upstream of it runs up to N steps ahead."""
    staleness: str = "fixed"
    """``"fixed"``: always the value from exactly N+1 steps back (reproducible); ``"bound"``:
    the newest value at most N versions old (runtime.engine.engine)."""
    slots: int | str | None = None
    """CPU slots per process that splittable nodes' calls are cut across
    (runtime.sched.fanout); None/0: none; ``"auto"``: ``$YATT_CPU_SLOTS`` or the usable
    cores."""
    check_finite: bool = False
    """Stop at the node whose float tensor output holds NaN or inf (runtime.engine.calls)."""
    replicas: dict[str, int] = {}
    """``{node: R}``: R copies of an inference node, over its ``BatchPolicy.replicas``
    (runtime.sched.fanout)."""
    offload: str = "auto"
    """``"auto"``: a controller whose GPU another shares under colocated placement on-policy
    offloads its nodes' device state when its part of a step ends and reloads it before its
    next model call (runtime.engine.switch); ``"on"``: every one does; ``"off"``: none."""
    pipeline_depth: int = 2
    """Most steps in flight on controllers (at least ``max_staleness + 1``)."""
    node_timeout_s: float = 0.0
    """The longest one node call may run, for nodes whose ``BatchPolicy.timeout_s`` is 0;
    0: no limit."""
    hang_warning_s: float = 0.0
    """Warn (with the stack) when a call without a time limit runs this long; 0: past
    ``max(60 s, 10 x`` the node's longest earlier call), 300 s for a first call."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """The largest frame a runtime socket accepts and a controller sends (a larger output is
    an error naming it); 0: no limit."""
    heartbeat_interval_s: float = 0.5
    """How often controllers and the driver say they are alive."""
    heartbeat_timeout_s: float = 5.0
    """Silence after which a controller (or the driver) counts as lost."""
    num_threads: int | None = None
    """``torch.set_num_threads`` in each controller, fixed for the run (0: torch's default);
    None: each controller's ``Resources.threads``, which adaptive partitioning may change."""
    shm_threshold: int = 1 << 20
    """Tensors of at least this many bytes go controller to controller through shared memory
    (one host); 0 sends everything as zmq frames."""
    spin_s: float = 0.001
    """How long the driver polls for a step's result before it blocks (only while steps come
    back within it: tiny nodes); 0 never spins."""
    placement: str = "colocated"
    """How controllers share the host (runtime.sched.devices.assign_resources): with
    ``"colocated"`` on-policy every controller gets every core (they take turns), else each a
    disjoint share."""
    device: str = "auto"
    """``"cuda"`` (or ``"auto"`` where GPUs are visible) gives each controller its GPUs
    (``CUDA_VISIBLE_DEVICES``); ``"cpu"``: none."""
    adaptive: bool = True
    """Re-balance cores between controllers between steps from their measured busy time
    (runtime.sched.adaptive); only with ``num_threads=None`` and controllers started here."""
    cuda_ipc: bool | None = None
    """CUDA tensors between controllers on one host travel by CUDA IPC (runtime.codec.cuda_ipc);
    None: on, unless ``$YATT_CUDA_IPC=0``."""
    ranks_per_host: int = 0
    """How many of a rank group's ranks each host of the run holds (runtime.ranks): the node's
    host the first ones, the next hosts the rest; 0: every rank on the node's host."""
    replicas_per_host: int = 0
    """How many copies of a node with replicas each host of the run holds (runtime.zmq.replicas):
    the node's host the first ones (the node among them), the next hosts the rest; 0: every
    replica on the node's host."""

    def verify(self, who: str = "RunConfig") -> RunConfig:
        """The config, or a ValueError naming the first field that is wrong and what it takes."""
        if not _count(self.max_staleness):
            raise ValueError(
                f"{who}: max_staleness must be an int >= 0 (how many weight versions a rollout "
                f"may lag behind the update; 0 is on-policy), got {self.max_staleness!r}"
            )
        check_staleness_mode(self.staleness, who)
        check_offload(self.offload, who)
        if self.slots not in (None, "auto") and not _count(self.slots):
            raise ValueError(
                f"{who}: slots must be None, a CPU slot count >= 0 or 'auto', got {self.slots!r}"
            )
        if not isinstance(self.replicas, dict) or not all(
            isinstance(k, str) for k in self.replicas
        ):
            raise ValueError(f"{who}: replicas must be a dict of node name to count")
        if not _count(self.pipeline_depth) or self.pipeline_depth < 1:
            raise ValueError(f"{who}: pipeline_depth must be an int >= 1")
        if self.node_timeout_s < 0 or not _count(self.max_message_bytes):
            raise ValueError(f"{who}: node_timeout_s and max_message_bytes must be >= 0")
        if self.num_threads is not None and not _count(self.num_threads):
            raise ValueError(f"{who}: num_threads must be None or >= 0, got {self.num_threads!r}")
        spin = self.spin_s
        if isinstance(spin, bool) or not isinstance(spin, int | float) or not 0 <= spin <= 1:
            raise ValueError(
                f"{who}: spin_s must be between 0 and 1 second, got {spin!r} "
                "(0.001 is the default; 0 never spins)"
            )
        check_choice(who, "placement", self.placement, PLACEMENTS)
        check_choice(who, "device", self.device, DEVICES)
        for name in ("ranks_per_host", "replicas_per_host"):
            if not _count(getattr(self, name)):
                raise ValueError(
                    f"{who}: {name} must be an int >= 0 (0: every copy on its node's host), "
                    f"got {getattr(self, name)!r}"
                )
        return self

    @property
    def window(self) -> int:
        """Steps in flight on controllers: ``pipeline_depth``, at least ``max_staleness + 1``."""
        return max(self.pipeline_depth, self.max_staleness + 1)


def merged_config(config: RunConfig | None, options: dict[str, Any], who: str) -> RunConfig:
    """``config`` with ``options`` (field name -> value) over it, verified; an unknown option
    is a TypeError naming the fields."""
    unknown = sorted(set(options) - set(RunConfig.__struct_fields__))
    if unknown:
        raise TypeError(
            f"{who}: unknown option(s) {unknown}; the run options are the fields of RunConfig: "
            f"{', '.join(RunConfig.__struct_fields__)}"
        )
    config = msgspec.structs.replace(config or RunConfig(), **options)
    return config.verify(who)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
