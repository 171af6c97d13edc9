"""The flags of ``yatt-graph run``: what each means (:func:`add_run_arguments`) and which values
and combinations cannot work (:func:`check_flags`, before anything is built: one line, exit 2).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

from runtime.engine.switch import MODES as OFFLOAD_MODES
from runtime.sched.placement import SIDES
from runtime.train.run_folder import run_folder_of
from runtime.train.wandb_log import NO_WANDB
from yatt_graph import UsageError

__all__ = ["add_run_arguments", "check_flags", "parse_devices", "parse_pins", "same_folder"]

MAX_MESSAGE_MB = 4096.0
"""``--max-message-mb``'s default: the largest frame a runtime socket accepts (4 GiB)."""


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The run command's flags (the graph and its options are the caller's)."""
    p.add_argument(
        "--steps", type=int, default=30, help="total steps (a resumed run counts restored ones)"
    )
    p.add_argument("--seed", type=int, help="passed to build_graph(seed=...)")
    p.add_argument(
        "--out",
        help="the run folder: metrics.jsonl, trace.json, checkpoints/ (one run at a time; "
        "default with --resume: the folder it resumes)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in an --out that holds a run: its files move into "
        "OUT/previous-<time>/ (nothing is deleted)",
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=0, metavar="K", help="checkpoint every K steps"
    )
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="continue a run folder from its newest good checkpoint (or DIR/checkpoints/step_N); "
        "the checkpoint must be of this graph with the same options",
    )
    p.add_argument(
        "--controllers", type=int, default=1, help="run the plan on N controller processes"
    )
    p.add_argument(
        "--placement",
        choices=("colocated", "partial"),
        default="colocated",
        help="colocated: roles share the controllers; partial: rollout side and training side "
        "on separate controllers (needs --controllers >= 2)",
    )
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="NODE=SIDE",
        help="with --placement partial: keep NODE on the rollout or the train side (e.g. "
        "reference=rollout); repeatable. Unpinned inference nodes (reward, reference, critic) "
        "move to the less busy side once the first steps are measured (not with --no-adaptive)",
    )
    p.add_argument(
        "--devices",
        metavar="N|auto",
        help="cut the calls of splittable nodes (vision, reference, critic) into micro-batches "
        "across N CPU slots per process (auto: $YATT_CPU_SLOTS or the cores); default: none",
    )
    p.add_argument(
        "--replicas",
        metavar="NODE=R,...",
        help="run R copies of an inference node (rollout, vision, reference, critic, reward), "
        "each on its own core or GPU; each step's batch is cut across them by cost "
        "(e.g. rollout=2)",
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        metavar="K",
        help="async mode: a rollout may use weights at most K versions old, so sources run "
        "up to K steps ahead of the update (0: on-policy)",
    )
    p.add_argument(
        "--staleness",
        choices=("bound", "fixed"),
        default="bound",
        help="with --max-staleness K: bound (default) reads the newest weights at most K "
        "versions old; fixed always reads the ones exactly K+1 steps back, whatever the "
        "timing (a bitwise rerun also needs fixed thread counts: --no-adaptive)",
    )
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch threads of the process that runs the nodes (with controllers: of each one, "
        "fixed for the run); default: one per core that other processes leave free, measured "
        "at start, with idle OpenMP threads spinning only where the run owns its cores "
        "(OMP_NUM_THREADS and OMP_WAIT_POLICY are kept when set)",
    )
    p.add_argument(
        "--no-adaptive",
        action="store_true",
        help="keep each controller's starting cores; by default the driver moves cores between "
        "controllers between steps, toward the busiest (sched/* metrics)",
    )
    p.add_argument(
        "--offload",
        choices=OFFLOAD_MODES,
        default="auto",
        help="when roles take turns on a device, move a role's weights and optimizer state to "
        "host memory when its turn ends and back before its next call, timed (sched/switch_s); "
        "auto: when controllers share a GPU under colocated placement; on: always (in-process: "
        "between model roles); off: never",
    )
    p.add_argument(
        "--listen",
        metavar="tcp://HOST:PORT",
        help="bind the driver on tcp so controllers on other hosts can join (opt-in)",
    )
    p.add_argument(
        "--no-spawn",
        action="store_true",
        help="start no local controllers; wait for `yatt-graph controller --connect`",
    )
    p.add_argument(
        "--window", type=int, default=5, help="steps averaged in the closing reward line"
    )
    p.add_argument(
        "--export",
        metavar="DIR",
        help="save the trained policy there with save_pretrained",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar (and no glances)")
    p.add_argument(
        "--glance-every",
        type=int,
        default=50,
        metavar="N",
        help="every N steps print a few responses with their prompts and rewards (ready "
        "graphs; 0: never)",
    )
    p.add_argument(
        "--wandb",
        nargs="?",
        const="yatt-graph",
        metavar="PROJECT",
        help="with --out: also log the scalars and the kept samples to Weights & Biases "
        "(project PROJECT, default yatt-graph; needs the wandb extra); offline in OUT/wandb/ "
        "unless a key is configured (WANDB_API_KEY or wandb login)",
    )
    p.add_argument(
        "--samples-every",
        type=int,
        default=10,
        metavar="N",
        help="with --out: every N steps write the step's samples to OUT/samples/ as Parquet: "
        "each response with its prompt, data row, image, reward, length, stop reason, "
        "advantage, KL, weight version (ready graphs; default 10; 0: never)",
    )
    p.add_argument(
        "--no-check-finite",
        action="store_true",
        help="do not stop the run at a node output holding NaN or inf (checked by default)",
    )
    p.add_argument(
        "--show-graph", action="store_true", help="print the graph's text form before running"
    )
    faults = p.add_argument_group("faults and bad input (docs/RELIABILITY.md)")
    faults.add_argument(
        "--restart",
        choices=["never", "on-failure"],
        default="never",
        help="on-failure: when a controller dies, restart the controllers and resume from the "
        "newest good checkpoint (needs --out; default never: stop with the error)",
    )
    faults.add_argument(
        "--max-restarts", type=int, default=3, metavar="N", help="give up after N restarts"
    )
    faults.add_argument(
        "--node-timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="stop the run when one node call runs longer than S seconds (nodes whose "
        "BatchPolicy.timeout_s is 0; 0: no limit)",
    )
    faults.add_argument(
        "--on-bad-sample",
        choices=["raise", "skip"],
        help="passed to a graph that has the on_bad_sample option: a NaN/inf/non-number "
        "reward stops the run (raise) or scores 0 and is counted (skip)",
    )
    faults.add_argument(
        "--max-message-mb",
        type=float,
        default=MAX_MESSAGE_MB,
        metavar="MB",
        help="largest frame a runtime socket accepts; larger ones are dropped (0: no limit)",
    )
    security = p.add_argument_group("security (docs/RELIABILITY.md)")
    security.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow --listen on a non-loopback address (other hosts can connect: use --keys)",
    )
    security.add_argument("--keys", metavar="DIR", help="CURVE keys from `yatt-graph keys DIR`")


def _check_numbers(args: Any) -> None:
    """Numbers and flag pairs that cannot work, refused before anything is built."""
    least = {"steps": 1, "controllers": 1, "checkpoint_every": 0, "max_staleness": 0,
             "max_restarts": 0, "window": 1, "glance_every": 0, "samples_every": 0,
             "threads": 1}  # fmt: skip
    for name, low in least.items():
        value = getattr(args, name)
        if value is not None and value < low:  # (--threads: None is one per free core)
            raise UsageError(f"--{name.replace('_', '-')} must be {low} or more, got {value}")
    for flag, value in (
        ("--node-timeout", args.node_timeout),
        ("--max-message-mb", args.max_message_mb),
    ):
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{flag} takes 0 (no limit) or a finite number above it, got {value}")
    if 0 < args.max_message_mb * (1 << 20) < 1:
        raise UsageError(
            f"--max-message-mb {args.max_message_mb} is under one byte (0 is no limit); "
            "give at least 0.001 (about 1 KB)"
        )
    for flag in ("out", "resume", "export"):  # (an empty one: an unset shell variable)
        value = getattr(args, flag, None)
        if isinstance(value, str) and not value.strip():
            raise UsageError(f"--{flag} was given an empty path; name a folder")
    if args.no_spawn and not args.listen:
        raise UsageError(
            "--no-spawn waits for controllers started by hand, which join a driver on tcp; "
            "add --listen tcp://HOST:PORT (or drop --no-spawn)"
        )
    if args.resume and args.overwrite and (not args.out or same_folder(args.out, args.resume)):
        raise UsageError(
            "--resume continues the run in its folder and --overwrite starts it afresh; "
            "choose one (or --out ANOTHER_DIR to continue into another folder)"
        )


def same_folder(out: str, resume: str) -> bool:
    return run_folder_of(Path(resume)).resolve() == Path(out).resolve()


def _check_run_flags(args: Any, distributed: bool) -> None:
    if args.restart == "on-failure":
        if (
            not distributed
            and not args.replica_counts
            and (getattr(args, "train_ranks", None) or 1) < 2
        ):
            raise UsageError(
                "--restart on-failure restarts controller, replica or training-rank processes; it "
                "needs --controllers N (N > 1), --listen, --replicas or --train-ranks"
            )
        if not args.out and not args.resume:
            raise UsageError("--restart on-failure needs --out DIR, where checkpoints are kept")
        if not args.checkpoint_every:
            print(
                "yatt-graph run: --restart on-failure without --checkpoint-every: a restart runs "
                "again from the first step",
                file=sys.stderr,
            )
    if args.wandb is not None:
        if not args.out and not args.resume:
            raise UsageError("--wandb needs --out DIR: the W&B run is kept beside the run folder")
        if not args.wandb.strip():
            raise UsageError("--wandb was given an empty project name (an unset shell variable?)")
        if importlib.util.find_spec("wandb") is None:
            raise UsageError(NO_WANDB)
    if args.pin and args.placement != "partial":
        raise UsageError(
            "--pin keeps a node on one side of --placement partial; add --placement partial "
            "(colocated placement has no sides)"
        )
    if args.placement == "partial" and args.controllers < 2:
        raise UsageError(
            "--placement partial puts the rollout side and the training side on separate "
            "controllers; it needs --controllers 2 or more"
        )
    if args.staleness == "fixed" and not args.max_staleness:
        raise UsageError(
            "--staleness fixed chooses which old weights a rollout reads within --max-staleness "
            "K; without it (K=0, on-policy) every step reads the step before: add "
            "--max-staleness K (K >= 1) or drop --staleness"
        )
    if args.listen and args.controllers < 2:
        raise UsageError(
            "--listen binds the driver for controllers that join over tcp; say how many with "
            "--controllers N (N > 1), e.g. --controllers 2 --no-spawn for two started by hand"
        )
    if not distributed and (
        args.keys or args.allow_remote or args.node_timeout or args.max_message_mb != MAX_MESSAGE_MB
    ):
        raise UsageError(
            "--keys, --allow-remote, --node-timeout and --max-message-mb apply to controller "
            "processes and their sockets; add --controllers N (N > 1) or --listen"
        )


def parse_devices(value: str | None) -> int | str | None:
    if value is None or value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 1:
        raise UsageError(f"--devices takes a CPU slot count >= 1 or 'auto', got {value!r}")
    return n


def parse_pins(values: list[str]) -> dict[str, str]:
    """``["reference=rollout"]`` as ``{"reference": "rollout"}`` (the names are checked
    against the graph once it is built)."""
    out: dict[str, str] = {}
    for item in (i for value in values for i in value.split(",")):
        name, sep, side = item.partition("=")
        if not sep or not name.strip() or side.strip() not in SIDES:
            raise UsageError(
                f"--pin takes NODE=rollout or NODE=train (reference=rollout), got {item!r}"
            )
        out[name.strip()] = side.strip()
    return out


def parse_replicas(value: str | None) -> dict[str, int]:
    """``rollout=2,reference=2`` as ``{"rollout": 2, "reference": 2}``."""
    out: dict[str, int] = {}
    for item in (value or "").split(","):
        if not item.strip():
            continue
        name, sep, count = item.partition("=")
        try:
            r = int(count)
        except ValueError:
            r = 0
        if not sep or not name.strip() or r < 1:
            raise UsageError(
                f"--replicas takes NODE=R pairs with R >= 1, separated by commas (rollout=2), "
                f"got {item!r}"
            )
        out[name.strip()] = r
    return out


def check_flags(args: Any) -> tuple[Any, bool]:
    """Every flag that cannot work, refused before anything is built; (devices, distributed)."""
    _check_numbers(args)
    devices = parse_devices(args.devices)
    args.replica_counts = parse_replicas(args.replicas)
    args.pins = parse_pins(args.pin)
    distributed = args.controllers > 1 or bool(args.listen)
    _check_run_flags(args, distributed)
    return devices, distributed
