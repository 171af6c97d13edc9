"""The ``yatt-graph`` command: draw, list, run graphs.

yatt-graph viz graphs/toy.py -o toy.svg [--controllers 3]
yatt-graph show graphs/toy.py [--mermaid]
yatt-graph run graphs/toy.py --steps 30 --seed 0
yatt-graph run graphs/toy.py --controllers 3 --out runs/x --checkpoint-every 10 --restart on-failure
yatt-graph run graphs/toy.py --resume runs/x --steps 60      # continue it, in its folder
yatt-graph export runs/x/checkpoints/step_000030 policy/       # a checkpoint's policy
yatt-graph keys DIR
yatt-graph report runs/x [-o report.html]                      # one page about a run, offline
yatt-graph demo
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from runtime.flags import (
    RunSpec,
    add_controller_arguments,
    add_launch_arguments,
    add_run_arguments,
    graph_args,
    parse_replicas,
    refuse_per_host,
    run_spec,
)
from runtime.run import (
    OptionError,
    RunSetup,
    graph_input,
    graph_options,
    load,
    planned,
    resolve_graph,
    run_command,
    run_memory_plan,
    typed_config,
    typed_words,
)
from runtime.train.export import export_checkpoint
from runtime.train.loop import stopped_by
from runtime.train.run_folder import check_new_path
from yatt_graph import GraphError, NodeExecutionError, UsageError
from yatt_graph.options import (
    load_graph_module,
    module_options,
    option_table,
)

__all__ = ["main", "parse_run"]


def cmd_viz(args: argparse.Namespace) -> int:
    output = Path(args.output)
    suffix = output.suffix.lstrip(".").lower()
    if suffix not in ("svg", "png"):
        raise UsageError(f"viz: -o must end in .svg or .png, got {args.output!r}")
    if output.is_dir() or not output.parent.is_dir():
        what = "is a folder" if output.is_dir() else f"is in {str(output.parent)!r}, not a folder"
        raise UsageError(f"viz: -o {args.output!r} {what}; name a file in an existing folder")
    graph = _graph(args)
    target = planned(graph, args.controllers)
    target.draw(args.output)
    print(f"wrote {args.output} ({len(graph.nodes)} nodes, {len(graph.edges)} edges)")
    return 0


def _loaded(args: argparse.Namespace) -> tuple[Any, Any]:
    """The typed config and the graph a ``show`` or ``viz`` command names, with its options."""
    given = graph_args(args)
    with graph_input(given.ref):
        return load(given, graph_options(given))


def _graph(args: argparse.Namespace) -> Any:
    return _loaded(args)[1]


def cmd_show(args: argparse.Namespace) -> int:
    if args.options:
        module = load_graph_module(args.graph)
        config = typed_config(args.graph, "idle_options")
        here, hidden = {}, {}
        if config is not None:  # a typed config: what the flags given resolve to
            resolved = config.from_options(args.graph, graph_options(graph_args(args)))
            here = {name: getattr(resolved, name) for name in resolved.__struct_fields__}
            hidden = {} if args.all else resolved.idle_options()
        print(option_table(*module_options(module), here=here, hidden=hidden))
        return 0
    layout = {"--replicas": args.replicas, "--nnodes": args.nnodes != 1,
              "--ranks-per-host": args.ranks_per_host, "--replicas-per-host": args.replicas_per_host}  # fmt: skip
    given = [flag for flag, value in layout.items() if value]
    if given and not args.memory:
        raise UsageError(
            f"show: {', '.join(given)} place the copies of the memory plan; add --memory"
        )
    if args.nnodes < 1 or min(args.ranks_per_host, args.replicas_per_host) < 0:
        raise UsageError(
            "show: --nnodes is 1 or more, --ranks-per-host and --replicas-per-host 0 or more"
        )
    if args.nnodes < 2:
        refuse_per_host(args.ranks_per_host, args.replicas_per_host)
    config, graph = _loaded(args)
    if args.memory:
        plan = run_memory_plan(
            args.graph, config, graph, args.controllers, parse_replicas(args.replicas),
            args.nnodes, args.ranks_per_host, args.replicas_per_host,
        )  # fmt: skip
        if plan is None:
            raise UsageError(
                f"show --memory: {args.graph} does not plan its memory (a module function "
                "memory_plan(config, graph, processes) and a CONFIG, as the ready graphs have)"
            )
        print("\n".join(typed_words(line, args.graph) for line in plan.lines()))
        return 0
    target = planned(graph, args.controllers)
    print(target.to_mermaid() if args.mermaid else target.to_text())
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    spec = run_spec(args)  # every flag, parsed and checked once
    host, hosts = None, spec.launch.hosts
    if hosts is not None and hosts.nnodes > 1:  # this host's controllers start here
        from runtime.zmq.hosts import start_host

        host = start_host(spec, hosts)  # (a LaunchError is a UsageError)
        spec = host.spec
    elif hosts is not None:
        print(f"yatt-graph run: {hosts.describe()}", file=sys.stderr, flush=True)
    if host is not None and not host.runs_driver:
        return host.share.wait()  # the driver on node 0 runs the graph
    torch = sys.modules.get("torch")  # a caller's torch: its thread count is restored after
    threads = torch.get_num_threads() if torch is not None else None
    setup = RunSetup(spec)
    try:
        return run_command(spec, setup)
    finally:
        gc.unfreeze()
        if threads is not None:
            torch.set_num_threads(threads)
        setup.close()
        if host is not None:
            host.share.stop()


def cmd_export(args: argparse.Namespace) -> int:
    check_new_path(Path(args.path), "export: PATH")
    checkpoint, name = export_checkpoint(args.checkpoint, Path(args.path))
    print(f"exported the policy of node {name!r} in {checkpoint} to {args.path}")
    return 0


def cmd_controller(args: argparse.Namespace) -> int:
    from runtime.zmq.controller_main import serve

    return serve(args)


def cmd_keys(args: argparse.Namespace) -> int:
    from runtime.zmq.keys import generate_keys

    root = generate_keys(args.directory, force=args.force)
    print(f"wrote CURVE keys to {root}:")
    print(f"  {root}/driver.key_secret      the driver's key pair: keep it on the driver's host")
    print(f"  {root}/controller.key_secret  the controllers' key pair: every controller host")
    print(f"  {root}/driver.key, controller.key, authorized/   public keys: every host")
    print(f"use: yatt-graph run GRAPH --listen tcp://HOST:PORT --allow-remote --keys {root}")
    print(
        f"     yatt-graph controller --connect tcp://HOST:PORT --index I --allow-remote --keys {root}"
    )
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from runtime.train.plot import plot_run

    try:
        path = plot_run(args.run_dir, args.output)
    except ValueError as exc:  # no rows, no curves, a line that is not JSON: the folder's
        raise UsageError(str(exc)) from exc
    print(f"wrote {path}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from runtime.train.report import write_report

    path = write_report(args.run_dir, args.output)
    print(f"wrote {path} (open it in a browser; it needs no network)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    run = ["run", "graphs.mm_ppo", "--steps", str(args.steps), "--seed", "0", "--out", str(out)]
    run += ["--window", "20", "--export", str(out / "policy"), "--show-graph", "--overwrite"]
    run += ["--quiet"] if args.quiet else []
    print("yatt-graph demo: multimodal PPO on the shapes task (tiny models, in-process, CPU)")
    print("The policy must name the colour of the shape in the image. An image-blind policy")
    print("that always names some colour scores 0.4; a perfect one scores 1.0.\n", flush=True)
    code = cmd_run(build_parser().parse_args(run))
    if code == 0:
        from runtime.train.plot import plot_run

        print(f"curves: {plot_run(out)}")
    return code


_MODEL_FLAGS = (
    ("--policy", None, "'tiny', tiny-gpt2|tiny-llama|tiny-qwen2, or a local model directory (a "
     "causal LM, an image-text-to-text VLM or a saved prefix-VLM)"),
    ("--teacher", "DIR", "a local model folder with the policy's tokenizer whose logprobs teach "
     "the policy (on-policy distillation; with --set distill_coef=1)"),
    ("--vision", None, "'tiny' or open_clip:NAME[:WEIGHTS_FILE]"),
    ("--data", "PATH", "a local JSONL, Parquet or CSV file or save_to_disk folder (columns "
     "prompt, image, answer; --set prompt_key=... to map others); default: the shapes task"),
    ("--val-data", "PATH", "validation data, scored greedily (val/* metrics)"),
    ("--reward", None, "module:function or file.py:function (fn(text, meta) -> float), 'clip', "
     "model:DIR, judge:DIR or http://HOST:PORT/PATH"),
    ("--reward-model", "DIR", "a local sequence classifier as the reward"),
    ("--env", "FILE.py:CLASS", "an environment class (reset(row), step(action); "
     "nodes.agents.Environment) for an agent graph (text_agent); each data row goes to its reset"),
    ("--judge", "DIR", "a local causal LM or VLM judging each response"),
)  # fmt: skip
"""The ``run``/``show``/``viz`` flags that name a model, the data or the reward: (flag,
metavar or None, help)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="yatt-graph", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, func: Callable[..., int], help: str, graph: bool = False) -> Any:
        """The subcommand ``name``; ``graph``: with the graph and the flags of its options."""
        p = sub.add_parser(name, help=help)
        p.set_defaults(func=func)
        if not graph:
            return p
        p.add_argument(
            "graph",
            help="a ready graph by name (toy, mm_ppo, mm_grpo, text_ppo, text_grpo, text_agent, "
            "mm_agent), or a graph module (graphs.toy, my_graphs.rl) or file (my_graph.py)",
        )
        p.add_argument(
            "--set",
            action="extend",
            nargs="+",
            default=[],
            metavar="KEY=VALUE",
            help="options of the graph's build_graph(), parsed by their types (booleans: "
            "true/false/yes/no/on/off/1/0); several after one --set, or --set again; "
            "`show GRAPH --options` lists them",
        )
        models = p.add_argument_group("models, data and reward (graphs that take them)")
        for flag, metavar, text in _MODEL_FLAGS:
            models.add_argument(flag, metavar=metavar, help=text)
        models.add_argument(
            "--rollout", choices=("hf", "vllm"), help="rollout backend (vllm: CUDA + the extra)"
        )
        models.add_argument(
            "--device",
            choices=("auto", "cpu", "cuda"),
            help="where model nodes run (auto: CUDA where present)",
        )
        models.add_argument(
            "--train-ranks",
            type=int,
            metavar="K",
            help="train the update as K torch.distributed ranks (FSDP2 by default; gloo on the "
            "CPU, NCCL on CUDA), one node to the graph",
        )
        models.add_argument(
            "--train-backend",
            choices=("fsdp", "hsdp", "ddp"),
            help="with --train-ranks: shard with FSDP2 (fully_shard), shard within each host and "
            "replicate across hosts (hsdp), or replicate with DDP",
        )
        return p

    p = command("viz", cmd_viz, "draw a graph (or its plan) to SVG or PNG", graph=True)
    p.add_argument("-o", "--output", required=True, help="out.svg or out.png")
    p.add_argument("--controllers", type=int, default=1, help="draw the plan for N controllers")

    p = command("show", cmd_show, "print a graph (or its plan) as text or Mermaid", graph=True)
    p.add_argument("--controllers", type=int, default=1)
    p.add_argument("--mermaid", action="store_true")
    p.add_argument(
        "--options", action="store_true", help="list the graph's options instead (builds nothing)"
    )
    p.add_argument(
        "--all", action="store_true", help="with --options: also those that do nothing here"
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="print the memory plan instead: what each model node holds per device, and "
        "whether each device has room (estimates; ready graphs)",
    )
    p.add_argument(
        "--replicas", metavar="NODE=R,...", help="with --memory: copies of nodes, as run takes them"
    )
    p.add_argument("--nnodes", type=int, default=1, metavar="N",
                   help="with --memory: the hosts the controllers are shared by, as run's --nnodes")  # fmt: skip
    for flag in ("--ranks-per-host", "--replicas-per-host"):
        p.add_argument(
            flag,
            type=int,
            default=0,
            metavar="M",
            help=f"with --memory and --nnodes: as run's {flag}",
        )

    p = command("run", cmd_run, "run a graph for some steps in this process", graph=True)
    add_run_arguments(p)
    add_launch_arguments(p)

    p = command(
        "controller", cmd_controller, "join a driver started with `run --listen` (another host)"
    )

    add_controller_arguments(p)

    p = command("keys", cmd_keys, "create CURVE keys for runs across hosts")
    p.add_argument("directory", help="an empty folder for the keys")
    p.add_argument("--force", action="store_true", help="replace keys already there")

    p = command("plot", cmd_plot, "draw a run's reward/KL curves to a PNG")
    p.add_argument("run_dir", help="the --out folder of a run")
    p.add_argument("-o", "--output", help="PNG path (default RUN_DIR/curves.png)")

    p = command(
        "report",
        cmd_report,
        "write one HTML page about a run: curves, node times, the graph, samples, settings",
    )
    p.add_argument("run_dir", help="the --out folder of a run (finished, in progress or stopped)")
    p.add_argument("-o", "--output", help="HTML path (default RUN_DIR/report.html)")

    p = command(
        "export", cmd_export, "save the policy of a checkpoint (rebuilds the graph it records)"
    )
    p.add_argument(
        "checkpoint", help="a run folder (its newest good checkpoint) or checkpoints/step_N"
    )
    p.add_argument("path", help="a new folder for save_pretrained")

    p = command("demo", cmd_demo, "train the multimodal PPO example on the CPU")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--out", default="runs/demo", help="folder for metrics, curves, trace, policy")
    p.add_argument("--quiet", action="store_true")
    return parser


def parse_run(argv: Sequence[str]) -> RunSpec:
    """The :class:`~runtime.flags.RunSpec` of ``yatt-graph run ARGV`` (its graph resolved, every
    flag checked; its options typed with :func:`runtime.run.graph_options`), for a script that
    builds a run as the command does."""
    args = build_parser().parse_args(["run", *argv])
    args.graph = resolve_graph(args.graph)
    return run_spec(args)


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(words)
    except SystemExit as exc:  # argparse said what is wrong; a graph swallowed by --set too
        if exc.code == 2 and "--set" in words:
            print(
                "yatt-graph: the graph goes before --set, which takes every KEY=VALUE after it",
                file=sys.stderr,
            )
        raise
    from runtime.errors import ProcessFault

    def said(exc: BaseException) -> str:
        """The message, the node keywords of its first line as the user types them
        (``typed_words``); the lines after it (a traceback) and a place in the graph's own
        code (a GraphError, an ImportError) are left as they are."""
        graph, text = getattr(args, "graph", None), str(exc)
        if not graph or isinstance(exc, GraphError | ImportError):
            return text
        head, sep, rest = text.partition("\n")
        return typed_words(head, graph) + sep + rest

    try:
        if getattr(args, "graph", None):
            args.graph = resolve_graph(args.graph)
        return args.func(args)
    except OptionError as exc:  # "unknown option ...": the line says what it is
        print(f"yatt-graph {args.command}: {exc}", file=sys.stderr)
        return 2
    except (UsageError, ImportError, FileNotFoundError, FileExistsError) as exc:
        print(f"yatt-graph {args.command}: error: {said(exc)}", file=sys.stderr)  # the user's
        return 2
    except (NodeExecutionError, ProcessFault) as exc:
        # The run stopped cleanly (every controller is gone); say what failed, where, once.
        print(f"yatt-graph {args.command}: the run stopped: {said(exc)}", file=sys.stderr)
        return 1
    except PermissionError as exc:  # the folder or file the user named, not a bug
        print(
            f"yatt-graph {args.command}: error: {exc}; check the path's permissions",
            file=sys.stderr,
        )
        return 2
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        print(f"yatt-graph {args.command}: error: {exc.code}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        what, code = stopped_by(exc)
        print(f"yatt-graph {args.command}: stopped by {what}", file=sys.stderr)
        return code
    except Exception:
        traceback.print_exc()
        print(
            f"yatt-graph {args.command}: this is a bug in yatt-graph (not in your input): please "
            "report it with the traceback above",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":  # python -m runtime.cli (torchrun -m runtime.cli)
    sys.exit(main())
