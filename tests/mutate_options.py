"""Remove, one at a time, each place where the ready graphs hand an option on, and run
tests/graphs/test_option_wiring.py against each removal: every removal must fail it.

    .venv/bin/python tests/mutate_options.py                    # every mutation
    .venv/bin/python tests/mutate_options.py dual_clip kl_estimator   # those of these options
    .venv/bin/python tests/mutate_options.py -j 2               # two at a time

The working tree is never written. graphs/ and runtime/ are copied to a temporary folder, each
mutation is made in a copy, and a forked child puts that copy first on sys.path and runs the
test with pytest.main. The mutations, found by parsing the graph modules (graphs/*.py with a
``build_graph``), the helpers that turn their options into nodes (graphs/common.py,
graphs/front.py) and runtime/run.py:

* ``config.X`` given to a node or a spec as a keyword argument (``kl_estimator=config.
  kl_estimator``) or a dict entry (``"dtype": config.vllm_dtype``): the argument or the entry
  is dropped, so the node falls back to its own default;
* any other ``config.X`` (a condition, an assignment, a positional argument): replaced by
  ``type(config)().X``, the option's default in that graph;
* each entry of an agent config's ``_unsupported`` (the options it refuses): dropped;
* each name of a tuple of option names bound to a name (``names`` in graphs/common.py: the
  update's options; ``_NAMED_OPTIONS`` in runtime/run.py: the flags of ``yatt-graph
  run`` named after options): dropped.

A ``config.X`` inside an f-string (an error message) hands nothing on and is left alone.
Prints, per option, which mutations the test caught; exits 1 if one survived (the test passed
with it), 2 if a run could not tell (the unmutated copy failing, a crash, a timeout).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST = ROOT / "tests" / "graphs" / "test_option_wiring.py"
PACKAGES = ("graphs", "runtime")
"""The packages copied and mutated; a child imports them afresh from its copy."""
HELPERS = ("common.py", "front.py")
"""The modules of graphs/ that turn options into nodes for the graph modules."""
DERIVED = {"prompts_drawn": ("batch_size", "dynamic_sampling")}
"""Config properties made of options: a mutation of one concerns those options."""
TIMEOUT_S = 600


@dataclass
class Mutation:
    path: str
    """The mutated file, relative to the repository."""
    line: int
    what: str
    options: tuple[str, ...]
    source: bytes
    """The whole mutated file."""
    outcome: str = ""
    """caught, survived or error."""
    log: str = ""


@dataclass
class Worker:
    copy: Path
    pid: int = 0
    mutation: Mutation | None = None
    started: float = 0.0
    originals: dict[str, bytes] = field(default_factory=dict)


# --- finding the mutations ------------------------------------------------------------------


def option_names() -> set[str]:
    """Every option of the ready graphs' configs, read from the configs themselves."""
    sys.path.insert(0, str(ROOT))
    from yatt_graph.options import config_options, load_graph_module

    names: set[str] = set()
    for path in sorted((ROOT / "graphs").glob("*.py")):
        module = load_graph_module(f"graphs.{path.stem}")
        config = getattr(module, "CONFIG", None)
        if config is not None:
            names |= {o.name for o in config_options(config)}
    return names


class _Source:
    """A file's bytes and the byte offset of each (line, column) of its AST."""

    def __init__(self, path: Path) -> None:
        self.data = path.read_bytes()
        self.starts = [0]
        for line in self.data.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))

    def span(self, node: ast.AST, end: ast.AST | None = None) -> tuple[int, int]:
        last = end if end is not None else node
        start = self.starts[node.lineno - 1] + node.col_offset  # type: ignore[attr-defined]
        stop = self.starts[last.end_lineno - 1] + last.end_col_offset  # type: ignore[attr-defined]
        return start, stop

    def drop(self, start: int, stop: int) -> bytes:
        """The source without [start, stop) and the comma that separates it from the next
        item (or the previous one, for a last item)."""
        data, after = self.data, stop
        while after < len(data) and data[after : after + 1] in b" \t\r\n":
            after += 1
        if data[after : after + 1] == b",":
            return data[:start] + data[after + 1 :]
        before = start
        while before > 0 and data[before - 1 : before] in b" \t\r\n":
            before -= 1
        if data[before - 1 : before] == b",":
            return data[: before - 1] + data[stop:]
        return data[:start] + data[stop:]

    def replace(self, start: int, stop: int, text: str) -> bytes:
        return self.data[:start] + text.encode() + self.data[stop:]


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _in(node: ast.AST, parents: dict[ast.AST, ast.AST], kind: type) -> ast.AST | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, kind):
            return node
    return None


def mutations_of(path: Path, base: Path, options: set[str]) -> list[Mutation]:
    source, rel = _Source(path), str(path.relative_to(base))
    tree = ast.parse(source.data)
    parents = _parents(tree)
    found: list[Mutation] = []

    def add(node: ast.AST, what: str, names: tuple[str, ...], mutated: bytes) -> None:
        compile(mutated, rel, "exec")  # a mutation is still Python
        found.append(Mutation(rel, node.lineno, what, names, mutated))  # type: ignore[attr-defined]

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner, name = node.value.id, node.attr
            names = DERIVED.get(name, (name,) if name in options else ())
            function = _in(node, parents, ast.FunctionDef)
            refusal = owner == "self" and getattr(function, "name", "") == "_unsupported"
            if not names or not (owner == "config" or refusal):
                continue
            if _in(node, parents, ast.JoinedStr) is not None:
                continue  # an error message
            parent = parents[node]
            if refusal:  # {"reward": self.reward != ..., ...}: the refusal of an option
                entry = _in(node, parents, ast.Dict)
                if not isinstance(entry, ast.Dict):
                    continue
                key = next(k for k, v in zip(entry.keys, entry.values) if node in ast.walk(v))
                add(node, f"drop the refusal of {ast.unparse(key)}", names,
                    source.drop(*source.span(key, entry.values[entry.keys.index(key)])))  # fmt: skip
            elif isinstance(parent, ast.keyword) and parent.arg is not None:
                add(node, f"drop {parent.arg}={owner}.{name}", names,
                    source.drop(*source.span(parent)))  # fmt: skip
            elif isinstance(parent, ast.Dict) and node in parent.values:
                key = parent.keys[parent.values.index(node)]
                if key is not None:
                    label = ast.unparse(key)
                    add(node, f"drop {label}: {owner}.{name}", names,
                        source.drop(*source.span(key, node)))  # fmt: skip
            else:
                default = f"type({owner})().{name}"
                add(node, f"{owner}.{name} -> {default}", names,
                    source.replace(*source.span(node), default))  # fmt: skip
        elif isinstance(node, ast.Tuple | ast.List) and isinstance(parents[node], ast.Assign):
            target = ast.unparse(parents[node].targets[0])  # type: ignore[attr-defined]
            if rel.startswith("runtime/") and target != "_NAMED_OPTIONS":
                continue
            items = [e for e in node.elts if not isinstance(e, ast.Starred)]
            strings = [e.value for e in items if isinstance(e, ast.Constant)]
            if not items or len(strings) != len(items):
                continue
            if not all(isinstance(s, str) and s in options for s in strings):
                continue
            for element in items:
                value = element.value  # type: ignore[attr-defined]
                add(element, f"drop {value!r} from {target}", (value,),
                    source.drop(*source.span(element)))  # fmt: skip
    return found


def all_mutations(base: Path, options: set[str]) -> list[Mutation]:
    """In the graph modules (those with a ``build_graph``), the helpers that turn their
    options into nodes, and the flags named after options; ``base``: the copy of the tree."""
    files = [
        p
        for p in sorted((base / "graphs").glob("*.py"))
        if p.name in HELPERS or "\ndef build_graph(" in p.read_text()
    ]
    files.append(base / "runtime" / "run.py")
    return [m for path in files for m in mutations_of(path, base, options)]


# --- running the test against each ------------------------------------------------------------


def _warm_up() -> None:
    """Import in this process what every child needs and does not mutate (torch, the nodes,
    transformers' and open_clip's tables), so that each fork starts with it loaded."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import pytest  # noqa: F401
    import torch

    torch.set_num_threads(1)
    from yatt_graph.refs import load_graph

    for name in ("mm_ppo", "mm_grpo", "text_agent", "mm_agent"):
        load_graph(f"graphs.{name}")
    import nodes.models.families  # noqa: F401
    import nodes.rewards  # noqa: F401


def _child(copy: Path, log: Path, verbose: bool) -> None:
    """In the forked child: import graphs/ and runtime/ from ``copy``, run the test, exit
    with pytest's code (98: the modules did not come from the copy)."""
    code = 99
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sys.dont_write_bytecode = True
        for name in list(sys.modules):
            if name.partition(".")[0] in PACKAGES:
                del sys.modules[name]
        sys.path.insert(0, str(copy))
        importlib.invalidate_caches()
        import pytest

        for package in PACKAGES:
            module = importlib.import_module(package)
            if Path(module.__file__).parent.parent != copy:
                os._exit(98)
        args = [str(TEST), "-x", "-p", "no:cacheprovider", "-p", "no:xdist"]
        code = int(pytest.main([*args, "-q"] if not verbose else args))
        if not Path(sys.modules["graphs.common"].__file__).is_relative_to(copy):
            code = 98
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _start(worker: Worker, mutation: Mutation | None, verbose: bool) -> None:
    if mutation is not None:
        target = worker.copy / mutation.path
        worker.originals[mutation.path] = target.read_bytes()
        target.write_bytes(mutation.source)
    log = worker.copy / "test.log"
    pid = os.fork()
    if pid == 0:
        _child(worker.copy, log, verbose)
    worker.pid, worker.mutation, worker.started = pid, mutation, time.monotonic()


def _finish(worker: Worker, status: int) -> tuple[int, str]:
    """The child's exit code and log; the copy restored."""
    for path, data in worker.originals.items():
        (worker.copy / path).write_bytes(data)
    worker.originals.clear()
    log = (worker.copy / "test.log").read_text(errors="replace")
    worker.pid = 0
    code = os.waitstatus_to_exitcode(status)
    return code, log


def _stop(worker: Worker) -> None:
    if worker.pid:
        try:
            os.kill(worker.pid, signal.SIGKILL)
            os.waitpid(worker.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        worker.pid = 0
    for path, data in worker.originals.items():
        (worker.copy / path).write_bytes(data)
    worker.originals.clear()


def _first_failure(log: str) -> str:
    """The test that failed and the first line of why, from pytest's output."""
    test = next((ln[7:].split(" - ")[0] for ln in log.splitlines() if ln.startswith("FAILED ")),
                "?")  # fmt: skip
    why = [ln[1:].strip() for ln in log.splitlines() if ln.startswith("E ")][:2]
    if why and not why[0].endswith(":"):  # (a list's heading is followed by its first item)
        why = why[:1]
    return f"{test.rpartition('::')[2]}: {' '.join(why)[:160]}"


def _outcome(code: int) -> str:
    return {0: "survived", 1: "caught"}.get(code, "error")


def run(workers: list[Worker], mutations: list[Mutation], verbose: bool) -> int:
    """The test on the unmutated copy, then on each mutation, ``len(workers)`` at a time."""
    _warm_up()
    print("baseline: the test on the unmutated copy ...", flush=True)
    _start(workers[0], None, verbose)
    _, status = os.waitpid(workers[0].pid, 0)
    code, log = _finish(workers[0], status)
    if code != 0:
        print(log[-6000:])
        print(f"baseline: the test fails without any mutation (exit {code}); fix it first")
        return 2
    print(f"baseline passed; {len(mutations)} mutations, {len(workers)} at a time", flush=True)
    waiting, done = list(mutations), 0
    mark = {"caught": "caught  ", "survived": "SURVIVED", "error": "ERROR   "}
    while waiting or any(w.pid for w in workers):
        for worker in workers:
            if not worker.pid and waiting:
                _start(worker, waiting.pop(0), verbose)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            for worker in workers:
                if worker.pid and time.monotonic() - worker.started > TIMEOUT_S:
                    os.kill(worker.pid, signal.SIGKILL)
            time.sleep(0.05)
            continue
        worker = next(w for w in workers if w.pid == pid)
        mutation = worker.mutation
        code, log = _finish(worker, status)
        assert mutation is not None
        mutation.outcome, mutation.log = _outcome(code), log
        done += 1
        print(f"[{done:3}/{len(mutations)}] {mark[mutation.outcome]} {mutation.path}:"
              f"{mutation.line}: {mutation.what}", flush=True)  # fmt: skip
        if mutation.outcome == "caught":
            print(f"      {_first_failure(log)}", flush=True)
        if mutation.outcome == "error":
            print(f"    exit {code}; the end of its log:\n{log[-3000:]}", flush=True)
    return summary(mutations)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def summary(mutations: list[Mutation]) -> int:
    by_option: dict[str, list[Mutation]] = {}
    for m in mutations:
        for name in m.options:
            by_option.setdefault(name, []).append(m)
    print("\nper option (caught / mutations):")
    for name in sorted(by_option):
        ms = by_option[name]
        caught = sum(m.outcome == "caught" for m in ms)
        print(f"  {name:24} {caught}/{len(ms)}" + ("" if caught == len(ms) else "  <--"))
    survived = [m for m in mutations if m.outcome == "survived"]
    errors = [m for m in mutations if m.outcome == "error"]
    caught = len(mutations) - len(survived) - len(errors)
    print(f"\n{caught} of {len(mutations)} mutations caught, {len(survived)} survived, "
          f"{len(errors)} errors")  # fmt: skip
    for m in survived:
        print(f"  survived: {m.path}:{m.line}: {m.what}")
    for m in errors:
        print(f"  error:    {m.path}:{m.line}: {m.what}")
    return 1 if survived else 2 if errors else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", metavar="OPTION", help="only mutations of these")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="mutations run at once")
    parser.add_argument("-l", "--list", action="store_true", help="list the mutations, run none")
    parser.add_argument("-v", "--verbose", action="store_true", help="pytest's full output")
    args = parser.parse_args(argv)
    options = option_names()
    scratch = Path(tempfile.mkdtemp(prefix="yatt-mutate-"))
    workers: list[Worker] = []
    for signum in (signal.SIGINT, signal.SIGTERM):  # (SIGINT too where it came in ignored)
        signal.signal(signum, _interrupt)
    try:
        for i in range(max(1, args.jobs)):  # a copy of graphs/ and runtime/ for each
            copy = scratch / f"copy{i}"
            for package in PACKAGES:
                shutil.copytree(ROOT / package, copy / package,
                                ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
            workers.append(Worker(copy))
        mutations = all_mutations(workers[0].copy, options)
        if args.only:
            unknown = sorted(set(args.only) - options)
            if unknown:
                parser.error(f"not options of the ready graphs: {unknown}")
            mutations = [m for m in mutations if set(m.options) & set(args.only)]
        if args.list:
            for m in mutations:
                print(f"{m.path}:{m.line}: {m.what}  [{', '.join(m.options)}]")
            return 0
        untouched = sorted(options - {n for m in mutations for n in m.options})
        if untouched and not args.only:
            print(f"options no mutation reaches (handed on elsewhere): {', '.join(untouched)}")
        return run(workers, mutations, args.verbose)
    except KeyboardInterrupt:
        print("\nstopped; nothing in the working tree was changed", flush=True)
        return 130
    finally:
        for worker in workers:
            _stop(worker)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
