"""What each reader takes of a node's outputs: tensors on its GPU, or host copies.

Nodes compute on their ``device`` and return their outputs there; a node on a GPU hands on
CUDA tensors. The engine, not the node, decides what each reader gets, by one rule: a reader
that computes on a CUDA device (its :attr:`~yatt_graph.Node.device`) takes each tensor input
on that device, and any other reader takes host copies, made where the value is. So

- in one process, a GPU reader on the producer's GPU gets its tensors with no copy, and a CPU
  reader never sees a CUDA tensor; no node gets its tensor inputs on two devices;
- to another controller, a value goes as it is only when every node there that reads it is
  on a GPU: the codec then sends it by CUDA IPC where that controller sees the GPU
  (:mod:`runtime.codec.cuda_ipc`), else through host memory. A controller whose readers are
  on the CPU gets the host copy, so it never opens a CUDA context only to copy to the host;
- the graph's marked outputs (the training loop's metrics, samples and checkpoints) are
  host copies.

In a graph with no node on a GPU (every ready graph on a machine without one) every value is
left as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["TensorMoves", "host_copy", "node_devices", "on_cuda"]


def on_cuda(device: Any) -> bool:
    """Whether ``device`` (a torch device or its name) is a CUDA device."""
    return str(device).startswith("cuda")


def node_devices(nodes: Mapping[str, Any]) -> dict[str, str]:
    """Each node's :attr:`~yatt_graph.Node.device`, by name, as a string."""
    return {name: str(node.device) for name, node in nodes.items()}


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("cpu")


def host_copy(value: Any) -> Any:
    """``value`` with every tensor off the host copied to it (in dicts, lists and tuples); the
    value itself when nothing in it is off the host."""
    if isinstance(value, torch.Tensor):
        return value if value.device.type == "cpu" else _to_host(value)
    if isinstance(value, Mapping):
        items = {k: host_copy(v) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    if isinstance(value, list | tuple):
        items = [host_copy(v) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


class TensorMoves:
    """The rule of the module docstring for one graph: ``devices`` holds every node's device
    (:func:`node_devices`), ``edges`` the graph's edges, ``assignment`` each node's
    controller. In a graph with no node on a GPU it leaves every value as it is."""

    def __init__(
        self, devices: Mapping[str, str], edges: Sequence[Any], assignment: Mapping[str, int]
    ):
        self.cuda = {name for name, device in devices.items() if on_cuda(device)}
        self._readers: dict[tuple[str, str], dict[int, set[str]]] = {}
        for e in edges:
            where = self._readers.setdefault((e.src, e.src_port), {})
            where.setdefault(assignment.get(e.dst, 0), set()).add(e.dst)

    def inputs(self, node: Any, inputs: dict[str, Any]) -> dict[str, Any]:
        """What ``node``, a reader in this process, takes of its call's ``inputs``: each
        tensor moved to its GPU (its device as it is now: a rank's own), or host copies for a
        reader off the GPU; ``inputs`` themselves in a graph with no node on a GPU."""
        if not self.cuda:
            return inputs
        if on_cuda(node.device):
            return {p: v.to(node.device) if isinstance(v, torch.Tensor) else v
                    for p, v in inputs.items()}  # fmt: skip
        return {p: host_copy(v) for p, v in inputs.items()}

    def for_host(self, value: Any) -> Any:
        """What the graph's marked outputs hold of ``value``: a host copy."""
        return host_copy(value) if self.cuda else value

    def split(self, src: str, port: str, dests: Sequence[int]) -> list[tuple[list[int], bool]]:
        """``dests`` (controllers reading ``src.port``) as groups ``(controllers, as_is)``:
        those whose readers of it are all on a GPU take the value as it is, the others a host
        copy. Groups with no controller are left out."""
        if not self.cuda:
            return [(list(dests), True)]
        readers = self._readers.get((src, port), {})
        as_is = [c for c in dests if readers.get(c) and readers[c] <= self.cuda]
        copy = [c for c in dests if c not in as_is]
        return [(group, keep) for group, keep in ((as_is, True), (copy, False)) if group]
