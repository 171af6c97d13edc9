"""What a :class:`~runtime.zmq.driver.ZmqExecutor` accepts, and what its SETUP says about the
graph: written by the driver (:func:`setup_fields`), read by each controller
(:func:`nodes_from_setup`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from runtime.codec.cuda_ipc import peer_gpus
from runtime.engine.calls import node_devices
from runtime.sched.affinity import start_cores
from runtime.sched.devices import Resources, assign_resources, check_choice, visible_gpus
from runtime.zmq import messages as m
from runtime.zmq.keys import check_address
from yatt_graph import Plan

if TYPE_CHECKING:
    from runtime.engine.calls import NodeWorkers

__all__ = [
    "check_executor_arguments",
    "engine_from_setup",
    "nodes_from_setup",
    "plan_resources",
    "setup_fields",
    "setup_gpus",
]


def check_executor_arguments(
    rebuild: str, controller_output: str, spawn: bool, address: str | None, allow_tcp: bool,
    allow_remote: bool,
) -> None:  # fmt: skip
    """The ZmqExecutor arguments that are not run options (those are RunConfig.verify's)."""
    check_choice("ZmqExecutor", "rebuild", rebuild, ("auto", "plan", "graph"))
    if controller_output not in ("capture", "inherit"):
        raise ValueError("ZmqExecutor: controller_output must be 'capture' or 'inherit'")
    if not spawn and address is None:
        raise ValueError(
            "ZmqExecutor(spawn=False) needs the address controllers connect to "
            "(yatt-graph run: --listen tcp://HOST:PORT with --no-spawn)"
        )
    if address:
        check_address(address, allow_tcp=allow_tcp, allow_remote=allow_remote, who="ZmqExecutor")


def plan_resources(
    controllers: int, *, spawn: bool, placement: str, max_staleness: int, device: str,
    resources: Sequence[Resources] | None,
) -> list[Resources]:  # fmt: skip
    """Each controller's Resources at the start of a run (:func:`assign_resources` over this
    host's cores and GPUs), or ``resources`` as given (checked). Controllers that join from
    elsewhere (``spawn=False``) get every core of their own host and the GPUs they see."""
    if resources is not None:
        resources = list(resources)
        if len(resources) != controllers or not all(isinstance(r, Resources) for r in resources):
            raise ValueError(
                f"ZmqExecutor: resources must be {controllers} Resources, one per controller, "
                f"got {resources!r}"
            )
        here = set(start_cores())
        for c, r in enumerate(resources):
            if not set(r.cores) <= here or r.threads < 0:
                raise ValueError(
                    f"ZmqExecutor: resources[{c}] ({r.describe()}) names cores outside this "
                    f"process's {sorted(here)} or a negative thread count"
                )
        return resources
    gpus = visible_gpus() if device != "cpu" else 0
    if device == "cuda" and gpus < 1:
        raise RuntimeError(
            "ZmqExecutor(device='cuda'): no CUDA device is visible to the driver; use "
            "--device cpu (or auto: CUDA where present)"
        )
    if not spawn:
        return [Resources()] * controllers
    return assign_resources(
        controllers, cores=start_cores(), placement=placement, max_staleness=max_staleness,
        device=device, gpus=gpus,
    )  # fmt: skip


def setup_gpus(
    cuda: Sequence[Sequence[int]], on_host: Sequence[bool], enabled: bool
) -> list[list[int]]:
    """SETUP's ``cuda_ipc_gpus``: for the controllers started on this host (``on_host``), the
    GPUs each sees (:func:`runtime.codec.cuda_ipc.peer_gpus`); ``[]`` when IPC is off or no
    controller is here."""
    if not enabled or not any(on_host):
        return []
    driver_gpus = visible_gpus() if any(not c for c in cuda) else 0
    gpus = peer_gpus(cuda, on_host, enabled=True, driver_gpus=driver_gpus)
    return gpus if any(gpus) else []


def setup_fields(
    plan: Plan, order: list[str], graph_ref: str | None, graph_options: dict[str, Any] | None,
    rebuild: str,
) -> dict[str, Any]:  # fmt: skip
    """The SETUP fields that say how controllers rebuild the graph (see ``rebuild``)."""
    plan_json = b""
    if rebuild in ("auto", "plan"):
        try:
            plan_json = plan.to_json()
        except TypeError as exc:
            if rebuild == "plan" or not graph_ref:
                raise TypeError(
                    f"ZmqExecutor: the plan cannot be sent to controllers: {exc}. Either make the "
                    "node's constructor arguments JSON-able, or pass graph_ref='module.or/file.py' "
                    "(and graph_options) so each controller rebuilds the graph itself"
                ) from exc
    elif not graph_ref:
        raise ValueError("ZmqExecutor(rebuild='graph') needs graph_ref")
    return dict(
        plan_json=plan_json,
        graph_ref="" if plan_json else (graph_ref or ""),
        graph_options_json=msgspec.json.encode(graph_options or {}),
        assignment=dict(plan.assignment),
        order=list(order),
        digest=plan.graph.wiring_digest(),
        devices=node_devices(plan.graph.nodes),
    )


def nodes_from_setup(
    setup: m.Setup, track: Callable[[str], None]
) -> tuple[dict[str, Any], list[Any], dict[str, Any], dict[str, int]]:
    """In a controller: its nodes (constructed, not set up), the edges, outputs and assignment,
    rebuilt as :func:`setup_fields` said; ``track(name)`` is told each node before it is made."""
    from yatt_graph.serialize import PlanSpec, build_node

    if setup.plan_json:
        spec = msgspec.json.decode(setup.plan_json, type=PlanSpec)
        assignment = dict(spec.assignment)
        specs = {ns.name: ns for ns in spec.graph.nodes}
        nodes = {}
        for name in setup.order:
            if assignment[name] == setup.controller:
                track(name)
                nodes[name] = build_node(specs[name])
        track("")
        return nodes, list(spec.graph.edges), dict(spec.graph.outputs), assignment
    from yatt_graph.refs import load_graph

    assignment = dict(setup.assignment)
    graph = load_graph(setup.graph_ref, **msgspec.json.decode(setup.graph_options_json))
    digest = graph.wiring_digest()
    if setup.digest and digest != setup.digest or set(graph.nodes) != set(assignment):
        raise RuntimeError(
            f"the graph rebuilt from {setup.graph_ref!r} here is wired differently from the driver's "
            f"(nodes {sorted(graph.nodes)} vs {sorted(assignment)}); pass the same graph_options "
            "and run the same code on every host"
        )
    nodes = {n: graph.nodes[n] for n in setup.order if assignment[n] == setup.controller}
    return nodes, graph.edges, dict(graph.graph_outputs), assignment


def engine_from_setup(
    setup: m.Setup,
    outbox: Any,
    track: Callable[[str], None],
    ctx: Any = None,
    keys: Any = None,
    keys_dir: str | None = None,
) -> tuple[Any, NodeWorkers]:
    """In a controller: its nodes rebuilt and made ready (:func:`runtime.engine.calls.start_nodes`:
    ``track`` is told each node first), and the step engine over them, sending to ``outbox``.
    ``ctx``, ``keys`` and ``keys_dir`` (the controller's zmq context, CURVE keys and their
    folder) reach the replicas on other hosts. The caller ends the returned workers (ranks,
    replicas, device slots) when it is done."""
    from runtime.engine.calls import start_nodes
    from runtime.engine.engine import StepEngine
    from runtime.zmq.replicas import replica_spawner, start_remote_replicas

    config = setup.config
    nodes, edges, outputs, assignment = nodes_from_setup(setup, track)
    # First the replicas this host holds of other hosts' nodes: they wait at the node's store
    # for its address, and the node's controller waits for them while it starts its own.
    remote = start_remote_replicas(
        nodes, setup.replica_hosts, setup.controller, keys_dir, setup.devices
    )
    try:
        spawn = replica_spawner(setup.replica_hosts, ctx, keys)
        workers = start_nodes(
            nodes, setup.order, config, spawn, track, setup.rank_groups, setup.controller
        )
    except BaseException:
        for r in remote:
            r.close()
        raise
    workers.groups += remote
    limits = {n: node.batch_policy.timeout_s or config.node_timeout_s for n, node in nodes.items()}
    try:
        engine = StepEngine(
            nodes, edges, outputs, setup.order, assignment, here=setup.controller,
            max_staleness=config.max_staleness, staleness=config.staleness, window=config.window,
            outbox=outbox, fanouts=workers.fanouts, check_finite=config.check_finite,
            limits=limits,
            # its GPU is time-shared: its nodes' device state leaves when its turn ends
            switch="phase" if setup.controller in setup.offload_controllers else None,
            devices=setup.devices or None,
        )  # fmt: skip
    except BaseException:
        workers.close()
        raise
    return engine, workers
