"""The executor of a ``yatt-graph run``, from its flags: the one
:class:`~runtime.engine.config.RunConfig` both executors take (:func:`run_config`), the thread
policy decided before torch loads (:func:`thread_policy`), the controllers started early
(:func:`start_controllers`) and the factory that makes the executor for each attempt of the run
(:func:`executor_factory`, again after a restart)."""

from __future__ import annotations

import argparse
import gc
import sys
from typing import TYPE_CHECKING, Any

from yatt_graph import UsageError

if TYPE_CHECKING:
    from runtime.run_setup import RunSetup

__all__ = ["executor_factory", "run_config", "start_controllers", "thread_policy"]


def start_controllers(args: argparse.Namespace) -> Any:
    """The run's ``--controllers`` started now, for the first executor to take: they import
    torch and the graph's module while this process builds the graph."""
    from runtime.zmq.group import ControllerGroup
    from runtime.zmq.keys import load_keys

    keys = load_keys(args.keys, "driver") if args.keys else None
    return ControllerGroup(
        args.controllers, keys=keys, keys_dir=args.keys, controller_output="inherit",
        max_message_bytes=int(args.max_message_mb * (1 << 20)), preload=(args.graph,),
    )  # fmt: skip


def executor_factory(
    setup: RunSetup, graph: Any, options: dict, devices: Any, distributed: bool
) -> Any:
    """The factory of the run's executor: in-process, or ZeroMQ controllers (``distributed``),
    each configured by the one :class:`~runtime.engine.config.RunConfig` of the flags."""
    from runtime.engine.local import LocalExecutor
    from runtime.sched.fanout import replica_counts
    from runtime.train.faults import Accounting

    args = setup.args

    try:  # --replicas naming a node that is not there, or one that cannot be copied
        replica_counts(graph.nodes, args.replica_counts)
    except ValueError as exc:
        raise UsageError(f"--replicas: {exc}") from None

    policy = setup.thread_policy
    print(f"yatt-graph run: threads: {policy.describe()}", file=sys.stderr, flush=True)
    cut = None
    if distributed and args.placement == "partial":
        from runtime.sched.placement import PartialCut

        try:
            cut = PartialCut(graph, args.pins)
        except ValueError as exc:
            raise UsageError(f"--pin: {exc}") from None

    config = run_config(args, options, devices, distributed)
    if distributed and config.max_staleness and config.staleness == "fixed" and config.adaptive:
        print(
            "yatt-graph run: --staleness fixed: every step reads exactly the weights "
            f"{config.max_staleness + 1} versions back; a rerun matches this one bitwise only "
            "with fixed thread counts (--no-adaptive or --threads N), since adaptive "
            "partitioning changes them when it measures a gain, and float rounding with them",
            file=sys.stderr,
            flush=True,
        )

    def make_executor() -> Any:
        if not distributed:
            import torch

            from runtime.zmq.replicas import spawn_replica  # replica processes, when asked for

            torch.set_num_threads(policy.threads)
            executor = LocalExecutor(graph, config, replica_factory=spawn_replica)
            # As on a controller: what is built now lives as long as the run, so the cyclic
            # collector need not walk it on each collection of a step's garbage (cmd_run thaws
            # it at the end, for a caller that goes on).
            gc.freeze()
            return Accounting(executor, sched=policy.metrics())
        from runtime.sched.placement import controller_assignment
        from runtime.zmq.driver import ZmqExecutor

        if args.no_spawn:  # say at once whom the driver waits for, and how to start them
            from runtime.zmq import STARTUP_TIMEOUT_S

            keys = f" --keys {args.keys}" if args.keys else ""
            print(
                f"yatt-graph run: waiting up to {STARTUP_TIMEOUT_S:g} s for {args.controllers} "
                f"controllers at "
                f"{args.listen}; start each (I = 0..{args.controllers - 1}) with `yatt-graph "
                f"controller --connect {args.listen} --index I{keys}`",
                file=sys.stderr,
                flush=True,
            )
        sides = cut.sides if cut is not None else None
        hints = controller_assignment(graph, args.controllers, args.placement, sides=sides)
        return Accounting(
            ZmqExecutor(
                graph.plan(args.controllers, placement=hints),
                config,
                graph_ref=args.graph,
                graph_options=options,
                controller_output="inherit",
                spawn=not args.no_spawn,
                address=args.listen,
                allow_tcp=bool(args.listen),
                allow_remote=args.allow_remote,
                keys=args.keys,
                group=setup.take_group(),  # the first attempt's, started early
            ),
            sched=policy.metrics(),
        )

    if cut is not None and not args.no_adaptive:
        make_executor.replan = cut.replan  # type: ignore[attr-defined]
    return make_executor


def run_config(args: argparse.Namespace, options: dict, devices: Any, distributed: bool) -> Any:
    """The run's options from its flags: the one :class:`RunConfig` both executors take."""
    from runtime.engine.config import RunConfig

    return RunConfig(
        max_staleness=args.max_staleness,
        staleness=args.staleness,
        devices=devices,
        check_finite=not args.no_check_finite,
        replicas=dict(args.replica_counts or {}),
        offload=args.offload,
        node_timeout_s=args.node_timeout,
        max_message_bytes=int(args.max_message_mb * (1 << 20)),
        num_threads=args.threads,
        placement=args.placement,
        device=(options.get("device") or "auto") if distributed else "auto",
        adaptive=not args.no_adaptive,
    ).verify("yatt-graph run")


def thread_policy(args: argparse.Namespace) -> Any:
    """The run's torch threads and OpenMP wait policy (runtime.sched.threads), decided by
    measuring the cores before torch loads (the wait policy is read then) and before the
    controllers start (they inherit it)."""
    from runtime.sched.devices import usable_core_ids
    from runtime.sched.threads import run_policy

    cores = usable_core_ids()
    return run_policy(
        cores,
        threads=args.threads,
        shared=_beside(args, len(cores)),
        controllers=args.controllers > 1 or bool(args.listen),
    )


def _beside(args: argparse.Namespace, cores: int) -> bool:
    """Whether other processes or worker threads of this run compute on its cores while it
    does: replicas, training ranks, split slots, or controllers that run at once and
    outnumber the cores (colocated on-policy controllers take turns)."""
    ranks = args.train_ranks or 1
    for pair in args.set:
        key, _, value = pair.partition("=")
        if key.strip() == "train_ranks" and value.strip().isdigit():
            ranks = int(value)
    if args.replicas or ranks > 1 or args.devices:
        return True
    at_once = args.placement == "partial" or args.max_staleness > 0
    return args.controllers > 1 and at_once and args.controllers > cores
