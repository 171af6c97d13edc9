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
    "advantage", "data", "reference", "rewards", "rollout", "rollout_steps", "sync", "toy", "update", "vision",
)  # fmt: skip
"""The node modules, which nodes/rl and nodes/models may not import."""
_ENGINE_UP = ("runtime.zmq", "runtime.train", "runtime.cli", "runtime.run_setup", "runtime.run_executor",
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
        "runtime.run_setup",
        "runtime.run_executor",
        "zmq",
    },
    "runtime/zmq": {"runtime.train", "runtime.cli", "runtime.run_setup", "runtime.run_executor"},
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
        "import torch\nfrom runtime.engine.local import LocalExecutor\nfrom . import sibling\n"
    )
    assert imports_of(bad) == {"torch", "runtime"}


@pytest.mark.timeout(60)
def test_importing_the_core_loads_neither_torch_nor_zmq():
    code = "import sys, yatt_graph, yatt_graph.render, yatt_graph.serialize; print(sorted(m for m in ('torch', 'zmq') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"
