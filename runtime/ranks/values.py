"""A call's values on the way to the ranks: JSON header entries plus tensors to broadcast.

An entry is ``[name, "none"]``, ``[name, "tensor", dtype, shape]`` or ``[name, "images",
[[mode, shape], ...]]``. A PIL image travels as a uint8 array plus its mode (RGB, L or RGBA;
any other mode is sent as RGB). Nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["describe", "rebuild", "shapes"]

_IMAGE_MODES = ("RGB", "L", "RGBA")


def describe(values: Mapping[str, Any], where: str) -> tuple[list[Any], list[torch.Tensor]]:
    """The header entries and the tensors (in broadcast order) of a call's values."""
    entries: list[Any] = []
    tensors: list[torch.Tensor] = []
    for name, value in values.items():
        if value is None:
            entries.append([name, "none"])
        elif isinstance(value, torch.Tensor):
            entries.append(
                [name, "tensor", str(value.dtype).removeprefix("torch."), [*value.shape]]
            )
            tensors.append(value.detach())
        elif isinstance(value, list | tuple) and all(hasattr(v, "mode") for v in value):
            import numpy as np

            images = []
            for im in value:
                mode = im.mode if im.mode in _IMAGE_MODES else "RGB"
                array = torch.from_numpy(np.array(im.convert(mode)))
                images.append([mode, [*array.shape]])
                tensors.append(array)
            entries.append([name, "images", images])
        else:
            raise ValueError(
                f"{where}: input {name!r} is a {type(value).__name__}; a rank group sends "
                "tensors, None and lists of PIL images to its ranks"
            )
    return entries, tensors


def rebuild(entries: list[Any], tensors: Iterator[torch.Tensor]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for entry in entries:
        name, kind = entry[0], entry[1]
        if kind == "none":
            values[name] = None
        elif kind == "tensor":
            values[name] = next(tensors)
        else:
            from PIL import Image

            values[name] = [Image.fromarray(next(tensors).numpy()).convert(m) for m, _ in entry[2]]
    return values


def shapes(entries: list[Any]) -> list[tuple[str, list[int]]]:
    """(dtype, shape) of each tensor an entry list announces, in broadcast order."""
    out: list[tuple[str, list[int]]] = []
    for entry in entries:
        if entry[1] == "tensor":
            out.append((entry[2], entry[3]))
        elif entry[1] == "images":
            out.extend(("uint8", shape) for _, shape in entry[2])
    return out
