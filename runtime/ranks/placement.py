"""Where the copies of a node run when they span hosts, and how they find each other: the
ranks of a group, and a node's replicas.

A run across hosts (``--nnodes N``) may give a rank group more ranks than one host holds:
``--ranks-per-host M`` puts M ranks on each host, the node's own host first (rank 0 is the
node), then the other hosts in the order of their first controller. On each host one
controller starts that host's ranks: the node's own controller on its host, the host's first
controller elsewhere (:func:`place_ranks`). The group then meets at a TCPStore the driver
hosts at its own address, which every host reaches (torchrun's rendezvous is the same idea:
the master address and a port handed out), instead of one rank 0 hosts on 127.0.0.1.

The driver sends each controller the :class:`HostPlacement` of every such group; the
collectives of ranks on different hosts go over the interface that holds each rank's host
address (``GLOO_SOCKET_IFNAME``, :func:`interface_of`), so gloo binds where the other hosts
can reach it.

A node's replicas (``--replicas NODE=R``) spread over the hosts the same way with
``--replicas-per-host M`` (:func:`place_replicas`): the node's controller
starts those on its host, each other host's first controller the others, which meet the node
at the address it writes to the node's store (:mod:`runtime.zmq.replicas`). This module
imports neither torch nor zmq.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import msgspec

from yatt_graph import UsageError

__all__ = ["HostPlacement", "host_of", "interface_of", "place_ranks", "place_replicas"]


class HostPlacement(msgspec.Struct, frozen=True):
    """The copies of a node that span hosts (a rank group's ranks, or the node and its
    replicas), as the driver hands them to every controller; copy 0 is the node itself."""

    store: str
    """``HOST:PORT`` of the TCPStore the copies meet at, which the driver hosts."""
    controllers: list[int]
    """Per copy, the controller that starts it (copy 0: the node's own, where it runs)."""
    hosts: list[str]
    """Per copy, its host's address (the interface its collectives or sockets bind to)."""
    local: list[int]
    """Per copy, its index among the copies of its host (its GPU, on CUDA)."""
    timeout_s: float
    """How long the copies' start and their store calls may take (a rank group: the node's
    ``rank_timeout_s``)."""

    @property
    def world(self) -> int:
        return len(self.controllers)

    def describe(self, node: str | Sequence[str], controller: int, copies: str = "ranks") -> str:
        """One line: which of ``node``'s ``copies`` (ranks or replicas) ``controller`` holds,
        on which host, and where copy 0 and the store are (``node``: a node's name, or the
        names of the nodes that share a rank group)."""
        here = [r for r, c in enumerate(self.controllers) if c == controller]
        who = nodes_label([node] if isinstance(node, str) else node)
        return (
            f"{who}: {copies} {', '.join(map(str, here))} of {self.world} on this host "
            f"({self.hosts[here[0]]}), {copies[:-1]} 0 on controller {self.controllers[0]} "
            f"({self.hosts[0]}), the store at {self.store}"
        )

    def ranks_of(self, controller: int) -> list[int]:
        """The copies ``controller`` starts (copy 0 left out: it is the node itself)."""
        return [r for r, c in enumerate(self.controllers) if c == controller and r > 0]


def nodes_label(names: Sequence[str]) -> str:
    """``node 'grpo'``, or ``nodes 'grpo', 'reference'`` for the nodes that share a group."""
    return ("node " if len(names) == 1 else "nodes ") + ", ".join(map(repr, names))


def host_of(address: str, default: str) -> str:
    """The host part of a controller's data address (``tcp://10.0.0.2:5555``); ``default``
    (the driver's host) for an ``ipc://`` address, which only a process on the driver's host
    can have."""
    if not address.startswith("tcp://"):
        return default
    host = address[len("tcp://") :].rsplit(":", 1)[0]
    return host.strip("[]")


def place_ranks(
    node: str, ranks: int, per_host: int, owner: int, hosts: Sequence[str]
) -> tuple[list[int], list[str], list[int]]:
    """Per rank of ``node``'s group of ``ranks``: the controller that starts it, its host and
    its index on that host. ``hosts`` holds each controller's host by index, ``owner`` is
    the node's controller. A UsageError when the hosts hold fewer than ``ranks``."""
    given = f"--train-ranks {ranks} with --ranks-per-host {per_host}"
    return _place(node, ranks, per_host, owner, hosts, given, "--ranks-per-host")


def place_replicas(
    node: str, replicas: int, per_host: int, owner: int, hosts: Sequence[str]
) -> tuple[list[int], list[str], list[int]]:
    """Per copy of ``node`` with ``replicas`` copies (copy 0: the node, on controller
    ``owner``), as :func:`place_ranks` places ranks: the controller that starts it, its host
    and its index on that host (its GPU, on CUDA)."""
    given = f"--replicas {node}={replicas} with --replicas-per-host {per_host}"
    return _place(node, replicas, per_host, owner, hosts, given, "--replicas-per-host")


def _place(
    node: str, copies: int, per_host: int, owner: int, hosts: Sequence[str], given: str, flag: str
) -> tuple[list[int], list[str], list[int]]:
    order: list[str] = [hosts[owner]]  # the distinct hosts, the node's first
    first: dict[str, int] = {hosts[owner]: owner}  # each one's first controller
    for index, host in enumerate(hosts):
        if host not in first:
            first[host] = index
            order.append(host)
    if copies > per_host * len(order):
        raise UsageError(
            f"node {node!r}: {given} needs {-(-copies // per_host)} hosts, and the run has "
            f"{len(order)} ({', '.join(order)}); raise {flag} or add hosts"
        )
    controllers, where, local = [], [], []
    for copy in range(copies):
        host = order[copy // per_host]
        controllers.append(first[host])
        where.append(host)
        local.append(copy % per_host)
    return controllers, where, local


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds ``address`` (an IPv4 or IPv6
    address), or None."""
    import psutil

    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            try:
                if ipaddress.ip_address(a.address.split("%")[0]) == wanted:
                    return name
            except ValueError:
                continue
    return None
