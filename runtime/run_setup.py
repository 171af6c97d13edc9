"""What ``yatt-graph run`` builds from its flags: the graph's options (checked against what the
graph declares), the graph, and the :class:`RunSetup` that
:func:`runtime.train.run_command.run_command` takes. The run's
:class:`~runtime.engine.config.RunConfig`, its threads and its executor factory are in
:mod:`runtime.run_executor`."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from runtime.run_executor import executor_factory, run_config, start_controllers, thread_policy
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

__all__ = [
    "OptionError",
    "RunSetup",
    "check_controller_count",
    "graph_input",
    "graph_options",
    "load",
    "memory_plan",
    "planned",
    "ready_graphs",
    "resolve_graph",
    "shown_graph",
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
        """What the graph's typed config says about the settings it resolved, for the run's
        first lines: its ``run_notes(steps, given)`` (the ready graphs': defaults chosen for
        the model given, a chat template applied, options set that do nothing, a learning rate
        that reaches 0 before the last step), else its ``notes()``; keywords as typed."""
        args = self.args
        config = _resolved_config(args.graph, options, "notes")
        if config is None:
            return []
        if hasattr(config, "run_notes"):
            given = {*_set_texts(args.set), *(k for k in _NAMED_OPTIONS if k in options)}
            notes = config.run_notes(args.steps, given & set(options))
        else:
            notes = config.notes()
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
        if typed_config(args.graph, "memory_plan") is None:
            return []
        if args.controllers > 1 or args.listen:
            return [f"`yatt-graph show {args.graph} --memory --controllers {args.controllers}` "
                    "with this run's options prints it"]  # fmt: skip
        plan = memory_plan(args.graph, options, graph)
        lines = plan.device_lines() if plan is not None else []
        return [typed_words(line, args.graph) for line in lines]

    def executor_factory(self, graph: Any, options: dict, devices: Any, distributed: bool) -> Any:
        """``make_executor()`` for the run (see :func:`runtime.run_executor.executor_factory`)."""
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
    """The memory plan (``nodes.memory_plan.MemoryPlan``) of a graph whose typed config plans
    (``CONFIG.memory_plan``), its nodes placed on ``controllers`` (checked) as a run places
    them; None for a graph without one."""
    plan = planned(graph, controllers)
    config = _resolved_config(target, options, "memory_plan")
    if config is None:
        return None
    processes = {n: str(plan.controller_of(n)) for n in graph.nodes} if controllers > 1 else None
    return config.memory_plan(graph, processes)


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
