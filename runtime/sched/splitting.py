"""Split a node's call across devices inside an executor, through the batching scheduler.

Both executors (``LocalExecutor(devices=...)``, ``ZmqExecutor(devices=...)`` and
``yatt-graph run --devices N``) give each process a :class:`~runtime.sched.devices.DevicePool`
and hand the calls of its *splittable* nodes to a :class:`~runtime.sched.scheduler.Scheduler`:
the step's batch is cut into micro-batches balanced by cost (Karmarkar-Karp), at least one
per device and each within the node's ``BatchPolicy.max_batch_size`` / ``max_tokens``; each
device's worker runs the next micro-batch when it is free, and the results come back in
the batch's order. Every other node runs whole, on the executor's thread, as before.

A node is split here when it declares a per-call budget (``BatchPolicy.max_batch_size`` or
``max_tokens`` > 0: a promise that it may be called on any part of a batch), its
``BatchPolicy.splittable`` is true (nodes whose result depends on the whole batch, such as
advantage whitening, group baselines, an optimizer step or a sampler with one random stream
per call, say False), it has inputs, and the values it gets hold samples (a tensor or list
per sample). In the node library that is the vision encoder, the rewards, the reference and the critic.
Which input ports are shared by all samples (weights, a scalar, a tensor whose first axis is
not the batch axis) is read from the port specs and the values: a tensor port with no dimensions or a fixed first one is
shared; any other tensor or list is per sample. A call whose per-sample values disagree in
length (per-prompt image embeddings next to per-response tokens, as with several samples per
prompt) runs whole.

The split is a pure function of the batch, its costs, the device count and the policy, so
two runs with the same ``devices`` give the same micro-batches: a ZeroMQ run equals the
in-process one. Results differ from an unsplit run only by float rounding (a matmul over
fewer rows may sum in another order).

CPU devices are worker threads over one process's model (torch releases the GIL in its
kernels), so with ``num_threads=1`` per controller N slots use N cores. CUDA devices would
need a replica of the node's model per device; this module does not make replicas, so a
pool with CUDA devices is refused here with that reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime.sched.batching import _is_batched
from runtime.sched.devices import DevicePool
from runtime.sched.scheduler import Scheduler, SchedulerError
from yatt_graph.types import TensorSpec

__all__ = ["NodeSplitter", "device_pool", "shared_ports"]


def device_pool(devices: int | str | DevicePool | None) -> DevicePool | None:
    """``None``/0: no splitting; an int: that many CPU slots; ``"auto"``: ``$YATT_CPU_SLOTS``
    or the usable cores; a DevicePool as it is (CPU only, see the module docstring)."""
    if devices is None or devices == 0:
        return None
    if isinstance(devices, DevicePool):
        pool = devices
    elif devices == "auto":
        pool = DevicePool.detect(kind="cpu")
    elif isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        pool = DevicePool.cpu(devices)
    else:
        raise ValueError(
            f"devices must be None, a positive int (CPU slots), 'auto' or a DevicePool, got {devices!r}"
        )
    if any(d.kind != "cpu" for d in pool):
        raise ValueError(
            f"devices={pool}: splitting a node across CUDA devices needs a replica of its model "
            "per device, which the executors do not make yet; use CPU slots, or place nodes on "
            "GPUs through the plan (one controller per GPU)"
        )
    return pool


def shared_ports(node: Any) -> frozenset[str]:
    """Input ports of ``node`` that never hold one entry per sample: tensor ports with no
    dimensions or a fixed first dimension (a list or a tensor on any other port counts as per
    sample when its length is the batch's; see :meth:`NodeSplitter.call`)."""
    return frozenset(
        name
        for name, port in node.inputs.items()
        if isinstance(port.spec, TensorSpec)
        and (not port.spec.shape or isinstance(port.spec.shape[0], int))
    )


def _splittable(node: Any) -> bool:
    policy = node.batch_policy
    return bool(policy.splittable and (policy.max_batch_size or policy.max_tokens) and node.inputs)


class NodeSplitter:
    """The scheduler of one executor (or controller) for its splittable nodes.

    ``call(name, inputs)`` runs one node call: split across the pool when the node is
    splittable and ``inputs`` hold samples, else whole via ``node.run``.
    """

    def __init__(self, nodes: Mapping[str, Any], pool: DevicePool):
        self.pool = pool
        self.nodes = dict(nodes)
        self.shared = {
            name: shared_ports(node) for name, node in self.nodes.items() if _splittable(node)
        }
        self.scheduler: Scheduler | None = None
        if self.shared:
            sched = Scheduler(pool, threads_per_worker=None)
            for name, shared in self.shared.items():
                sched.add_node(self.nodes[name], shared=shared, keep=True)
            self.scheduler = sched.start()

    @property
    def split_nodes(self) -> list[str]:
        """The nodes whose calls this splitter may cut."""
        return sorted(self.shared)

    def call(self, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
        node = self.nodes[name]
        shared = self.shared.get(name)
        sizes = {
            len(v)
            for p, v in inputs.items()
            if shared is not None and p not in shared and _is_batched(v)
        }
        if self.scheduler is None or len(sizes) != 1:
            # Nothing per sample, or ports of different lengths (per-prompt inputs next to
            # per-response ones: a cut could separate a prompt from its responses): whole.
            return node.run(inputs)
        ticket = self.scheduler.submit(name, inputs)
        self.scheduler.flush(name)  # one request per step: nothing else is coming to fuse
        try:
            out = ticket.result(name)
        except SchedulerError as exc:  # the node's own error is the cause
            raise (exc.__cause__ or exc) from None
        return node._check_outputs(out, None)

    def summary(self) -> dict[str, Any]:
        """The scheduler's device utilization and per-node counts (empty when nothing splits)."""
        return self.scheduler.summary() if self.scheduler is not None else {}

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
            self.scheduler = None
