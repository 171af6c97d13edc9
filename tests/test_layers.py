"""The one-way rule: graphs -> nodes -> yatt_graph <- runtime, and the folders inside nodes/ and
runtime/ (see docs/ARCHITECTURE.md)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "yatt_graph": {"torch", "zmq", "nodes", "graphs", "runtime"},
    "nodes": {"zmq", "runtime", "graphs"},
    "graphs": {"runtime", "zmq"},
    "runtime": {"nodes", "graphs"},
}
# Inside a package, by folder (module prefixes, matched on whole dotted parts):
# rl <- models <- the node modules; codec <- ranks, zmq; sched <- engine <- zmq, engine <- train.
NODE_MODULES = (
    "advantage", "data", "reference", "rewards", "rollout", "sync", "toy", "update", "vision",
)  # fmt: skip
"""The node modules, which nodes/rl and nodes/models may not import."""
_ENGINE_UP = ("runtime.zmq", "runtime.train", "runtime.cli", "runtime.run", "runtime.run",
              "zmq")  # fmt: skip
"""What sits above the step engine: no folder at or below it imports these."""
FORBIDDEN_INSIDE = {
    "nodes/rl": {"nodes.models", *(f"nodes.{m}" for m in NODE_MODULES)},
    "nodes/models": {f"nodes.{m}" for m in NODE_MODULES},
    "runtime/codec": {"runtime.ranks", "runtime.sched", "runtime.engine", *_ENGINE_UP},
    "runtime/ranks": {"runtime.sched", "runtime.engine", *_ENGINE_UP},
    "runtime/sched": {"runtime.ranks", "runtime.engine", *_ENGINE_UP},
    "runtime/engine": set(_ENGINE_UP),
    "runtime/train": {
        "runtime.zmq",
        "runtime.cli",
        "runtime.run",
        "zmq",
    },
    "runtime/zmq": {"runtime.train", "runtime.cli", "runtime.run"},
}


def modules_imported(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in the file names, dotted."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def imports_of(path: Path) -> set[str]:
    """The top-level packages the file imports."""
    return {name.split(".")[0] for name in modules_imported(path)}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in sorted(imports_of(path) & FORBIDDEN[package]):
            bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "layer rule broken:\n" + "\n".join(bad)


@pytest.mark.parametrize("folder", sorted(FORBIDDEN_INSIDE))
def test_no_forbidden_imports_between_folders(folder):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in sorted(modules_imported(path)):
            hit = [p for p in FORBIDDEN_INSIDE[folder] if _under(name, p)]
            if hit:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "layer rule broken:\n" + "\n".join(bad)


PROCESS_MODULES = ("subprocess", "multiprocessing", "torch.distributed", "zmq")
"""What starts processes, forms process groups or opens sockets: the runtime's, never a node's."""


def test_nodes_are_pure_compute():
    """Nothing in nodes/ starts a process, forms a torch.distributed group or opens a socket:
    how a node runs (split, replicated, as K ranks) is the runtime's job."""
    bad = {
        str(path.relative_to(ROOT)): hits
        for path in sorted((ROOT / "nodes").rglob("*.py"))
        if (
            hits := sorted(
                n for n in modules_imported(path) if any(_under(n, p) for p in PROCESS_MODULES)
            )
        )
    }
    assert not bad, f"nodes/ imports process or group modules: {bad}"


def test_the_checker_sees_a_forbidden_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\nfrom runtime.engine.engine import LocalExecutor\nfrom . import sibling\n"
    )
    assert imports_of(bad) == {"torch", "runtime"}


@pytest.mark.timeout(60)
def test_importing_the_core_loads_neither_torch_nor_zmq():
    code = "import sys, yatt_graph, yatt_graph.render, yatt_graph.serialize; print(sorted(m for m in ('torch', 'zmq') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"


PACKAGES = ("graphs", "nodes", "runtime", "yatt_graph")
GRAPH_CORE = "yatt_graph"
"""The graph core's facade methods (``Graph.to_json``, ``Graph.plan``, ``Graph.draw``) import
the modules that serialize, plan and draw lazily, and those import the graph: the one place
where files of the project import each other."""


def _module_names() -> dict[str, Path]:
    names = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph(names: dict[str, Path]):
    """Module -> the project modules it imports anywhere in its file (inside functions and
    ``if TYPE_CHECKING:`` too); ``from package import module`` is an edge to the module."""
    import networkx as nx

    graph = nx.DiGraph()
    for name, path in names.items():
        graph.add_node(name)
        for imported in modules_imported(path):
            if imported in names and imported != name:
                graph.add_edge(name, imported)
    return graph


def import_cycles(names: dict[str, Path]) -> list[list[str]]:
    import networkx as nx

    graph = import_graph(names)
    for name, path in names.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in names and node.level == 0:
                submodules = [f"{node.module}.{a.name}" for a in node.names]
                if all(s in names for s in submodules) and graph.has_edge(name, node.module):
                    graph.remove_edge(name, node.module)  # a module of the package, not it
    return sorted(
        sorted(c)
        for c in nx.strongly_connected_components(graph)
        if len(c) > 1 and not all(_under(m, GRAPH_CORE) for m in c)
    )


def test_no_import_cycle_between_files():
    """No two files of the project import each other, directly or round a loop, counting lazy
    and type-checking imports: each file can be read knowing only what it imports."""
    assert import_cycles(_module_names()) == []


def test_the_cycle_check_sees_a_lazy_cycle(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from b import g\n")
    (tmp_path / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n"
    )
    assert import_cycles({"a": tmp_path / "a.py", "b": tmp_path / "b.py"}) == [["a", "b"]]


def _own_bases(cls: type) -> list[type]:
    return [b for b in cls.__bases__ if b.__module__.split(".")[0] in PACKAGES]


@pytest.mark.timeout(300)
def test_no_class_is_made_of_four_of_the_projects_classes():
    """A class holds what it owns (composition): none inherits from four or more of the
    project's own classes, whose methods would call each other across files."""
    import importlib
    import inspect

    wide = []
    for name in _module_names():
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # an optional dependency (vllm, open_clip) absent here
            if exc.name and exc.name.split(".")[0] in PACKAGES:
                raise
            continue
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name and len(_own_bases(cls)) >= 4:
                wide.append(f"{name}.{cls_name}({', '.join(b.__name__ for b in _own_bases(cls))})")
    assert wide == []


@pytest.mark.timeout(600)
def test_the_run_path_crosses_few_files(tmp_path):
    """``yatt-graph run mm_ppo`` calls into at most 24 files of runtime/, graphs/ and
    yatt_graph/ before its first node call (bench/run_path.py traces it)."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.run_path", "--files", "--", "run", "mm_ppo", "--steps", "1",
         "--quiet"],
        capture_output=True, text=True, cwd=ROOT, timeout=540,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    *files, summary = out.stdout.strip().splitlines()
    assert summary.startswith(f"{len(files)} files"), out.stdout
    assert 10 < len(files) <= 24, "\n".join(files)
