"""The options a graph module's ``build_graph(**options)`` takes: names, types, defaults, docs.

A module may name the msgspec Struct its ``build_graph`` builds from the options as
``CONFIG`` (the ready graphs do, see ``graphs/config.py``); the options are its fields, each
documented by the string under it. Without one, they come from ``build_graph``'s signature:
the annotation, else the default's type; a parameter with neither takes any value.

Text values (``yatt-graph run ... --set key=value``) are parsed by the option's type:
booleans from ``true/false/yes/no/on/off/1/0``, numbers refuse what is not one, and an
unknown key or a value of the wrong type is refused naming the key, the value, the type and
the valid options. Python values are checked the same way, without parsing.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import sys
import textwrap
import traceback
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from yatt_graph.refs import load_module, module_file

__all__ = [
    "REQUIRED",
    "Option",
    "UnknownOptionError",
    "build_config",
    "check_config",
    "check_options",
    "config_options",
    "did_you_mean",
    "field_docs",
    "format_options",
    "graph_file",
    "load_graph_module",
    "located",
    "module_options",
    "nearest",
    "option_table",
    "unknown_keywords",
    "parse_options",
    "signature_options",
]

REQUIRED: Any = inspect.Parameter.empty
"""The default of an option that has none."""

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


class Option(msgspec.Struct, frozen=True):
    """One option of a graph's ``build_graph``."""

    name: str
    type: Any
    """The declared type; ``typing.Any`` when the option declares none."""
    default: Any = REQUIRED
    doc: str = ""
    """The first line of the option's docstring, or empty."""

    @property
    def label(self) -> str:
        return type_label(self.type)


def type_label(tp: Any) -> str:
    """``int``, ``raise|skip`` (a Literal), ``str | dict``, ``any``: how a type reads in a message."""
    if tp is Any:
        return "any"
    if typing.get_origin(tp) is typing.Literal:
        return "|".join(str(v) for v in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(type_label(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    origin = typing.get_origin(tp)
    return getattr(origin or tp, "__name__", str(tp))


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated attribute of ``cls`` and its bases, by name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body
        if not body or not isinstance(body[0], ast.ClassDef):
            continue
        stmts = body[0].body
        for stmt, after in zip(stmts, stmts[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def config_options(config: type[msgspec.Struct]) -> list[Option]:
    """The fields of a msgspec Struct as options, with their docstrings' first lines."""
    docs = field_docs(config)
    options = []
    for f in msgspec.structs.fields(config):
        default = f.default if f.default is not msgspec.NODEFAULT else REQUIRED
        if f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        options.append(Option(f.name, f.type, default, docs.get(f.name, "").split("\n")[0]))
    return options


def signature_options(build: Callable[..., Any]) -> tuple[list[Option], bool]:
    """The named parameters of ``build`` as options, and whether it takes ``**kwargs`` too."""
    try:
        sig = inspect.signature(build, eval_str=True)
    except (NameError, TypeError, SyntaxError):  # an annotation that does not evaluate
        sig = inspect.signature(build)
    options, more = [], False
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            more = True
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        tp = p.annotation
        if tp is p.empty or isinstance(tp, str):
            simple = (bool, int, float, str)
            tp = type(p.default) if type(p.default) in simple else Any
        options.append(Option(p.name, tp, p.default))  # p.empty is REQUIRED
    return options, more


def _typed_config(module: Any) -> type[msgspec.Struct] | None:
    config = getattr(module, "CONFIG", None)
    return config if isinstance(config, type) and issubclass(config, msgspec.Struct) else None


def module_options(module: Any) -> tuple[list[Option], bool]:
    """A graph module's options (its ``CONFIG`` Struct, else ``build_graph``'s signature) and
    whether it takes other keys too. A module with no ``build_graph`` takes no options."""
    config = _typed_config(module)
    if config is not None:
        return config_options(config), False
    build = getattr(module, "build_graph", None)
    return signature_options(build) if callable(build) else ([], False)


def build_config(config: type[Any], values: Mapping[str, Any], where: str) -> Any:
    """``config(**values)`` (values checked already), its range and choice checks' ValueError
    naming ``where``."""
    try:
        return config(**values)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def check_config(module: Any, values: Mapping[str, Any], where: str) -> None:
    """Build the module's ``CONFIG`` from ``values`` (:func:`build_config`) to run its checks;
    nothing when the module has no typed config."""
    config = _typed_config(module)
    if config is not None:
        build_config(config, values, where)


def format_options(options: list[Option]) -> str:
    """``batch_size (int), lr (float), ...``"""
    return ", ".join(f"{o.name} ({o.label})" for o in options) or "none"


def nearest(name: str, known: list[str], docs: Mapping[str, str] | None = None) -> list[str]:
    """The names in ``known`` that ``name`` was likely meant to be, best first (at most 3): the
    closest spellings (``batch_sise``: ``batch_size``), else those holding each of its words
    (``kl``: ``kl_coef``, ``kl_estimator``), else those whose doc in ``docs`` says its words
    (``learning_rate``: ``lr``, whose doc says "learning rate", as does a slip such as
    ``lerning_rate``); empty if none."""
    import difflib

    scored = sorted(
        ((difflib.SequenceMatcher(None, name, k).ratio(), k) for k in known), reverse=True
    )
    close = [k for r, k in scored if r >= 0.6 and r >= scored[0][0] - 0.1]
    if close:
        return close[:3]
    words = [w for w in name.lower().split("_") if w]
    parts = [k for k in known if words and all(w in k.split("_") for w in words)]
    if parts:
        return parts[:3]
    phrase, n = " ".join(words), len(words)

    def says(doc: str) -> bool:  # the phrase, or one spelled a letter or two apart
        said = re.findall(r"[a-z0-9]+", doc.lower())
        spans = (" ".join(said[i : i + n]) for i in range(len(said) - n + 1))
        return any(difflib.SequenceMatcher(None, phrase, span).ratio() >= 0.85 for span in spans)

    return [k for k in known if words and says((docs or {}).get(k, ""))][:3]


def did_you_mean(near: list[str]) -> str:
    """`` (did you mean 'a'?)``, `` (did you mean 'a' or 'b'?)``; empty for no name."""
    if not near:
        return ""
    names = [repr(n) for n in near]
    said = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return f" (did you mean {said}?)"


class UnknownOptionError(TypeError):
    """A key that no option of a graph has. It keeps the ``key``, the graph (``where``), its
    ``options`` and the ``near`` ones, so that a caller can word it for how the key was given
    (``yatt-graph`` names the flag and ``show --options``); the message lists the options."""

    def __init__(self, key: str, where: str, options: list[Option]):
        self.key, self.where, self.options = key, where, list(options)
        self.near = nearest(key, [o.name for o in options], {o.name: o.doc for o in options})
        super().__init__(
            f"unknown option {key!r} for {where}{did_you_mean(self.near)}; "
            f"valid: {format_options(options)}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.key, self.where, self.options)


def unknown_keywords(
    cls: type, unknown: Mapping[str, Any], shared: Sequence[Callable[..., Any]] = ()
) -> TypeError:
    """The TypeError for keywords no ``__init__`` of ``cls`` (or of its bases) takes, named
    for ``cls`` with the nearest known keywords: for a class whose ``__init__`` comes from a
    shared base that takes ``**unknown`` to say so. ``shared``: functions ``cls.__init__``
    passes its other keywords to (theirs are known too, read after its own)."""
    inits = [klass.__init__ for klass in cls.__mro__ if "__init__" in vars(klass)]
    known = [
        p.name
        for init in (*inits[:1], *shared, *inits[1:])
        for p in inspect.signature(init).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
    ]
    parts = [f"{name!r}{did_you_mean(nearest(name, known))}" for name in sorted(unknown)]
    return TypeError(f"{cls.__name__}() got an unexpected keyword argument {', '.join(parts)}")


def _parse(option: Option, text: str) -> Any:
    """The value ``text`` stands for, as the option's type; ValueError if it is none."""
    tp = option.type
    if tp is bool:
        word = text.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise ValueError(text)
    if tp is str:
        return text
    if type(None) in typing.get_args(tp) and text.strip().lower() in ("none", "null"):
        return None
    for kind in (tp, *typing.get_args(tp)):  # what Python's int() and float() accept
        if kind in (int, float):  # ("1_000", ".5", "+3", "2e-5"), before JSON's narrower rules
            try:
                return kind(text)
            except ValueError:
                break
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    if tp is Any:
        return value
    try:  # a JSON value of the declared type (3 for a float, {...} for a dict) ...
        return msgspec.convert(value, tp)
    except msgspec.ValidationError:
        pass
    try:  # ... or the text read as that type ("3" for an int, 'raise' for a Literal)
        return msgspec.convert(text, tp, strict=False)
    except msgspec.ValidationError:
        raise ValueError(text) from None


def parse_options(
    pairs: Mapping[str, str], options: list[Option], more: bool, where: str
) -> dict[str, Any]:
    """Text values (``--set key=value``) parsed by each option's type; TypeError naming the
    key, the value and the type for a value of the wrong type; :class:`UnknownOptionError` (a
    TypeError) for an unknown key."""
    return _convert_all(pairs, options, more, where, _parse)


def check_options(
    values: Mapping[str, Any], options: list[Option], more: bool, where: str
) -> dict[str, Any]:
    """Python values checked against the options' types (ints pass as floats); TypeError
    naming the key, the value and the type for an unknown key or a wrong type."""

    def convert(option: Option, value: Any) -> Any:
        return value if option.type is Any else msgspec.convert(value, option.type)

    return _convert_all(values, options, more, where, convert)


def _convert_all(
    values: Mapping[str, Any],
    options: list[Option],
    more: bool,
    where: str,
    convert: Callable[[Option, Any], Any],
) -> dict[str, Any]:
    """Each value through ``convert(option, value)``; an unknown key (unless ``more``: the
    graph takes ``**options``) is a TypeError listing the options, a value ``convert`` refuses
    one naming the option's type."""
    by_name = {o.name: o for o in options}
    converted: dict[str, Any] = {}
    for key, value in values.items():
        option = by_name.get(key, Option(key, Any) if more else None)
        if option is None:
            raise UnknownOptionError(key, where, options)
        try:
            converted[key] = convert(option, value)
        except (ValueError, msgspec.ValidationError):
            raise TypeError(
                f"option {option.name!r} of {where}: {value!r} is not {option.label}"
            ) from None
    return converted


def graph_file(target: str) -> Path | None:
    """The file a graph reference (``graphs/toy.py`` or ``graphs.toy``) names, if any."""
    if target.endswith(".py") or Path(target).exists():
        return Path(target).resolve()
    return module_file(target)


def located(target: str, exc: BaseException) -> str | None:
    """``file:line (code): Type: message`` for the innermost place in the graph file of
    ``target`` that ``exc`` (or an exception it came from) passed through; None if none did."""
    path = graph_file(target)
    if path is None:
        return None
    chain: list[BaseException] = []
    err: BaseException | None = exc
    while err is not None and err not in chain:
        chain.append(err)
        err = err.__cause__ or err.__context__
    for err in chain:
        frames = traceback.extract_tb(err.__traceback__)
        inside = [f for f in frames if Path(f.filename).resolve() == path]
        if inside:
            at = f"{_shown(path)}:{inside[-1].lineno} ({inside[-1].line})"
            last = frames[-1]
            if Path(last.filename).resolve() != path and not _installed(last.filename):
                at += f", raised at {_shown(Path(last.filename))}:{last.lineno}"
            return f"{at}: {type(err).__name__}: {err}"
        if isinstance(err, SyntaxError) and err.filename and Path(err.filename).resolve() == path:
            return f"{_shown(path)}:{err.lineno}: SyntaxError: {err.msg}"
    return None


def reference_problem(ref: str) -> str | None:
    """What is wrong with a user's reference (``file.py:name``, ``module:name``) that failed
    to resolve: its file is not there (from which folder), its file failed to import (where
    in it: :func:`located`), or it has no such name (what it defines); None where none of
    these is the case (no such module: the caller says what it takes)."""
    module_ref, _, name = ref.rpartition(":")
    if not module_ref:
        return None
    try:
        module = load_module(module_ref)
    except FileNotFoundError as missing:
        return f"{missing} (relative paths are from the folder the run starts in, {Path.cwd()})"
    except ImportError as failed:
        return located(module_ref, failed)
    except Exception:
        return None
    first = name.split(".")[0]
    if hasattr(module, first):
        return None
    defined = sorted(
        key
        for key, obj in vars(module).items()
        if callable(obj) and not key.startswith("_")
        and getattr(obj, "__module__", None) == module.__name__
    )  # fmt: skip
    return (
        f"{module_ref} has no {first!r}; what it defines to call: {', '.join(defined) or 'nothing'}"
    )


def load_graph_module(target: str) -> Any:
    """:func:`yatt_graph.refs.load_module`, with an import error located in the graph's file."""
    try:
        return load_module(target)
    except ImportError as exc:
        where = located(target, exc)
        if where is None:
            raise
        raise ImportError(f"importing {target} failed at {where}") from exc


def option_table(
    options: list[Option],
    more: bool,
    here: Mapping[str, Any] | None = None,
    hidden: Mapping[str, str] | None = None,
) -> str:
    """One line an option: name, type, default and the first line of its docstring. With
    ``here`` (option -> its value with the flags given), a default that resolves to another
    value reads ``None -> value``; options in ``hidden`` (option -> what would make it matter)
    are left out and listed after."""
    here, hidden = here or {}, hidden or {}

    def default(o: Option) -> str:
        if o.default is REQUIRED:
            return "(required)"
        value = here.get(o.name, o.default)
        return repr(o.default) + ("" if value == o.default else f" -> {value!r}")

    rows = [(o.name, o.label, default(o), o.doc) for o in options if o.name not in hidden]
    widths = [max([len(r[i]) for r in rows] + [1]) for i in range(3)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r[:3], widths)) + ("  " + r[3] if r[3] else "")
        for r in rows
    ]
    if more:
        lines.append("(other keys are passed through: build_graph takes **kwargs)")
    needs: dict[str, list[str]] = {}
    for name, need in hidden.items():
        needs.setdefault(need, []).append(name)
    if needs:
        said = "; ".join(f"{', '.join(names)} (with {need})" for need, names in needs.items())
        lines.append(f"not shown, as they do nothing here: {said}; --all shows them")
    return "\n".join(line.rstrip() for line in lines) if lines else "(no options)"


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _installed(filename: str) -> bool:
    """Whether a file belongs to Python or an installed package (not worth naming to a user)."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return "site-packages" in filename or any(filename.startswith(r) for r in roots)
