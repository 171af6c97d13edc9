"""The ``yatt-graph`` command: draw, list, run graphs.

yatt-graph viz graphs/toy.py -o toy.svg [--controllers 3]
yatt-graph show graphs/toy.py [--mermaid]
yatt-graph run graphs/toy.py --steps 30 --seed 0
yatt-graph demo
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.checkpoint import CheckpointError
from yatt_graph import GraphError
from yatt_graph.refs import load_graph

__all__ = ["main"]


def _options(pairs: Sequence[str]) -> dict[str, Any]:
    """``--set key=value`` pairs; values are parsed as JSON when they can be."""
    import json

    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set {pair!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _graph_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--set`` pairs plus the named model options, for the graph's ``build_graph``."""
    options = _options(args.set)
    for key in ("policy", "vision", "reward", "seed"):
        value = getattr(args, key, None)
        if value is not None:
            options[key] = value
    return options


def _load(args: argparse.Namespace) -> Any:
    return load_graph(args.graph, **_graph_options(args))


def cmd_viz(args: argparse.Namespace) -> int:
    graph = _load(args)
    target = graph.plan(args.controllers) if args.controllers > 1 else graph
    suffix = Path(args.output).suffix.lstrip(".").lower()
    if suffix not in ("svg", "png"):
        raise SystemExit(f"viz: -o must end in .svg or .png, got {args.output!r}")
    target.draw(args.output)
    print(f"wrote {args.output} ({len(graph.nodes)} nodes, {len(graph.edges)} edges)")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    graph = _load(args)
    target = graph.plan(args.controllers) if args.controllers > 1 else graph
    print(target.to_mermaid() if args.mermaid else target.to_text())
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from runtime.local import LocalExecutor
    from runtime.loop import train

    options = _graph_options(args)
    graph = load_graph(args.graph, **options)
    out = Path(args.out) if args.out else None
    distributed = args.controllers > 1 or args.listen
    if distributed and (args.checkpoint_every or args.resume or args.export):
        raise SystemExit(
            "run: checkpoints, --resume and --export work with the in-process executor only for "
            "now; drop --controllers/--listen, or drop --checkpoint-every/--resume/--export"
        )
    if distributed:
        from runtime.driver import ZmqExecutor

        executor = ZmqExecutor(
            graph.plan(args.controllers),
            graph_ref=args.graph,
            graph_options=options,
            max_staleness=args.max_staleness,
            controller_output="inherit",
            spawn=not args.no_spawn,
            address=args.listen,
            allow_tcp=bool(args.listen),
        )
    else:
        executor = LocalExecutor(graph)
    try:
        rows = train(
            executor,
            args.steps,
            out,
            checkpoint_every=args.checkpoint_every,
            resume=args.resume,
            progress=not args.quiet,
        )
    finally:
        if distributed:
            executor.close()
    if args.export:
        print(
            f"exported the policy of node {export_policy(graph, Path(args.export))!r} to {args.export}"
        )
    rewards = [r["scores/mean"] for r in rows if "scores/mean" in r]
    if rewards:
        window = max(1, min(args.window, len(rewards) // 2))
        first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
        print(f"mean reward: first {window} steps {first:.3f} -> last {window} steps {last:.3f}")
    if out is not None:
        print(f"metrics: {out / 'metrics.jsonl'}  trace: {out / 'trace.json'}")
    return 0


def cmd_controller(args: argparse.Namespace) -> int:
    from runtime.controller import main as controller_main

    return controller_main(["--connect", args.connect, "--index", str(args.index)])


def cmd_plot(args: argparse.Namespace) -> int:
    from runtime.plot import plot_run

    path = plot_run(args.run_dir, args.output)
    print(f"wrote {path}")
    return 0


def export_policy(graph: Any, path: Path) -> str:
    """Save the trained policy of the graph's update node with ``save_pretrained``."""
    for name, node in graph.nodes.items():
        policy = getattr(node, "policy", None)
        if node.kind == "update" and hasattr(policy, "save_pretrained"):
            policy.save_pretrained(path)
            return name
    raise ValueError(
        f"graph {graph.name!r} has no update node holding a policy with save_pretrained()"
    )


def cmd_demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    run = ["run", "graphs.mm_ppo", "--steps", str(args.steps), "--seed", "0", "--out", str(out)]
    run += ["--window", "20", "--export", str(out / "policy")] + (["--quiet"] if args.quiet else [])
    print("yatt-graph demo: multimodal PPO on the shapes task (tiny models, in-process, CPU)")
    print("The policy must name the colour of the shape in the image. An image-blind policy")
    print("that always names some colour scores 0.4; a perfect one scores 1.0.\n")
    print(load_graph("graphs.mm_ppo").to_text(), "\n", flush=True)
    code = cmd_run(build_parser().parse_args(run))
    if code == 0:
        from runtime.plot import plot_run

        print(f"curves: {plot_run(out)}")
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="yatt-graph", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def graph_command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("graph", help="a graph module (graphs.toy) or file (graphs/toy.py)")
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="an option for the graph's build_graph(); repeatable",
        )
        p.add_argument("--policy", help="'tiny' or a local model directory (graphs that take one)")
        p.add_argument("--vision", help="'tiny' or open_clip:NAME[:WEIGHTS_FILE]")
        p.add_argument("--reward", help="a rule reward as module:function, fn(text, meta) -> float")
        return p

    p = graph_command("viz", "draw a graph (or its plan) to SVG or PNG")
    p.add_argument("-o", "--output", required=True, help="out.svg or out.png")
    p.add_argument("--controllers", type=int, default=1, help="draw the plan for N controllers")
    p.set_defaults(func=cmd_viz)

    p = graph_command("show", "print a graph (or its plan) as text or Mermaid")
    p.add_argument("--controllers", type=int, default=1)
    p.add_argument("--mermaid", action="store_true")
    p.set_defaults(func=cmd_show)

    p = graph_command("run", "run a graph for some steps in this process")
    p.add_argument(
        "--steps", type=int, default=30, help="total steps (a resumed run counts restored ones)"
    )
    p.add_argument("--seed", type=int, default=None, help="passed to build_graph(seed=...)")
    p.add_argument("--out", default=None, help="folder for metrics.jsonl, trace.json, checkpoints")
    p.add_argument(
        "--checkpoint-every", type=int, default=0, metavar="K", help="checkpoint every K steps"
    )
    p.add_argument(
        "--resume", default=None, metavar="DIR", help="continue from the newest good checkpoint"
    )
    p.add_argument(
        "--controllers", type=int, default=1, help="run the plan on N controller processes"
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        metavar="K",
        help="async mode: sources may run K steps ahead of the update (0: on-policy)",
    )
    p.add_argument(
        "--listen",
        default=None,
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
        default=None,
        metavar="DIR",
        help="save the trained policy there with save_pretrained (in-process runs)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "controller", help="join a driver started with `run --listen` (another host)"
    )
    p.add_argument("--connect", required=True, metavar="tcp://HOST:PORT")
    p.add_argument("--index", type=int, required=True, help="which controller of the plan this is")
    p.set_defaults(func=cmd_controller)

    p = sub.add_parser("plot", help="draw a run's reward/KL curves to a PNG")
    p.add_argument("run_dir", help="the --out folder of a run")
    p.add_argument("-o", "--output", default=None, help="PNG path (default RUN_DIR/curves.png)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("demo", help="train the multimodal PPO example on the CPU")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--out", default="runs/demo", help="folder for metrics, curves, trace, policy")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (
        GraphError,
        ImportError,
        FileNotFoundError,
        ValueError,
        TypeError,
        CheckpointError,
    ) as exc:
        print(f"yatt-graph {args.command}: error: {exc}", file=sys.stderr)
        return 2
