"""Registries: the named extension points of the node library.

An advantage estimator, a KL estimator, a loss aggregation or a reward kind registers under a
name with a decorator and is found by that name; the nodes check their options against the
registry, and the ready graphs' configs take their choices from it (so ``yatt-graph show
GRAPH --options`` lists what is registered). Adding one is the decorated function and its test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, Literal, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Names to entries of one kind (``what``: how an error names them), in registration order."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: dict[str, T] = {}
        self._help: dict[str, str] = {}

    def register(self, name: str, help: str = "") -> Callable[[T], T]:
        """A decorator that registers its function (or class) as ``name``; ``help``: one line
        for listings (default: the first line of its docstring)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.what} needs a non-empty name, got {name!r}")

        def add(entry: T) -> T:
            if name in self._entries and self._entries[name] is not entry:
                raise ValueError(f"{self.what} {name!r} is registered already")
            self._entries[name] = entry
            doc = (getattr(entry, "__doc__", None) or "").strip().split("\n")[0]
            self._help[name] = help or doc
            return entry

        return add

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(self.refusal(name)) from None

    def check(self, name: Any, where: str) -> str:
        """``name`` when registered, else a ValueError naming ``where`` (the option: ``node
        'x': estimator``), the value and the choices."""
        if not isinstance(name, str) or name not in self._entries:
            raise ValueError(
                f"{where} is {name!r}: not a registered {self.what}; choose one of {', '.join(self)}"
            )
        return name

    def refusal(self, name: Any) -> str:
        return f"{self.what} {name!r} is not registered; choose one of {', '.join(self)}"

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def help(self, name: str) -> str:
        """The one-line description of ``name``."""
        return self._help[self.check(name, self.what)]

    def literal(self) -> Any:
        """``Literal[...]`` of the names registered so far: the type of a config field that
        names one (a text option is parsed against it, and listings show the choices)."""
        return Literal[tuple(self._entries)]  # type: ignore[valid-type]
