"""``yatt-graph run`` from its parsed flags to the end of the run, in the order it happens.

:func:`run_command` checks every flag and path (:func:`runtime.flags.check_flags`),
takes the run folder (writable, locked, not holding another run unless ``--resume`` or
``--overwrite``) and the export path; :class:`RunSetup` decides the thread policy before
torch loads (:func:`thread_policy`), starts the controllers early where there are some
(:func:`start_controllers`), reads the graph's options (:func:`graph_options`, checked
against what the graph declares) and builds the graph (:func:`load`); the run's notes and
memory plan are said, ``settings.json`` recorded, the resumed checkpoint checked (good, of
this graph, not past ``--steps``); then :func:`executor_factory` makes the executor for each
attempt (again after a restart), configured by the one :class:`~runtime.engine.config.RunConfig`
of the flags (:func:`run_config`), and :func:`runtime.train.loop.train_with_restarts` trains
under SIGTERM handling. The export comes last and, when it fails, leaves the policy in a
checkpoint and says how to export it.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import re
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from runtime.flags import check_flags, same_folder
from runtime.train.checkpoint import checkpoint_step, checkpoints, find_checkpoint, save_checkpoint
from runtime.train.export import export_policy, policy_node
from runtime.train.loop import sigterm_as_interrupt, stopped_by
from runtime.train.metrics import read_metrics
from runtime.train.run_folder import (
    RunLock,
    check_folder,
    check_new_path,
    move_aside,
    prepare_run_folder,
    record_run,
    run_folder_of,
)
from yatt_graph import GraphError, UsageError
from yatt_graph.options import (
    Option,
    UnknownOptionError,
    check_config,
    did_you_mean,
    graph_file,
    load_graph_module,
    located,
    module_options,
    nearest,
    parse_options,
)
from yatt_graph.refs import load_graph, module_file
from yatt_graph.serialize import graph_identity

__all__ = [
    "OptionError",
    "RunSetup",
    "check_controller_count",
    "executor_factory",
    "graph_input",
    "graph_options",
    "load",
    "memory_plan",
    "planned",
    "print_summary",
    "ready_graphs",
    "resolve_graph",
    "resume_point",
    "run_command",
    "run_config",
    "run_summary",
    "shown_graph",
    "start_controllers",
    "thread_policy",
    "typed_config",
    "typed_words",
]


class OptionError(UsageError):
    """A key the graph takes no option for, worded for how the user gave it: its message is
    the whole line after ``yatt-graph COMMAND:`` (``unknown option ...`` says what it is)."""


def _set_texts(pairs: Sequence[str]) -> dict[str, str]:
    """``--set key=value`` pairs as key -> text; a pair without ``=``, or a key given twice
    with two values, is refused."""
    texts: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(
                f"--set {pair!r}: expected KEY=VALUE (the graph goes before --set, which takes "
                "every KEY=VALUE after it)"
            )
        if key in texts and texts[key] != value:
            raise UsageError(
                f"--set gives {key!r} twice ({texts[key]!r} and {value!r}); give it once"
            )
        texts[key] = value
    return texts


#: flags that name a graph option (``--val-data`` is the option ``val_data``)
_NAMED_OPTIONS = (
    "policy", "vision", "reward", "env", "seed", "data", "val_data", "rollout", "device",
    "train_ranks", "train_backend", "on_bad_sample",
)  # fmt: skip


def _reward_flags(args: argparse.Namespace) -> None:
    """``--reward-model DIR`` and ``--judge DIR`` are ``--reward model:DIR`` / ``judge:DIR``."""
    given = {key: getattr(args, key, None) for key in ("reward", "reward_model", "judge")}
    named = [f"--{key.replace('_', '-')}" for key, value in given.items() if value is not None]
    if len(named) > 1:
        raise UsageError(f"{' and '.join(named)}: give one reward")
    if given["reward_model"] is not None:
        args.reward = f"model:{given['reward_model']}"
    elif given["judge"] is not None:
        args.reward = f"judge:{given['judge']}"


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _given(args: argparse.Namespace, key: str, typed: str) -> str:
    """The flag and value the user typed for the option ``key`` (``--reward-model DIR`` and
    ``--judge DIR`` give the option ``reward``), else ``typed``."""
    for flag in ("reward_model", "judge"):
        if key == "reward" and getattr(args, flag, None) is not None:
            return f"{_flag(flag)} {getattr(args, flag)}"
    return typed


def graph_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--set`` pairs plus the named model options (``--on-bad-sample`` too), for the graph's
    ``build_graph``, checked against its options before anything is built (a bad value of a
    typed config included); a key it has no option for is an :class:`OptionError`."""
    module = load_graph_module(args.graph)
    known, more = module_options(module)
    texts = _set_texts(args.set)
    try:
        values = parse_options(texts, known, more, args.graph)
    except UnknownOptionError as exc:
        raise unknown_option(args, exc.key, known, f"--set {exc.key}={texts[exc.key]}") from None
    names = {o.name for o in known}
    _reward_flags(args)
    for key in _NAMED_OPTIONS:
        value = getattr(args, key, None)
        if value is None:
            continue
        flag = _flag(key)
        if key in values:
            raise UsageError(f"{flag} and --set {key}=... both give {key!r}; give it once")
        if isinstance(value, str) and not value.strip():
            raise UsageError(f"{flag} was given an empty value (an unset shell variable?)")
        if key not in names and (not more or key == "on_bad_sample"):  # (a flag of the run's)
            if key == "on_bad_sample" and value == "raise":
                continue  # what a graph without the option does: its reward nodes raise
            raise unknown_option(args, key, known, _given(args, key, f"{flag} {value}"))
        values[key] = value
    if getattr(args, "offload", None) == "off" and "vllm_sleep" in names:
        values.setdefault("vllm_sleep", False)  # a run that never offloads keeps vLLM awake
    check_config(module, values, args.graph)  # ranges and choices, before models are built
    return values


_NOT_FLAGS = ("set", "graph", "func", "command")
"""Names in the parsed flags that are no flag a user types."""


def shown_graph(target: str) -> str:
    """How a message names the graph ``target``: a ready graph by its name (``text_ppo``, as
    ``yatt-graph run text_ppo`` takes it from any folder), another as given."""
    path = graph_file(target)
    return path.stem if path is not None and _ready_graph(target) else target


def _ready_graphs_with(key: str, text: str, but: str) -> list[str]:
    """The ready graphs other than ``but`` that have the option ``key``, read from each one's
    options (its typed ``CONFIG``, or its ``build_graph`` signature): those that take the
    value ``text`` for it where any does (an agent graph has ``dynamic_sampling`` only to
    refuse it), else all that have it."""
    found, taking = [], []
    for name in ready_graphs():
        if name == but:
            continue
        target = f"graphs.{name}"
        try:
            module = load_graph_module(target)
        except ImportError:  # a ready graph whose extra is not installed takes nothing here
            continue
        options, more = module_options(module)
        if not any(o.name == key for o in options):
            continue
        found.append(name)
        try:
            check_config(module, parse_options({key: text}, options, more, target), target)
        except (TypeError, ValueError):
            continue
        taking.append(name)
    return taking or found


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def unknown_option(
    args: argparse.Namespace, key: str, known: list[Option], given: str
) -> OptionError:
    """The one line for ``key``, which the graph of ``args`` takes no option for, given as
    ``given`` (``--set key=value`` or a flag such as ``--vision tiny``): the ready graphs that
    have it, or the flag of this command it is, or the nearest of the graph's options; and
    the command that lists them."""
    graph = shown_graph(args.graph)
    line = f"unknown option {key!r} for {graph}"
    if not given.startswith("--set "):
        line += f" (given by {given})"
    value = given.partition("=")[2] if given.startswith("--set ") else given.partition(" ")[2]
    others = [] if key == "on_bad_sample" else _ready_graphs_with(key, value, graph)
    if key == "on_bad_sample":
        line += (
            ": its reward nodes decide what a bad score does (they raise unless built with "
            "on_bad_sample='skip'); give its build_graph() an on_bad_sample option to take the flag"
        )
    elif others:
        line += f": it is an option of {_listed(others)}, not of {graph}"
    elif given.startswith("--set ") and key in vars(args) and key not in _NOT_FLAGS:
        switch = isinstance(getattr(args, key), bool)  # a flag without a value (--quiet)
        line += f": it is not a graph option but a flag of yatt-graph {args.command}: "
        line += _flag(key) if switch or not value else f"{_flag(key)} {value}"
    else:
        docs = {o.name: o.doc for o in known}
        line += did_you_mean(nearest(key, [o.name for o in known], docs))
    return OptionError(f"{line}; `yatt-graph show {graph} --options` lists the options of {graph}")


def typed_words(text: str, target: str) -> str:
    """``text`` (a message of a node or of the graph's config) with the keywords of the graph
    ``target``'s options written as a ``yatt-graph`` user types them: a flag's option with
    its flag (``on_bad_sample='skip'``: ``--on-bad-sample skip``, ``rollout=hf``: ``--rollout
    hf``), another with ``--set`` where it is spelled as Python (``stream=True``: ``--set
    stream=true``) or follows "set" (``set tis_cap=0``: ``use --set tis_cap=0``). Other mentions
    (``max_new_tokens=2 more``) are left as they are, and so is ``text`` if the graph does
    not load."""
    try:
        options, _ = module_options(load_graph_module(target))
    except Exception:  # the message is about that: say it as it is
        return text
    keys = sorted((o.name for o in options), key=len, reverse=True)
    if not keys:
        return text
    pattern = re.compile(
        r"(?<![\w.=-])(?P<verb>set )?(?P<key>" + "|".join(map(re.escape, keys)) + r")="
        r"(?P<value>'[^']*'|\"[^\"]*\"|[^\s,;)]+)"
    )

    def typed(match: re.Match[str]) -> str:
        key, raw = match["key"], match["value"]
        if text[: match.start()].endswith("--set "):
            return match[0]  # typed already
        python = raw[0] in "'\"" or raw in ("True", "False", "None")
        if raw[0] in "'\"":
            value, tail = raw[1:-1], ""
        elif python:
            value, tail = raw.lower(), ""
        else:  # a sentence's full stop is no part of the value
            value = raw.rstrip(".")
            tail = raw[len(value) :]
        use = "use " if match["verb"] else ""
        if key in _NAMED_OPTIONS:
            return f"{use}{_flag(key)} {shlex.quote(value)}{tail}"
        if python or use:
            return f"{use}--set {shlex.quote(f'{key}={value}')}{tail}"
        return match[0]

    return pattern.sub(typed, text)


def _graphs_folder() -> Path | None:
    """The folder of the ready graphs (the installed ``graphs`` package), found, not imported:
    it is a layer up."""
    init = module_file("graphs")
    return init.parent if init is not None else None


def ready_graphs() -> list[str]:
    """The names of the ready graphs: ``toy``, ``mm_ppo``, ...; ``yatt-graph run NAME`` runs one."""
    folder = _graphs_folder()
    if folder is None:
        return []
    return sorted(
        p.stem for p in folder.glob("*.py") if "\ndef build_graph(" in p.read_text(errors="replace")
    )


def resolve_graph(target: str) -> str:
    """The graph ``target`` names: a file or module as given, else the ready graph it names
    (``text_grpo``, or ``graphs/text_grpo.py`` from outside the repository) as its module
    (``graphs.text_grpo``), so that it runs from any folder."""
    path = Path(target)
    if path.exists():
        return target
    if target.isidentifier():
        try:
            if importlib.util.find_spec(target) is not None:
                return target  # a module of the user's by that name comes first
        except (ImportError, ValueError):
            pass
    elif not target.endswith(".py"):
        return target  # a dotted module: importing it says what is wrong
    ready = ready_graphs()
    name = path.stem if target.endswith(".py") else target
    if name in ready and (target == name or path.parent.name == "graphs"):
        return f"graphs.{name}"
    what = "the file does not exist" if target.endswith(".py") else "no module or ready graph"
    raise UsageError(
        f"no graph {target!r}: {what}; the ready graphs run by name from any folder "
        f"({', '.join(ready)}), and a graph of your own is a file (my_graph.py) or a module"
    )


def _ready_graph(target: str) -> bool:
    """Whether ``target`` is one of the ready graphs (``graphs/``), not a user's file."""
    path, folder = graph_file(target), _graphs_folder()
    return path is not None and folder is not None and path.parent == folder


def load(args: argparse.Namespace, options: dict[str, Any] | None = None) -> Any:
    """The graph, built with ``options`` (default: from the flags); an exception raised while
    building it names the place in the graph's file it came from."""
    options = graph_options(args) if options is None else options
    try:
        return load_graph(args.graph, **options)
    except Exception as exc:
        if _ready_graph(args.graph) and type(exc) in (ValueError, TypeError, UsageError):
            # a ready graph refusing what the user gave it: the message is the whole line
            raise UsageError(f"{args.graph}: {exc}") from exc
        where = located(args.graph, exc)
        if where is None:
            raise
        raise GraphError(f"building {args.graph} failed at {where}") from exc


@contextmanager
def graph_input(graph: str) -> Iterator[None]:
    """While the graph's options are read and the graph is built, a ValueError or TypeError
    (an unknown option, a node constructor refusing a value) is the user's to fix: one line."""
    try:
        yield
    except UsageError:
        raise
    except (ValueError, TypeError) as exc:
        text = str(exc)  # a message that names the graph already is the whole line
        if not text.startswith(f"{graph}: "):
            text = f"{graph}: {type(exc).__name__}: {text}"
        raise UsageError(text) from exc


class RunSetup:
    """One ``yatt-graph run`` assembled from its flags: :meth:`build` decides the thread policy
    (before torch loads), starts the controllers early where there are some, and builds the
    graph; :meth:`executor_factory` makes the executor for each attempt of the run (again after
    a restart); :meth:`close` ends controllers that were started and never used. What it holds
    (the policy, the early group) stays here, not on the parsed flags."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.thread_policy: Any = None
        self.early_group: Any = None

    def build(self) -> tuple[dict[str, Any], Any]:
        """The graph's options and the graph."""
        args = self.args
        if args.listen:
            from runtime.zmq.keys import check_address

            try:
                check_address(args.listen, allow_tcp=True, allow_remote=args.allow_remote,
                              who="yatt-graph run --listen")  # fmt: skip
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        self.thread_policy = thread_policy(args)
        if 1 < args.controllers <= self.thread_policy.cores and not (args.no_spawn or args.listen):
            # Start the controllers now: they import torch and the graph's module while this
            # process builds the graph (the first step comes seconds sooner). Only as many as
            # the host has cores: a count the graph cannot use is refused below, and must not
            # load the machine first.
            self.early_group = start_controllers(args)
        with graph_input(args.graph):
            options = graph_options(args)
            graph = load(args, options)
        try:
            _check_controllers(args, graph, options)
        except UsageError:
            self.close()
            raise
        return options, graph

    def notes(self, options: dict[str, Any]) -> list[str]:
        """What the graph module's ``run_notes(config, steps, given)`` says about the settings
        its typed config resolved, for the run's first lines (the ready graphs': defaults chosen
        for the model given, a chat template applied, options set that do nothing, a learning
        rate that reaches 0 before the last step); keywords as typed."""
        args = self.args
        run_notes = getattr(load_graph_module(args.graph), "run_notes", None)
        config = _resolved_config(args.graph, options, "from_options")
        if run_notes is None or config is None:
            return []
        given = {*_set_texts(args.set), *(k for k in _NAMED_OPTIONS if k in options)}
        notes = run_notes(config, args.steps, given & set(options))
        return [typed_words(line, args.graph) for line in notes]

    def settings(self, options: dict[str, Any], devices: Any, distributed: bool) -> dict[str, Any]:
        """The run's effective settings, as JSON values, for ``OUT/settings.json`` (what
        ``yatt-graph report`` shows): the flags, the graph options given, what the graph's
        typed config resolves them to, the :class:`RunConfig`, the threads and the notes."""
        import msgspec

        args = self.args
        flags = {k: v for k, v in vars(args).items() if k != "func" and not k.startswith("_")}
        resolved = _resolved_config(args.graph, options, "from_options")
        return _json_values(
            {
                "graph": args.graph,
                "flags": flags,
                "graph_options": options,
                "config": msgspec.to_builtins(resolved) if resolved is not None else None,
                "run_config": msgspec.to_builtins(run_config(args, options, devices, distributed)),
                "threads": self.thread_policy.describe() if self.thread_policy else None,
                "notes": self.notes(options),
            }
        )

    def memory_lines(self, options: dict[str, Any], graph: Any) -> list[str]:
        """The memory plan's line per device, for the run's first lines. Made in an
        in-process run, which loads the models' libraries anyway; a driver of controllers
        holds no model and stays without them, so it says how to see the plan instead."""
        args = self.args
        if getattr(load_graph_module(args.graph), "memory_plan", None) is None:
            return []
        if args.controllers > 1 or args.listen:
            return [f"`yatt-graph show {args.graph} --memory --controllers {args.controllers}` "
                    "with this run's options prints it"]  # fmt: skip
        plan = memory_plan(args.graph, options, graph)
        lines = plan.device_lines() if plan is not None else []
        return [typed_words(line, args.graph) for line in lines]

    def executor_factory(self, graph: Any, options: dict, devices: Any, distributed: bool) -> Any:
        """``make_executor()`` for the run (see :func:`runtime.run.executor_factory`)."""
        return executor_factory(self, graph, options, devices, distributed)

    def take_group(self) -> Any:
        """The controllers started early, for the first executor (later ones start their own)."""
        group, self.early_group = self.early_group, None
        return group

    def close(self) -> None:
        if self.early_group is not None:  # the run stopped before it needed them
            self.take_group().shutdown("the run stopped before its first step")


def _json_values(value: Any) -> Any:
    """``value`` with what JSON cannot hold (paths, functions, structs) as its text."""
    if isinstance(value, dict):
        return {str(k): _json_values(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_values(v) for v in value]
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    return str(value)


def typed_config(target: str, method: str) -> Any:
    """The typed config class of the graph ``target`` (its module's ``CONFIG``, as the ready
    graphs have) where it has ``method``, else None."""
    config = getattr(load_graph_module(target), "CONFIG", None)
    return config if hasattr(config, method) else None


def _resolved_config(target: str, options: dict[str, Any], method: str) -> Any:
    """The typed config of ``target`` with ``method`` (:func:`typed_config`) made from
    ``options`` (its ``from_options``), else None."""
    config = typed_config(target, method)
    return None if config is None else config.from_options(target, options)


def planned(graph: Any, controllers: int) -> Any:
    """The graph, or its plan as ``yatt-graph run --controllers N`` (colocated) makes it."""
    check_controller_count(controllers, graph, graph.name)
    if controllers < 2:
        return graph
    from runtime.sched.placement import controller_assignment

    return graph.plan(controllers, placement=controller_assignment(graph, controllers))


def memory_plan(target: str, options: dict[str, Any], graph: Any, controllers: int = 1) -> Any:
    """The memory plan (``nodes.memory_plan.MemoryPlan``) of a graph whose module plans
    (``memory_plan(config, graph, processes)``, as the ready graphs have), its nodes placed on
    ``controllers`` (checked) as a run places them; None for a graph without one."""
    plan = planned(graph, controllers)
    planner = getattr(load_graph_module(target), "memory_plan", None)
    config = _resolved_config(target, options, "from_options")
    if planner is None or config is None:
        return None
    processes = {n: str(plan.controller_of(n)) for n in graph.nodes} if controllers > 1 else None
    return planner(config, graph, processes)


def check_controller_count(count: int, graph: Any, name: str) -> None:
    """``--controllers`` from 1 to the graph's node count (a controller runs at least one)."""
    n = len(graph.nodes)
    if count < 1:
        raise UsageError(f"--controllers must be 1 or more, got {count}")
    if count > n:
        raise UsageError(
            f"--controllers {count}: {name} has {n} nodes and a controller runs at least "
            f"one; use --controllers {n} or fewer"
        )


def _check_controllers(args: argparse.Namespace, graph: Any, options: dict[str, Any]) -> None:
    """Controllers and ranks the graph can use, checked once it is built (before any step)."""
    count = args.controllers
    check_controller_count(count, graph, args.graph)
    if args.placement == "partial" and count > 1:
        from runtime.sched.placement import partial_sides

        try:
            sides = partial_sides(graph, args.pins)
        except ValueError as exc:
            raise UsageError(f"--pin: {exc}") from None
        per = {side: sum(1 for s in sides.values() if s == side) for side in ("rollout", "train")}
        fits = [
            c
            for c in range(2, count + 1)
            if -(-c // 2) <= per["rollout"] and c // 2 <= per["train"]
        ]
        if not fits or fits[-1] < count:
            best = f"use --controllers {fits[-1]} or fewer" if fits else "pin a node to each side"
            raise UsageError(
                f"--placement partial --controllers {count}: the rollout side gets {-(-count // 2)} "
                f"controllers for its {per['rollout']} node(s) and the training side "
                f"{count // 2} for its {per['train']}, and a controller runs at least one; {best}"
            )
    from runtime.sched.devices import usable_cores, visible_gpus

    ranks, cores = int(options.get("train_ranks") or 1), usable_cores()
    device = str(options.get("device") or "auto")
    on_gpu = device.startswith("cuda") or (device == "auto" and visible_gpus() > 0)
    if ranks > _RANKS_PER_CORE * cores and not on_gpu:  # each one a process with torch
        raise UsageError(
            f"--train-ranks {ranks} on {cores} cores: each rank is a process holding torch and "
            f"a copy of the model, and more than {_RANKS_PER_CORE} a core only add memory "
            f"(enough of them end in an out-of-memory kill); use at most {cores}"
        )
    if ranks > cores and not on_gpu:
        print(
            f"yatt-graph run: --train-ranks {ranks} on {cores} cores: the ranks share cores, and "
            "each step waits for the slowest; fewer ranks than cores train faster",
            file=sys.stderr,
            flush=True,
        )


_RANKS_PER_CORE = 4
"""Training ranks a CPU core may carry before a run is refused (one warns above 1)."""


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
    from runtime.engine.engine import LocalExecutor
    from runtime.sched.fanout import replica_counts
    from runtime.train.loop import Accounting

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
    """The run's torch threads and OpenMP wait policy (runtime.sched.devices), decided by
    measuring the cores before torch loads (the wait policy is read then) and before the
    controllers start (they inherit it)."""
    from runtime.sched.devices import run_policy, usable_core_ids

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


def run_command(args: Any, setup: Any) -> int:
    """``yatt-graph run``: check every flag and path, take the run folder, build the graph
    (``setup.build() -> (options, graph)``), train on ``setup.executor_factory(graph, options,
    devices, distributed)()``, export. Returns the exit code."""

    devices, distributed = check_flags(args)  # before the graph (and its models) is built
    if args.resume and not Path(args.resume).is_dir():
        what = "is a file" if Path(args.resume).exists() else "does not exist"
        raise UsageError(
            f"--resume {args.resume}: {what}; it takes a run folder or one of its "
            "checkpoints/step_N folders"
        )
    out = (
        Path(args.out) if args.out else (run_folder_of(Path(args.resume)) if args.resume else None)
    )
    if out is not None:
        check_folder(out, "--out" if args.out else "--resume")
        if (out / "checkpoints").exists():
            check_folder(out / "checkpoints", "--out: its checkpoint folder")
    lock = RunLock(out).acquire() if out is not None else None
    try:
        with sigterm_as_interrupt():
            return _run_in_folder(args, out, devices, distributed, setup)
    finally:
        if lock is not None:
            lock.release()


def _run_in_folder(args: Any, out: Path | None, devices: Any, distributed: bool, setup: Any) -> int:
    from runtime.train.loop import train_with_restarts

    resuming_here = bool(args.resume) and out is not None and same_folder(str(out), args.resume)
    if out is not None:
        note = prepare_run_folder(out, resuming_here=resuming_here, overwrite=args.overwrite)
        if note:
            print(f"yatt-graph run: {note}", file=sys.stderr)
    export = Path(args.export) if args.export else None
    if export is not None:
        check_new_path(export, "--export")
    options, graph = setup.build()
    for line in setup.notes(options):
        print(f"yatt-graph run: {line}", file=sys.stderr)
    for line in setup.memory_lines(options, graph):
        print(f"yatt-graph run: memory plan: {line}", file=sys.stderr)
    if export is not None:
        policy_node(graph)
    if args.show_graph:
        print(graph.to_text(), "\n", flush=True)
    if out is not None:  # what `yatt-graph report` shows of the run, even if it stops early
        record_run(out, setup.settings(options, devices, distributed), graph)
    resume = resume_point(args, graph, out if resuming_here else None)
    start = (checkpoint_step(resume) or 0) if resume is not None else 0
    earlier_s = 0.0  # the wall time of the steps before ``start``, for the summary
    if resume is not None and out is not None:
        earlier_s = _continue_record(out, run_folder_of(Path(args.resume)), start)
    meta = {"graph_ref": args.graph, "graph_options": options}

    make_executor = setup.executor_factory(graph, options, devices, distributed)

    device_lines: list[str] = []
    final: dict[str, Any] = {}

    def on_done(ex: Any) -> None:
        if export is not None:
            final.update(step=ex.next_step, state=ex.state_dict())
        fanouts = getattr(ex, "fanouts", None)
        summary = fanouts.summary() if fanouts is not None else {}
        nodes = summary.get("nodes", {})
        if summary.get("devices"):
            shares = ", ".join(
                f"{name} {100 * d['utilization']:.0f}%" for name, d in summary["devices"].items()
            )
            split = ", ".join(sorted(n for n, f in nodes.items() if f["kind"] == "slots"))
            device_lines.append(f"devices (nodes {split} split across them): {shares} busy")
        for name, f in nodes.items():
            if f["kind"] == "replicas":
                parts = ", ".join(
                    f"{label} {d['pieces']} pieces / {d['busy_s']:.1f} s"
                    for label, d in f["by_worker"].items()
                )
                device_lines.append(f"replicas of {name}: {parts}")

    started = time.perf_counter()
    try:
        rows, restarts = train_with_restarts(
            make_executor,
            args.steps,
            out,
            checkpoint_every=args.checkpoint_every,
            resume=resume,
            progress=not args.quiet,
            glance_every=args.glance_every,
            samples_every=args.samples_every,
            wandb=args.wandb,
            restart=args.restart,
            max_restarts=args.max_restarts,
            on_done=on_done,
            meta=meta,
        )
    except KeyboardInterrupt as exc:
        return _interrupted(exc, out)
    if restarts:
        print(f"the run completed after {restarts} restart(s); see {out / 'events.jsonl'}")
    code = 0
    if export is not None:
        code = _export(graph, export, out, final, {**meta, "graph": graph_identity(graph)})
    wall_s = time.perf_counter() - started
    if out is not None and start > 0:  # the summary covers the run from step 0, not this part
        rows, wall_s = read_metrics(out), wall_s + earlier_s
    print_summary(args, rows, device_lines, out, wall_s=wall_s, resumed_at=start)
    return code


def _continue_record(out: Path, source: Path, start: int) -> float:
    """Before a run resumed at step ``start`` (from the run folder ``source``) goes on in
    ``out``: where ``out`` is another folder (``--resume A --out B``) holding no rows yet, the
    metric rows of steps 0 to ``start - 1`` are carried over, so that it records the whole run;
    the summary of the earlier part goes (the run writes one of the whole at its end). Returns
    the earlier steps' wall time: that summary's, where it ended at ``start``, else the sum of
    their ``time/step``."""
    earlier = _read_summary(source)
    (out / "summary.json").unlink(missing_ok=True)
    rows = read_metrics(source) if (source / "metrics.jsonl").is_file() else []
    rows = [r for r in rows if r["step"] < start]
    if not same_folder(str(out), str(source)) and not (out / "metrics.jsonl").is_file():
        (out / "metrics.jsonl").write_text(
            "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), encoding="utf-8"
        )
    if earlier.get("last_step") == start - 1 and isinstance(earlier.get("wall_s"), int | float):
        return float(earlier["wall_s"])
    return sum(_number(r.get("time/step")) for r in rows)


def _read_summary(folder: Path) -> dict[str, Any]:
    try:
        summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _number(value: Any) -> float:
    """A metric's value as a float; 0 for one a row does not hold (None: not finite)."""
    return float(value) if isinstance(value, int | float) else 0.0


def resume_point(args: Any, graph: Any, here: Path | None) -> Path | None:
    """The checkpoint ``--resume`` continues from, checked before any step runs: good, of this
    graph, not past ``--steps``. Resuming into its own folder moves later checkpoints aside."""
    if not args.resume:
        return None
    path, meta = find_checkpoint(args.resume, graph_identity(graph))
    if meta["step"] >= args.steps:  # (equal: nothing to run, and the run's summary stays)
        where = "is below" if meta["step"] > args.steps else "is already"
        raise UsageError(
            f"--steps {args.steps} {where} the step of {path} ({meta['step']}); --steps "
            "counts the restored steps too: pass --steps above it to train on"
        )
    later = [p for p in checkpoints(here) if checkpoint_step(p) > meta["step"]] if here else []
    if later:
        moved = move_aside(here, [f"checkpoints/{p.name}" for p in later])
        print(
            f"yatt-graph run: moved checkpoints after step {meta['step']} into {moved}",
            file=sys.stderr,
        )
    return path


def _interrupted(exc: KeyboardInterrupt, out: Path | None) -> int:
    """One line for Ctrl-C or SIGTERM, saying where the run stopped and what was kept."""
    step = getattr(exc, "step", None)
    what, code = stopped_by(exc)
    where = f" after step {step}" if step is not None else ""
    kept = f"; metrics and trace are in {out}" if out is not None else ""
    checkpoint = getattr(exc, "checkpoint", None)
    if checkpoint is not None:
        kept += f"; checkpoint {checkpoint} (continue with --resume {out})"
    print(f"yatt-graph run: stopped by {what}{where}{kept}", file=sys.stderr)
    return code


def run_summary(
    rows: list[dict], window: int, wall_s: float, resumed_at: int = 0
) -> dict[str, Any]:
    """What the closing JSON line says of the run's ``rows`` (from step 0, restored steps
    too): steps, wall time, samples/s, the mean reward of the first and the last ``window``
    steps (None without a reward), the last val/reward, and ``resumed_at``, the step this
    part of a resumed run started at (absent for a run from step 0)."""
    rewards = [r["scores/mean"] for r in rows if isinstance(r.get("scores/mean"), int | float)]
    samples = sum(_number(r.get("samples_per_s")) * _number(r.get("time/step")) for r in rows)
    summary: dict[str, Any] = {
        "steps": len(rows),
        "last_step": rows[-1]["step"] if rows else None,
        "wall_s": round(wall_s, 3),
        "samples_per_s": round(samples / wall_s, 3) if wall_s > 0 else 0.0,
        "reward_first": None,
        "reward_last": None,
        "window": 0,
    }
    if resumed_at:
        summary["resumed_at"] = resumed_at
    if rewards:
        window = max(1, min(window, len(rewards) // 2))
        summary["window"] = window
        summary["reward_first"] = round(sum(rewards[:window]) / window, 6)
        summary["reward_last"] = round(sum(rewards[-window:]) / window, 6)
    val = [r["val/reward"] for r in rows if isinstance(r.get("val/reward"), int | float)]
    if val:
        summary["val_reward_last"] = round(val[-1], 6)
    return summary


def print_summary(
    args: Any,
    rows: list[dict],
    device_lines: list[str],
    out: Any,
    wall_s: float = 0.0,
    resumed_at: int = 0,
) -> None:
    """The closing lines of the run's ``rows`` (from step 0; ``wall_s`` its time, the earlier
    part's steps counted by their ``time/step`` when it was resumed at step ``resumed_at``):
    reward, utilization, devices, skipped samples, where the files are, and last a one-line
    JSON summary (:func:`run_summary`; also ``OUT/summary.json``)."""
    summary = run_summary(rows, args.window, wall_s, resumed_at)
    part = f" (resumed at step {resumed_at})" if resumed_at else ""
    print(
        f"{summary['steps']} steps{part} in {summary['wall_s']:.1f} s: "
        f"{summary['samples_per_s']:.1f} samples/s"
    )
    if summary["reward_first"] is not None:
        window, first, last = summary["window"], summary["reward_first"], summary["reward_last"]
        print(f"mean reward: first {window} steps {first:.3f} -> last {window} steps {last:.3f}")
    if "val_reward_last" in summary:
        print(f"validation reward (greedy), last pass: {summary['val_reward_last']:.3f}")
    util_keys = sorted({k for r in rows for k in r if k.startswith("util/")})
    if util_keys:
        busy = {k: sum(_number(r.get(k)) for r in rows) / len(rows) for k in util_keys}
        shares = [
            f"{k.removeprefix('util/').replace('_', ' ')} {100 * b:.0f}%" for k, b in busy.items()
        ]
        print("utilization (busy share of each step): " + ", ".join(shares))
    for line in device_lines:
        print(line)
    skipped = rows[-1].get("skipped_samples_total") if rows else None
    if skipped:
        print(f"skipped samples: {int(skipped)} of {int(rows[-1]['samples_total'])} (bad scores)")
    if out is not None:
        print(f"metrics: {out / 'metrics.jsonl'}  trace: {out / 'trace.json'}")
        (out / "summary.json").write_text(json.dumps(summary, sort_keys=True) + "\n")
    print(json.dumps(summary, sort_keys=True), flush=True)


def _export(graph: Any, export: Path, out: Path | None, final: dict[str, Any], meta: dict) -> int:
    """Export the policy; when that fails, keep it in a checkpoint and say how to export it."""
    try:
        name = export_policy(graph, export, final["state"])
    except Exception as exc:  # the training is done: whatever went wrong, keep the policy
        newest = checkpoints(out)[-1] if out is not None and checkpoints(out) else None
        if newest is None or checkpoint_step(newest) != final["step"]:
            home = out or export.with_name(f"{export.name}.rescue-{time.strftime('%Y%m%d-%H%M%S')}")
            newest = save_checkpoint(home, final["step"], final["state"], meta=meta)
        print(
            f"yatt-graph run: --export {export} failed ({type(exc).__name__}: {exc}); the trained "
            f"policy is in {newest}: export it with `yatt-graph export {newest} PATH`",
            file=sys.stderr,
        )
        return 1
    print(f"exported the policy of node {name!r} to {export}")
    return 0
