"""Where the ranks of a group run when they span hosts, and how they find each other.

A run across hosts (``--nnodes N``) may give a rank group more ranks than one host holds:
``--ranks-per-host M`` puts M ranks on each host, the node's own host first (rank 0 is the
node), then the other hosts in the order of their first controller. On each host one
controller starts that host's ranks: the node's own controller on its host, the host's first
controller elsewhere (:func:`place_ranks`). The group then meets at a TCPStore the driver
hosts at its own address, which every host reaches (torchrun's rendezvous is the same idea:
the master address and a port handed out), instead of one rank 0 hosts on 127.0.0.1.

The driver sends each controller the :class:`RankPlacement` of every such group; the
collectives of ranks on different hosts go over the interface that holds each rank's host
address (``GLOO_SOCKET_IFNAME``, :func:`interface_of`), so gloo binds where the other hosts
can reach it. This module imports neither torch nor zmq.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import msgspec

from yatt_graph import UsageError

__all__ = ["RankPlacement", "host_of", "interface_of", "place_ranks"]


class RankPlacement(msgspec.Struct, frozen=True):
    """A rank group that spans hosts, as the driver hands it to every controller."""

    store: str
    """``HOST:PORT`` of the group's TCPStore, which the driver hosts."""
    controllers: list[int]
    """Per rank, the controller that starts it (rank 0: the node's own, where it runs)."""
    hosts: list[str]
    """Per rank, its host's address (the interface its collectives bind to)."""
    local_ranks: list[int]
    """Per rank, its index among the ranks of its host (its GPU, on CUDA)."""
    timeout_s: float
    """The node's ``rank_timeout_s``: how long the group's start and its store calls may take."""

    @property
    def world(self) -> int:
        return len(self.controllers)

    def describe(self, node: str, controller: int) -> str:
        """One line: which of ``node``'s ranks ``controller`` holds, on which host, and where
        rank 0 and the store are."""
        here = [r for r, c in enumerate(self.controllers) if c == controller]
        return (
            f"node {node!r}: ranks {', '.join(map(str, here))} of {self.world} on this host "
            f"({self.hosts[here[0]]}), rank 0 on controller {self.controllers[0]} "
            f"({self.hosts[0]}), the group's store at {self.store}"
        )

    def ranks_of(self, controller: int) -> list[int]:
        """The ranks ``controller`` starts (rank 0 left out: it is the node itself)."""
        return [r for r, c in enumerate(self.controllers) if c == controller and r > 0]


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
    order: list[str] = [hosts[owner]]
    first: dict[str, int] = {hosts[owner]: owner}
    for index, host in enumerate(hosts):
        if host not in first:
            first[host] = index
            order.append(host)
    if ranks > per_host * len(order):
        raise UsageError(
            f"node {node!r}: --train-ranks {ranks} with --ranks-per-host {per_host} needs "
            f"{-(-ranks // per_host)} hosts, and the run has {len(order)} "
            f"({', '.join(order)}); raise --ranks-per-host or add hosts"
        )
    controllers, where, local = [], [], []
    for rank in range(ranks):
        host = order[rank // per_host]
        controllers.append(first[host])
        where.append(host)
        local.append(rank % per_host)
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
