"""Split a node's call across devices inside an executor.

Both executors (``LocalExecutor(devices=...)``, ``ZmqExecutor(devices=...)`` and
``yatt-graph run --devices N``) give each process a :class:`~runtime.sched.devices.DevicePool`
and hand the calls of its *splittable* nodes to a :class:`NodeSplitter`: the step's batch is cut into micro-batches balanced by cost (Karmarkar-Karp), at least one
per device and each within the node's ``BatchPolicy.max_batch_size`` / ``max_tokens``; each
device's worker runs the next micro-batch when it is free, and the results come back in
the batch's order. Every other node runs whole, on the executor's thread.

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

import queue
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from runtime.sched.batching import _is_batched, join_outputs, micro_batches, sample_costs, split
from runtime.sched.devices import Device, DevicePool
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
    """The splittable nodes of one executor (or controller) and the devices they are cut across.

    ``call(name, inputs)`` runs one node call: cut into micro-batches across the pool when the
    node is splittable and ``inputs`` hold samples, else whole via ``node.run``. Each device
    is a worker thread that takes the next micro-batch (heaviest first) when it is free.
    """

    def __init__(self, nodes: Mapping[str, Any], pool: DevicePool):
        self.pool = pool
        self.nodes = dict(nodes)
        self.shared = {
            name: shared_ports(node) for name, node in self.nodes.items() if _splittable(node)
        }
        self.calls = dict.fromkeys(self.shared, 0)
        self.samples = dict.fromkeys(self.shared, 0)
        self._jobs: queue.SimpleQueue[tuple[Any, dict[str, Any], Future] | None] = (
            queue.SimpleQueue()
        )
        # One daemon thread per device, named for it (a hang's report shows their stacks); a
        # call stuck in a node never holds up the process's exit.
        self._threads = [
            threading.Thread(target=self._serve, args=(d,), name=f"yatt-{d.name}", daemon=True)
            for d in pool
        ] if self.shared else []  # fmt: skip
        for thread in self._threads:
            thread.start()
        pool.start()

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
        if shared is None or len(sizes) != 1:
            # Nothing per sample, or ports of different lengths (per-prompt inputs next to
            # per-response ones: a cut could separate a prompt from its responses): whole.
            return node.run(inputs)
        costs = sample_costs(inputs, where=f"node {name!r}")
        policy = node.batch_policy
        parts = micro_batches(costs, len(self.pool), policy.max_batch_size, policy.max_tokens)
        self.calls[name] += len(parts)
        self.samples[name] += len(costs)
        micro = [inputs] if len(parts) == 1 else split(inputs, parts, shared)
        jobs = [Future() for _ in micro]
        for mb, job in zip(micro, jobs):  # heaviest first: the next free device takes the next
            self._jobs.put((node, mb, job))
        outs = [job.result() for job in jobs]  # the first failed part's own error
        if len(outs) == 1:
            return outs[0]
        return node._check_outputs(
            join_outputs(outs, parts, node.pad_values(), node.left_padded), None
        )

    def _serve(self, device: Device) -> None:
        while (job := self._jobs.get()) is not None:
            node, inputs, result = job
            try:
                with self.pool.busy(device, node.name):
                    result.set_result(node.run(inputs))
            except BaseException as exc:  # the caller raises it
                result.set_exception(exc)

    def summary(self) -> dict[str, Any]:
        """Per device busy/idle time and utilization, and per node its micro-batches."""
        out = self.pool.summary()
        out["nodes"] = {
            name: {
                "devices": [d.name for d in self.pool],
                "calls": self.calls[name],
                "samples": self.samples[name],
            }
            for name in self.shared
        }
        return out

    def close(self) -> None:
        """End the device threads once the calls they run return."""
        for _ in self._threads:
            self._jobs.put(None)
        self._threads = []
