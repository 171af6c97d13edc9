"""Importable references ("module:qualname") to classes, functions and node objects."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

__all__ = ["import_ref", "import_roots", "load_graph", "load_module", "module_file", "ref_of"]


def ref_of(obj: Any) -> str:
    """``"module:qualname"``; for an object of a script run as ``python path/file.py`` (module
    ``__main__``), ``"/abs/path/file.py:qualname"``, which another process imports by path."""
    module = obj.__module__
    if module == "__main__":
        path = getattr(sys.modules.get("__main__"), "__file__", None)
        if path:
            return f"{Path(path).resolve()}:{obj.__qualname__}"
    return f"{module}:{obj.__qualname__}"


def import_roots() -> list[str]:
    """Folders another process needs on its ``sys.path`` to import the modules loaded here from
    files outside this process's ``sys.path`` (a graph file named by path, and what it imports
    from its own folder)."""
    here = {str(Path(p or ".").resolve()) for p in sys.path}
    roots: dict[str, None] = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or name == "__main__" or not path.endswith(".py"):
            continue
        if not Path(path).is_absolute():  # (torch.ops says "_ops.py": no folder to add)
            continue
        file = Path(path).resolve()
        root = file.parent
        depth = name.count(".") + (file.name == "__init__.py")
        for _ in range(depth):
            root = root.parent
        parts = name.split(".")
        leads_back = file in (
            root.joinpath(*parts).with_suffix(".py"),
            root.joinpath(*parts, "__init__.py"),
        )  # the name is the module's path under the root (not an alias of another module)
        if leads_back and str(root) not in here and "site-packages" not in root.parts:
            roots[str(root)] = None
    return list(roots)


def import_ref(ref: str) -> Any:
    """Import ``"package.module:Attr.sub"`` or ``"path/to/file.py:name"``.

    Errors name the reference and what failed.
    """
    module_name, sep, qualname = ref.rpartition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(
            f"reference {ref!r} must look like 'package.module:name' or 'path/to/file.py:name'"
        )
    if module_name.endswith(".py"):  # a file the user named: imported from that path only
        obj: Any = load_module(module_name)
    else:
        try:
            obj = importlib.import_module(module_name)
        except ImportError as exc:
            raise ImportError(
                f"cannot import module {module_name!r} for reference {ref!r}: {exc}"
            ) from exc
    for part in qualname.split("."):
        if part == "<locals>" or not hasattr(obj, part):
            raise ImportError(
                f"reference {ref!r}: {part!r} is not an attribute of {obj!r}; "
                "nodes must be defined at module level to be rebuilt from a plan"
            )
        obj = getattr(obj, part)
    return obj


def load_module(target: str) -> Any:
    """Import a module by dotted name or a Python file by path; import errors name the file."""
    path = Path(target)
    if target.endswith(".py") or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"Python file {target!r} does not exist")
        # A file inside the project (graphs/toy.py) imports as its dotted module, so that
        # node references point at importable names rather than at a throwaway module.
        resolved = path.resolve()
        for root in map(Path, sys.path or ["."]):
            try:
                rel = resolved.relative_to((root or Path(".")).resolve())
            except ValueError:
                continue
            parts = rel.with_suffix("").parts
            if parts and all(part.isidentifier() for part in parts):
                dotted = ".".join(parts)
                if module_file(dotted) == resolved:  # the name must lead back to this very file
                    return _import(dotted, target)
        name = path.stem
        stat = resolved.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
        known = sys.modules.get(name)
        if getattr(known, "__file__", None) == str(resolved) and (
            getattr(known, "__yatt_stamp__", None) == stamp
        ):
            return known  # imported once per process (again only once the file changes)
        spec = importlib.util.spec_from_file_location(name, resolved)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {target!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        module.__yatt_stamp__ = stamp  # type: ignore[attr-defined]
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            raise ImportError(f"importing {target!r} failed: {type(exc).__name__}: {exc}") from exc
        return module
    return _import(target, target)


def module_file(dotted: str) -> Path | None:
    """The file a dotted module name would import, or None if it names no module here."""
    try:
        spec = importlib.util.find_spec(dotted)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin).resolve() if spec is not None and spec.origin else None


def _import(dotted: str, shown: str) -> Any:
    try:
        return importlib.import_module(dotted)
    except Exception as exc:
        raise ImportError(f"importing {shown!r} failed: {type(exc).__name__}: {exc}") from exc


def load_graph(target: str, **kwargs: Any) -> Any:
    """The graph a module or file declares: its ``build_graph(**kwargs)``, else its ``graph``."""
    from yatt_graph.graph import Graph

    module = load_module(target)
    build = getattr(module, "build_graph", None)
    if callable(build):
        graph = build(**kwargs)
    else:
        graph = getattr(module, "graph", None)
        if graph is None:
            graph = next((v for v in vars(module).values() if isinstance(v, Graph)), None)
        if kwargs and graph is not None:
            raise TypeError(
                f"{target!r} defines a graph object, not build_graph(); it takes no options"
            )
    if build is not None and not callable(build):
        raise ValueError(
            f"{target!r}: build_graph is a {type(build).__name__}, not a function; define "
            "build_graph(**options) -> Graph"
        )
    if callable(build) and not isinstance(graph, Graph):
        raise ValueError(
            f"{target!r}: build_graph() returned {type(graph).__name__} {graph!r:.60}, not a "
            "Graph; return the Graph it builds (with Graph(...) as g: ...; return g)"
        )
    if not isinstance(graph, Graph):
        raise ValueError(
            f"{target!r} declares no graph: define build_graph(**options) -> Graph, or a module-level Graph"
        )
    return graph
