"""The range and choice checks of the ready graphs' options: each refusal names the option,
the value and what is allowed (``option lr=-0.001: must be a finite number > 0``)."""

from __future__ import annotations

import math
import typing
from typing import Any

import msgspec

__all__ = ["at_least", "check_choices", "positive", "refuse", "within"]


def refuse(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"option {name}={value!r}: must be {allowed}")


def at_least(name: str, value: float, low: float) -> None:
    if not (value >= low and math.isfinite(value)):  # also refuses NaN
        refuse(name, value, f">= {low}" if isinstance(value, int) else f"a finite number >= {low}")


def positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        refuse(name, value, "a finite number > 0")


def within(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        refuse(name, value, f"in [{low}, {high}]")


def check_choices(config: msgspec.Struct) -> None:
    """Refuse a value outside its field's ``Literal`` choices (a Struct made in code is not
    checked against its types as a decoded one is)."""
    for field in msgspec.structs.fields(config):
        if typing.get_origin(field.type) is typing.Literal:
            value = getattr(config, field.name)
            if value not in typing.get_args(field.type):
                choices = ", ".join(str(c) for c in typing.get_args(field.type))
                refuse(field.name, value, f"one of {choices}")
