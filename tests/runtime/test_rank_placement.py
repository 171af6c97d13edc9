"""Where the ranks of a group and the replicas of a node across hosts run
(runtime/ranks/placement.py), and the refusals of ``--ranks-per-host`` before anything starts."""

from __future__ import annotations

import pytest

from runtime.cli import main
from runtime.ranks.placement import (
    HostPlacement,
    host_of,
    interface_of,
    place_ranks,
    place_replicas,
)
from yatt_graph import UsageError


def test_the_nodes_host_holds_the_first_ranks_then_the_other_hosts_in_order():
    hosts = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.3"]
    controllers, where, local = place_ranks("grpo", 5, 2, owner=3, hosts=hosts)
    assert controllers == [3, 3, 0, 0, 2]  # the node's own controller, then each host's first
    assert where == ["10.0.0.3", "10.0.0.3", "10.0.0.1", "10.0.0.1", "10.0.0.2"]
    assert local == [0, 1, 0, 1, 0]
    placement = HostPlacement("10.0.0.1:5000", controllers, where, local, 60.0)
    assert placement.world == 5 and placement.ranks_of(3) == [1] and placement.ranks_of(0) == [2, 3]
    assert "ranks 2, 3 of 5 on this host (10.0.0.1), rank 0 on controller 3" in placement.describe(
        "grpo", 0
    )


def test_replicas_per_host_fill_the_nodes_host_first_then_the_others():
    hosts = ["10.0.0.1", "10.0.0.1", "10.0.0.2"]
    assert place_replicas("rollout", 2, 1, owner=2, hosts=hosts) == (
        [2, 0], ["10.0.0.2", "10.0.0.1"], [0, 0]
    )  # fmt: skip
    controllers, where, local = place_replicas("rollout", 5, 3, owner=0, hosts=hosts)
    assert controllers == [0, 0, 0, 2, 2] and local == [0, 1, 2, 0, 1]
    assert where == ["10.0.0.1"] * 3 + ["10.0.0.2"] * 2
    placement = HostPlacement("10.0.0.1:5000", controllers, where, local, 300.0)
    assert placement.ranks_of(2) == [3, 4]
    assert "replicas 3, 4 of 5 on this host (10.0.0.2), replica 0 on controller 0" in (
        placement.describe("rollout", 2, "replicas")
    )
    with pytest.raises(UsageError, match=r"--replicas rollout=5 with --replicas-per-host 2 needs 3 hosts, and the run has 2"):  # fmt: skip
        place_replicas("rollout", 5, 2, owner=0, hosts=hosts)


def test_more_ranks_than_the_hosts_hold_is_refused_with_the_count():
    with pytest.raises(UsageError, match=r"--train-ranks 5 with --ranks-per-host 2 needs 3 hosts, and the run has 2"):  # fmt: skip
        place_ranks("grpo", 5, 2, owner=0, hosts=["10.0.0.1", "10.0.0.2"])


def test_a_controllers_host_is_its_data_address_or_the_drivers():
    assert host_of("tcp://10.0.0.2:5555", "10.0.0.1") == "10.0.0.2"
    assert host_of("ipc:///tmp/yatt/c1", "10.0.0.1") == "10.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("not an address") is None


@pytest.mark.parametrize(
    ("flag", "what"),
    [
        ("--ranks-per-host", "ranks of --train-ranks"),
        ("--replicas-per-host", "copies of --replicas"),
    ],
)
def test_copies_per_host_on_one_host_is_refused_in_one_line(capsys, flag, what):
    code = main(["run", "graphs.toy", "--steps", "1", flag, "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{flag} 2 spreads the {what} over the hosts" in err
    assert "Traceback" not in err
