"""Port types: tensor specs with symbolic shapes, and msgspec Struct types.

Compatibility rule (checked when two ports are connected, and again over the
whole graph by :func:`unify_shapes`):

* A tensor port connects only to a tensor port with the **same dtype** and the
  **same rank**. Each dimension is either a concrete ``int``, a symbol such as
  ``"B"``, or ``"*"`` (any size, never bound). Two ints must be equal; a symbol
  unifies with anything. Symbols are scoped to one node, so ``("B", "T")`` on a
  producer and ``("N", "T")`` on a consumer unify ``B`` with ``N``; a symbol
  bound to two different ints anywhere in the graph is an error.
* A struct port connects to a struct port whose type is the **same class** or a
  base class of the producer's class (a subclass may be passed where its base is
  expected).
* :data:`ANY` accepts anything; use it sparingly (e.g. for images or text lists
  that have no tensor form yet).
"""

from __future__ import annotations

import importlib
from typing import Any

import msgspec

__all__ = [
    "check_value",
    "ANY",
    "AnySpec",
    "Dim",
    "PortSpec",
    "StructSpec",
    "TensorSpec",
    "Tensor",
    "WeightUpdate",
    "compatible",
    "spec_of",
    "DTYPES",
]

Dim = int | str

#: dtype names accepted in tensor specs (torch's names without the ``torch.`` prefix).
DTYPES = frozenset(
    {
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
    }
)


class TensorSpec(msgspec.Struct, frozen=True, tag="tensor"):
    """A tensor port: dtype plus symbolic shape, e.g. ``TensorSpec("float32", ("B", "T"))``."""

    dtype: str
    """One of :data:`DTYPES`, e.g. ``"float32"``."""
    shape: tuple[Dim, ...] = ()
    """Per-dimension ``int`` size, symbol (``"B"``) or ``"*"`` for any size."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(
                f"TensorSpec: unknown dtype {self.dtype!r}; use one of {sorted(DTYPES)}"
            )
        for d in self.shape:
            if (
                isinstance(d, bool)
                or not isinstance(d, int | str)
                or (isinstance(d, int) and d < 0)
            ):
                raise ValueError(
                    f"TensorSpec: dimension {d!r} in shape {self.shape!r} must be a "
                    "non-negative int, a symbol like 'B', or '*'"
                )

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"


class StructSpec(msgspec.Struct, frozen=True, tag="struct"):
    """A port carrying instances of a Python class (normally a msgspec Struct)."""

    ref: str
    """The class as ``"module:QualName"``."""

    @classmethod
    def of(cls, tp: type) -> StructSpec:
        return cls(f"{tp.__module__}:{tp.__qualname__}")

    def resolve(self) -> type | None:
        """The class, or None if its module cannot be imported here."""
        module, _, qualname = self.ref.partition(":")
        try:
            obj: Any = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            return None
        return obj if isinstance(obj, type) else None

    def __str__(self) -> str:
        return self.ref.rpartition(":")[2]


class AnySpec(msgspec.Struct, frozen=True, tag="any"):
    """A port that accepts any value."""

    def __str__(self) -> str:
        return "Any"


PortSpec = TensorSpec | StructSpec | AnySpec

#: The port type that accepts anything.
ANY = AnySpec()


class WeightUpdate(msgspec.Struct, frozen=True):
    """A published state dict with its version: a typed value, so that the data-plane codec
    carries ``version`` and ``complete`` exactly between controllers, and the runtime knows a
    weight update when it sees one (a replica receives each version once)."""

    weights: dict[str, Any]
    """name -> tensor (``torch.Tensor``), the keys that were sent."""
    version: int
    """1, 2, ... per publish; a consumer skips anything not newer than what it has."""
    complete: bool = True
    """False when only some keys were sent: the consumer loads them with ``strict=False``."""

    def __repr__(self) -> str:
        return (
            f"WeightUpdate(version={self.version}, complete={self.complete}, "
            f"{len(self.weights)} tensors)"
        )


def Tensor(dtype: str, *shape: Dim) -> TensorSpec:
    """Shorthand: ``Tensor("float32", "B", "T")``."""
    return TensorSpec(dtype, tuple(shape))


def spec_of(obj: Any) -> PortSpec:
    """Turn an annotation into a port spec: a spec stays as is, a class becomes a StructSpec."""
    if isinstance(obj, TensorSpec | StructSpec | AnySpec):
        return obj
    if obj is Any or obj is None:
        return ANY
    if isinstance(obj, type):
        return StructSpec.of(obj)
    raise TypeError(
        f"{obj!r} is not a port type; use Tensor(dtype, *dims), a msgspec Struct class, or ANY"
    )


def _dims_compatible(a: Dim, b: Dim) -> bool:
    return not (isinstance(a, int) and isinstance(b, int) and a != b)


def compatible(src: PortSpec, dst: PortSpec) -> str | None:
    """Check a producer spec against a consumer spec. Return None if they fit, else why not."""
    if isinstance(src, AnySpec) or isinstance(dst, AnySpec):
        return None
    if isinstance(src, TensorSpec) and isinstance(dst, TensorSpec):
        if src.dtype != dst.dtype:
            return f"dtype {src.dtype} is not {dst.dtype}"
        if len(src.shape) != len(dst.shape):
            return f"rank {len(src.shape)} is not {len(dst.shape)}"
        for i, (a, b) in enumerate(zip(src.shape, dst.shape)):
            if not _dims_compatible(a, b):
                return f"dimension {i} is {a} on one side and {b} on the other"
        return None
    if isinstance(src, StructSpec) and isinstance(dst, StructSpec):
        if src.ref == dst.ref:
            return None
        s, d = src.resolve(), dst.resolve()
        if s is not None and d is not None and issubclass(s, d):
            return None
        return f"type {src} is not {dst} (nor a subclass of it)"
    return f"a {type(src).__name__[:-4].lower()} port cannot feed a {type(dst).__name__[:-4].lower()} port"


_dtype_names: dict[Any, str] = {}


def _value_dtype(value: Any) -> str | None:
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return None
    name = _dtype_names.get(dtype)
    if name is None:  # str(dtype) is slow next to a dict lookup; there are few dtypes
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


def check_value(spec: PortSpec, value: Any, bindings: dict[str, int] | None = None) -> str | None:
    """Check a value against a port spec; return None if it fits, else why not.

    ``bindings`` carries symbol sizes across the ports of one call, so that
    ``rewards: (B, T)`` and ``values: (B, T)`` must agree on B and T.
    """
    if isinstance(spec, AnySpec):
        return None
    if isinstance(spec, StructSpec):
        cls = spec.resolve()
        if cls is not None and not isinstance(value, cls):
            return f"expected {spec}, got {type(value).__name__}"
        return None
    shape = getattr(value, "shape", None)
    dtype = _value_dtype(value)
    if shape is None or dtype is None:
        return f"expected a tensor {spec}, got {type(value).__name__}"
    if dtype != spec.dtype:
        return f"expected dtype {spec.dtype}, got {dtype}"
    shape = tuple(shape)
    if len(shape) != len(spec.shape):
        return f"expected {len(spec.shape)} dims {spec}, got shape {shape}"
    for dim, size in zip(spec.shape, shape):
        if isinstance(dim, int):
            if dim != size:
                return f"expected shape {spec}, got {shape}"
        elif dim != "*" and bindings is not None:
            bound = bindings.setdefault(dim, size)
            if bound != size:
                return f"dimension {dim}={size} disagrees with {dim}={bound} set by an earlier port"
    return None
