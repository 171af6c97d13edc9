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

import gc
import importlib.util
import json
import re
import shlex
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from runtime.flags import NAMED_OPTIONS, GraphArgs, RunSpec, TrainSettings, same_folder
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
from yatt_graph import Graph, GraphError, UsageError
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
    "run_memory_plan",
    "planned",
    "print_summary",
    "ready_graphs",
    "resolve_graph",
    "resume_point",
    "run_command",
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


def graph_options(graph: GraphArgs, offload: str | None = None) -> dict[str, Any]:
    """``--set`` pairs plus the named model options (``--on-bad-sample`` too), typed for the
    graph's ``build_graph`` and checked against its options before anything is built (a bad
    value of a typed config included); a key it has no option for is an :class:`OptionError`.
    ``offload``: the run's ``--offload`` (``off`` keeps vLLM awake)."""
    module = load_graph_module(graph.ref)
    known, more = module_options(module)
    texts = graph.sets
    try:
        values = parse_options(texts, known, more, graph.ref)
    except UnknownOptionError as exc:
        raise unknown_option(graph, exc.key, known, f"--set {exc.key}={texts[exc.key]}") from None
    names = {o.name for o in known}
    for key, value in graph.named.items():
        flag = graph.typed[key].partition(" ")[0]
        if key in values:
            raise UsageError(f"{flag} and --set {key}=... both give {key!r}; give it once")
        if isinstance(value, str) and not value.strip():
            raise UsageError(f"{flag} was given an empty value (an unset shell variable?)")
        if key not in names and (not more or key == "on_bad_sample"):  # (a flag of the run's)
            if key == "on_bad_sample" and value == "raise":
                continue  # what a graph without the option does: its reward nodes raise
            raise unknown_option(graph, key, known, graph.typed[key])
        values[key] = value
    if offload == "off" and "vllm_sleep" in names:
        values.setdefault("vllm_sleep", False)  # a run that never offloads keeps vLLM awake
    check_config(module, values, graph.ref)  # ranges and choices, before models are built
    return values


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


def unknown_option(graph: GraphArgs, key: str, known: list[Option], given: str) -> OptionError:
    """The one line for ``key``, which ``graph`` takes no option for, given as ``given``
    (``--set key=value`` or a flag such as ``--vision tiny``): the ready graphs that have it,
    or the flag of this command it is, or the nearest of the graph's options; and the command
    that lists them."""
    name = shown_graph(graph.ref)
    line = f"unknown option {key!r} for {name}"
    if not given.startswith("--set "):
        line += f" (given by {given})"
    value = given.partition("=")[2] if given.startswith("--set ") else given.partition(" ")[2]
    others = [] if key == "on_bad_sample" else _ready_graphs_with(key, value, name)
    if key == "on_bad_sample":
        line += (
            ": its reward nodes decide what a bad score does (they raise unless built with "
            "on_bad_sample='skip'); give its build_graph() an on_bad_sample option to take the flag"
        )
    elif others:
        line += f": it is an option of {_listed(others)}, not of {name}"
    elif given.startswith("--set ") and key in graph.flags:
        line += f": it is not a graph option but a flag of yatt-graph {graph.command}: "
        line += _flag(key) if graph.flags[key] or not value else f"{_flag(key)} {value}"
    else:
        docs = {o.name: o.doc for o in known}
        line += did_you_mean(nearest(key, [o.name for o in known], docs))
    return OptionError(f"{line}; `yatt-graph show {name} --options` lists the options of {name}")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def typed_words(text: str, target: str) -> str:
    """``text`` (a message of a node or of the graph's config) with the keywords of the graph
    ``target``'s options written as a ``yatt-graph`` user types them: a flag's option with
    its flag (``on_bad_sample='skip'``: ``--on-bad-sample skip``, ``rollout=hf``: ``--rollout
    hf``), another with ``--set`` where it is spelled as Python (``stream=True``: ``--set
    stream=true``) or follows "set" (``set tis_cap=0``: ``use --set tis_cap=0``). Other mentions
    (``max_new_tokens=2 more``) are left as they are, as are a quoted echo of what the user
    typed (``got 'rollout=abc'``), a flag's value (``--replicas rollout=2``: typed already)
    and ``text`` if the graph does not load."""
    try:
        options, _ = module_options(load_graph_module(target))
    except Exception:  # the message is about that: say it as it is
        return text
    keys = sorted((o.name for o in options), key=len, reverse=True)
    if not keys:
        return text
    pattern = re.compile(
        r"(?<![\w.='\"-])(?P<verb>set )?(?P<key>" + "|".join(map(re.escape, keys)) + r")="
        r"(?P<value>'[^']*'|\"[^\"]*\"|[^\s,;)]+)"
    )

    def typed(match: re.Match[str]) -> str:
        key, raw = match["key"], match["value"]
        if re.search(r"--[\w-]+ $", text[: match.start()]):
            return match[0]  # typed already: a flag's value (--set KEY=VALUE, --replicas ...)
        python = raw[0] in "'\"" or raw in ("True", "False", "None")
        if raw[0] in "'\"":
            value, tail = raw[1:-1], ""
        elif python:
            value, tail = raw.lower(), ""
        else:  # a sentence's full stop is no part of the value
            value = raw.rstrip(".")
            tail = raw[len(value) :]
        use = "use " if match["verb"] else ""
        if key in NAMED_OPTIONS:
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


def load(graph: GraphArgs, options: dict[str, Any]) -> tuple[Any, Graph]:
    """The graph's typed config (None for a graph without one) and the graph, built once from
    ``options``; an exception raised while building it names the place in the graph's file it
    came from. A module with a typed ``CONFIG`` and ``graph_from_config(config)`` (the ready
    graphs) is built from the config made here, which the notes, the memory plan and
    ``settings.json`` read too."""
    ref = graph.ref
    try:
        module = load_graph_module(ref)
        config_type = getattr(module, "CONFIG", None)
        from_config = getattr(module, "graph_from_config", None)
        config = None
        if hasattr(config_type, "from_options"):
            config = config_type.from_options(ref, options)
        if config is not None and callable(from_config):
            return config, from_config(config)
        return config, load_graph(ref, **options)
    except Exception as exc:
        user = (ValueError, TypeError, UsageError, FileNotFoundError, NotADirectoryError)
        if _ready_graph(ref) and type(exc) in user:
            # a ready graph refusing what the user gave it (a value, a path that is not
            # there): the message is the whole line
            raise UsageError(f"{ref}: {exc}") from exc
        where = located(ref, exc)
        if where is None:
            raise
        raise GraphError(f"building {ref} failed at {where}") from exc


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
        if not (text.startswith(f"{graph}: ") or f" of {graph}: " in text):
            text = f"{graph}: {type(exc).__name__}: {text}"
        raise UsageError(text) from exc


class RunSetup:
    """One ``yatt-graph run`` assembled from its :class:`~runtime.flags.RunSpec`: :meth:`build`
    decides the thread policy (before torch loads), starts the controllers early where there
    are some, types the graph's options and builds the graph (:func:`executor_factory` then
    makes the executor for each attempt of the run, again after a restart); :meth:`close` ends
    controllers that were started and never used."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.thread_policy: Any = None
        self.early_controllers: Any = None

    def build(self) -> tuple[Any, Graph]:
        """The graph's typed config (None for a graph without one) and the graph; ``spec``
        gains the typed options."""
        spec, launch = self.spec, self.spec.launch
        if launch.listen:
            from runtime.zmq.keys import check_address

            try:
                check_address(launch.listen, allow_tcp=True, allow_remote=launch.allow_remote,
                              who="yatt-graph run --listen")  # fmt: skip
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        self.thread_policy = thread_policy(spec)
        if (
            1 < launch.controllers <= self.thread_policy.cores
            and launch.spawn
            and not launch.listen
        ):
            # Start the controllers now: they import torch and the graph's module while this
            # process builds the graph (the first step comes seconds sooner). Only as many as
            # the host has cores: a count the graph cannot use is refused below, and must not
            # load the machine first.
            self.early_controllers = start_controllers(spec)
        with graph_input(spec.graph.ref):
            self.spec = spec = spec.with_options(graph_options(spec.graph, spec.engine.offload))
            config, graph = load(spec.graph, spec.options)
        try:
            _check_controllers(spec, graph)
        except UsageError:
            self.close()
            raise
        return config, graph

    def notes(self, config: Any) -> list[str]:
        """What the graph module's ``run_notes(config, steps, given)`` says about the settings
        its typed config resolved, for the run's first lines (the ready graphs': defaults chosen
        for the model given, a chat template applied, options set that do nothing, a learning
        rate that reaches 0 before the last step); keywords as typed."""
        spec = self.spec
        run_notes = getattr(load_graph_module(spec.graph.ref), "run_notes", None)
        if run_notes is None or config is None:
            return []
        given = {*spec.graph.sets, *spec.graph.named} & set(spec.options)
        notes = run_notes(config, spec.train.steps, given)
        return [typed_words(line, spec.graph.ref) for line in notes]

    def settings(self, config: Any, notes: list[str]) -> dict[str, Any]:
        """The run's effective settings, as JSON values, for ``OUT/settings.json`` (what
        ``yatt-graph report`` shows): the :class:`~runtime.flags.RunSpec`, what the graph's
        typed config resolves its options to, the threads and the run's ``notes``."""
        import msgspec

        spec = msgspec.to_builtins(self.spec, enc_hook=str)
        del spec["graph"]["flags"]  # the command's flags, for messages only
        return _json_values(
            {
                **spec,
                "config": msgspec.to_builtins(config) if config is not None else None,
                "threads": self.thread_policy.describe() if self.thread_policy else None,
                "notes": notes,
            }
        )

    def memory_lines(self, config: Any, graph: Graph) -> list[str]:
        """The memory plan's line per device, for the run's first lines. Made in an
        in-process run, which loads the models' libraries anyway; a driver of controllers
        holds no model and stays without them, so it says how to see the plan instead."""
        spec = self.spec
        ref = spec.graph.ref
        if getattr(load_graph_module(ref), "memory_plan", None) is None:
            return []
        if spec.launch.distributed:
            return [f"`yatt-graph show {ref} --memory --controllers {spec.launch.controllers}` "
                    "with this run's options prints it"]  # fmt: skip
        plan = run_memory_plan(ref, config, graph, replicas=spec.engine.replicas)
        lines = plan.device_lines() if plan is not None else []
        return [typed_words(line, ref) for line in lines]

    def take_controllers(self) -> Any:
        """The controllers started early, for the first executor (later ones start their own)."""
        group, self.early_controllers = self.early_controllers, None
        return group

    def close(self) -> None:
        if self.early_controllers is not None:  # the run stopped before it needed them
            self.take_controllers().shutdown("the run stopped before its first step")


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


def planned(graph: Graph, controllers: int) -> Any:
    """The graph, or its plan as ``yatt-graph run --controllers N`` (colocated) makes it."""
    check_controller_count(controllers, graph, graph.name)
    if controllers < 2:
        return graph
    from runtime.sched.placement import controller_assignment

    return graph.plan(controllers, placement=controller_assignment(graph, controllers))


def run_memory_plan(
    target: str,
    config: Any,
    graph: Graph,
    controllers: int = 1,
    replicas: Mapping[str, int] | None = None,
    nnodes: int = 1,
    ranks_per_host: int = 0,
    replicas_per_host: int = 0,
) -> Any:
    """The memory plan (``nodes.memory_plan.MemoryPlan``) of a graph whose module plans
    (``memory_plan(config, graph, processes)``, as the ready graphs have) for its typed
    ``config``, its nodes placed on ``controllers`` (checked) as a run places them, with
    ``replicas`` copies of nodes (``--replicas``), the controllers shared by ``nnodes`` hosts
    and the copies over them as ``--ranks-per-host`` and ``--replicas-per-host`` place them;
    None for a graph without one."""
    plan = planned(graph, controllers)
    planner = getattr(load_graph_module(target), "memory_plan", None)
    if planner is None or config is None:
        return None
    processes = {n: str(plan.controller_of(n)) for n in graph.nodes} if controllers > 1 else None
    layout = _copies_layout(graph, plan, replicas or {}, nnodes, ranks_per_host,
                            replicas_per_host)  # fmt: skip
    if layout is None:
        return planner(config, graph, processes)
    copies, hosts = layout
    return planner(config, graph, processes, copies=copies, hosts=hosts)


def _copies_layout(
    graph: Graph, plan: Any, replicas: Mapping[str, int], nnodes: int, ranks_per_host: int,
    replicas_per_host: int,
) -> tuple[dict[str, list[Any]], dict[str, str]] | None:  # fmt: skip
    """Where each copy of a node with replicas or ranks runs (its host and its index there,
    ``nodes.memory_plan.Copy``), as a run places them
    (``runtime.ranks.placement``), and each controller's host: None for a plan of one host
    without replicas (what a graph's ``memory_plan`` plans by itself)."""
    from runtime.flags import controller_shares
    from runtime.ranks.placement import place_ranks, place_replicas
    from runtime.sched.fanout import replica_counts

    try:
        counts = replica_counts(graph.nodes, replicas)
    except ValueError as exc:
        raise UsageError(f"--replicas: {exc}") from None
    if nnodes < 2 and not counts:
        return None
    controllers = plan.controllers if graph is not plan else 1
    shares = controller_shares(controllers, nnodes)  # (a LaunchError: the user's to fix)
    host_of = {c: f"host {h}" if nnodes > 1 else "" for h, cs in enumerate(shares) for c in cs}
    hosts = [host_of[c] for c in range(controllers)]
    copies: dict[str, list[Any]] = {}
    for name, node in graph.nodes.items():
        owner = plan.controller_of(name) if graph is not plan else 0
        count, per_host, place = counts.get(name, 1), replicas_per_host, place_replicas
        if node.ranks > 1:
            count, per_host, place = node.ranks, ranks_per_host, place_ranks
        if count < 2:
            continue
        if nnodes > 1 and per_host:
            _, where, local = place(name, count, per_host, owner, hosts)
        else:
            where, local = [hosts[owner]] * count, list(range(count))
        copies[name] = list(zip(where, local, strict=True))  # (host, index there) a copy
    by_process = {str(c): h for c, h in enumerate(hosts)} if nnodes > 1 else {}
    return copies, by_process


def check_controller_count(count: int, graph: Graph, name: str) -> None:
    """``--controllers`` from 1 to the graph's node count (a controller runs at least one)."""
    n = len(graph.nodes)
    if count < 1:
        raise UsageError(f"--controllers must be 1 or more, got {count}")
    if count > n:
        raise UsageError(
            f"--controllers {count}: {name} has {n} nodes and a controller runs at least "
            f"one; use --controllers {n} or fewer"
        )


def _check_controllers(spec: RunSpec, graph: Graph) -> None:
    """Controllers and ranks the graph can use, checked once it is built (before any step)."""
    launch = spec.launch
    count = launch.controllers
    check_controller_count(count, graph, spec.graph.ref)
    if spec.engine.placement == "partial" and count > 1:
        from runtime.sched.placement import partial_sides

        try:
            sides = partial_sides(graph, launch.pins)
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

    ranks, cores = int(spec.options.get("train_ranks") or 1), usable_cores()
    ranks = min(ranks, spec.engine.ranks_per_host or ranks)  # this host's
    device = str(spec.options.get("device") or "auto")
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


def start_controllers(spec: RunSpec) -> Any:
    """The run's controllers started now, for the first executor to take: they import
    torch and the graph's module while this process builds the graph."""
    from runtime.zmq.controllers import Controllers
    from runtime.zmq.keys import load_keys

    keys_dir = spec.launch.keys
    keys = load_keys(keys_dir, "driver") if keys_dir else None
    return Controllers(
        spec.launch.controllers, keys=keys, keys_dir=keys_dir, controller_output="inherit",
        max_message_bytes=spec.engine.max_message_bytes, preload=(spec.graph.ref,),
    )  # fmt: skip


def executor_factory(setup: RunSetup, graph: Graph) -> Any:
    """The factory of the run's executor: in-process, or ZeroMQ controllers, each configured
    by the run's one :class:`~runtime.engine.config.RunConfig`."""
    from runtime.engine.engine import LocalExecutor
    from runtime.sched.fanout import replica_counts
    from runtime.train.loop import Accounting

    spec = setup.spec
    launch, config = spec.launch, spec.engine
    try:  # --replicas naming a node that is not there, or one that cannot be copied
        replica_counts(graph.nodes, config.replicas)
    except ValueError as exc:
        raise UsageError(f"--replicas: {exc}") from None

    policy = setup.thread_policy
    print(f"yatt-graph run: threads: {policy.describe()}", file=sys.stderr, flush=True)
    cut = None
    if launch.distributed and config.placement == "partial":
        from runtime.sched.placement import PartialCut

        try:
            cut = PartialCut(graph, launch.pins)
        except ValueError as exc:
            raise UsageError(f"--pin: {exc}") from None

    if (
        launch.distributed
        and config.max_staleness
        and config.staleness == "fixed"
        and config.adaptive
    ):
        print(
            "yatt-graph run: --staleness fixed: every step reads exactly the weights "
            f"{config.max_staleness + 1} versions back; a rerun matches this one bitwise only "
            "with fixed thread counts (--no-adaptive or --threads N), since adaptive "
            "partitioning changes them when it measures a gain, and float rounding with them",
            file=sys.stderr,
            flush=True,
        )

    def make_executor() -> Any:
        if not launch.distributed:
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

        if not launch.spawn:  # say at once whom the driver waits for, and how to start them
            from runtime.zmq import STARTUP_TIMEOUT_S

            keys = f" --keys {launch.keys}" if launch.keys else ""
            print(
                f"yatt-graph run: waiting up to {STARTUP_TIMEOUT_S:g} s for {launch.controllers} "
                f"controllers at {launch.listen}; start each (I = 0..{launch.controllers - 1}) "
                f"with `yatt-graph controller --connect {launch.listen} --index I{keys}`",
                file=sys.stderr,
                flush=True,
            )
        sides = cut.sides if cut is not None else None
        hints = controller_assignment(graph, launch.controllers, config.placement, sides=sides)
        return Accounting(
            ZmqExecutor(
                graph.plan(launch.controllers, placement=hints),
                config,
                graph_ref=spec.graph.ref,
                graph_options=spec.options,
                controller_output="inherit",
                spawn=launch.spawn,
                address=launch.listen,
                allow_tcp=bool(launch.listen),
                allow_remote=launch.allow_remote,
                keys=launch.keys,
                group=setup.take_controllers(),  # the first attempt's, started early
            ),
            sched=policy.metrics(),
        )

    replan = cut.replan if cut is not None and config.adaptive else None
    return make_executor, replan


def thread_policy(spec: RunSpec) -> Any:
    """The run's torch threads and OpenMP wait policy (runtime.sched.devices), decided by
    measuring the cores before torch loads (the wait policy is read then) and before the
    controllers start (they inherit it)."""
    from runtime.sched.devices import run_policy, usable_core_ids

    cores = usable_core_ids()
    return run_policy(
        cores,
        threads=spec.engine.num_threads,
        shared=_beside(spec, len(cores)),
        controllers=spec.launch.distributed,
    )


def _beside(spec: RunSpec, cores: int) -> bool:
    """Whether other processes or worker threads of this run compute on its cores while it
    does: replicas, training ranks, split slots, or controllers that run at once and
    outnumber the cores (colocated on-policy controllers take turns)."""
    launch, config = spec.launch, spec.engine
    ranks = spec.graph.named.get("train_ranks") or 1
    text = spec.graph.sets.get("train_ranks", "").strip()
    if text.isdigit():
        ranks = int(text)
    if config.replicas or ranks > 1 or config.slots:
        return True
    at_once = config.placement == "partial" or config.max_staleness > 0
    return launch.controllers > 1 and at_once and launch.controllers > cores


def run_command(spec: RunSpec, setup: RunSetup) -> int:
    """``yatt-graph run``: check the run folder and the paths, take the folder, build the graph
    (``setup.build()``), train on the executors of :func:`executor_factory`, export. Returns
    the exit code."""
    if spec.launch.ray is not None:  # Ray starts a `yatt-graph run` per node; node 0's runs it
        from runtime.ray_launch import run_on_ray

        return run_on_ray(spec, sys.argv[1:])
    train = spec.train
    if train.resume and not Path(train.resume).is_dir():
        what = "is a file" if Path(train.resume).exists() else "does not exist"
        raise UsageError(
            f"--resume {train.resume}: {what}; it takes a run folder or one of its "
            "checkpoints/step_N folders"
        )
    out = (
        Path(train.out)
        if train.out
        else (run_folder_of(Path(train.resume)) if train.resume else None)
    )
    if out is not None:
        check_folder(out, "--out" if train.out else "--resume")
        if (out / "checkpoints").exists():
            check_folder(out / "checkpoints", "--out: its checkpoint folder")
    lock = RunLock(out).acquire() if out is not None else None
    try:
        with sigterm_as_interrupt():
            return _run_in_folder(train, out, setup)
    finally:
        if lock is not None:
            lock.release()


def _run_in_folder(train: TrainSettings, out: Path | None, setup: RunSetup) -> int:
    from runtime.train.loop import train_with_restarts

    resuming_here = bool(train.resume) and out is not None and same_folder(str(out), train.resume)
    if out is not None:
        note = prepare_run_folder(out, resuming_here=resuming_here, overwrite=train.overwrite)
        if note:
            print(f"yatt-graph run: {note}", file=sys.stderr)
    export = Path(train.export) if train.export else None
    if export is not None:
        check_new_path(export, "--export")
    config, graph = setup.build()
    spec = setup.spec  # with the graph's options typed
    notes = setup.notes(config)
    for line in notes:
        print(f"yatt-graph run: {line}", file=sys.stderr)
    for line in setup.memory_lines(config, graph):
        print(f"yatt-graph run: memory plan: {line}", file=sys.stderr)
    if export is not None:
        policy_node(graph)
    if train.show_graph:
        print(graph.to_text(), "\n", flush=True)
    if out is not None:  # what `yatt-graph report` shows of the run, even if it stops early
        record_run(out, setup.settings(config, notes), graph)
    resume = resume_point(train, graph, out if resuming_here else None)
    start = (checkpoint_step(resume) or 0) if resume is not None else 0
    earlier_s = 0.0  # the wall time of the steps before ``start``, for the summary
    if resume is not None and out is not None and train.resume:
        earlier_s = _continue_record(out, run_folder_of(Path(train.resume)), start)
    meta = {"graph_ref": spec.graph.ref, "graph_options": spec.options}

    make_executor, replan = executor_factory(setup, graph)

    device_lines: list[str] = []
    final: dict[str, Any] = {}

    def on_done(ex: Any) -> None:
        if export is not None:
            final.update(step=ex.next_step, state=ex.state_dict())
        fanouts = getattr(ex, "fanouts", None)
        summary = fanouts.summary() if fanouts is not None else {}
        nodes = summary.get("nodes", {})
        if summary.get("slots"):
            shares = ", ".join(
                f"{name} {100 * d['utilization']:.0f}%" for name, d in summary["slots"].items()
            )
            split = ", ".join(sorted(n for n, f in nodes.items() if f["kind"] == "slots"))
            device_lines.append(f"slots (nodes {split} split across them): {shares} busy")
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
            train.steps,
            out,
            checkpoint_every=train.checkpoint_every,
            resume=resume,
            progress=train.progress,
            glance_every=train.glance_every,
            samples_every=train.samples_every,
            wandb=train.wandb,
            restart=train.restart,
            max_restarts=train.max_restarts,
            on_done=on_done,
            meta=meta,
            replan=replan,
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
    print_summary(train.window, rows, device_lines, out, wall_s=wall_s, resumed_at=start)
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


def resume_point(train: TrainSettings, graph: Graph, here: Path | None) -> Path | None:
    """The checkpoint ``--resume`` continues from, checked before any step runs: good, of this
    graph, not past ``--steps``. Resuming into its own folder moves later checkpoints aside."""
    if not train.resume:
        return None
    path, meta = find_checkpoint(train.resume, graph_identity(graph))
    if meta["step"] >= train.steps:  # (equal: nothing to run, and the run's summary stays)
        where = "is below" if meta["step"] > train.steps else "is already"
        raise UsageError(
            f"--steps {train.steps} {where} the step of {path} ({meta['step']}); --steps "
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
    """One line for Ctrl-C or SIGTERM, saying where the run stopped and what was kept (a
    second signal that came while the loop closed after the first still says the step: the
    first is its context)."""
    first = exc
    while getattr(first, "step", None) is None and isinstance(first.__context__, KeyboardInterrupt):
        first = first.__context__
    step = getattr(first, "step", None)
    what, code = stopped_by(exc)
    where = f" after step {step}" if step is not None else ""
    kept = f"; metrics and trace are in {out}" if out is not None else ""
    checkpoint = getattr(first, "checkpoint", None)
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
    greedy = ("val/reward", "val/greedy")  # (val/greedy beside avg@k and pass@k)
    val = [
        next(r[k] for k in greedy if k in r)
        for r in rows
        if any(isinstance(r.get(k), int | float) for k in greedy)
    ]
    if val:
        summary["val_reward_last"] = round(val[-1], 6)
    return summary


def print_summary(
    window: int,
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
    summary = run_summary(rows, window, wall_s, resumed_at)
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
