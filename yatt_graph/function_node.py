"""Function nodes: ``@node(outputs=...)`` turns a function into a :class:`~yatt_graph.node.Node`.

Annotated parameters become input ports; parameters with defaults and no port type become
parameters (``fn(..., factor=3.0)`` in a graph, or ``fn.with_params(...)``).
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from yatt_graph.node import BatchPolicy, Node, Port, _as_port
from yatt_graph.types import AnySpec, StructSpec, TensorSpec

__all__ = ["FunctionNode", "node"]


class FunctionNode(Node):
    """A stateless node made from a plain function by :func:`node`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        outputs: Mapping[str, Any] | None = None,
        kind: str = "function",
        name: str | None = None,
        params: Mapping[str, Any] | None = None,
        placement: str | int | None = None,
        batch_policy: BatchPolicy | None = None,
    ) -> None:
        self.fn = fn
        self.kind = kind
        super().__init__(name or fn.__name__, placement=placement, batch_policy=batch_policy)
        sig = inspect.signature(fn, eval_str=True)
        self.inputs, self.params = {}, dict(params or {})
        self._param_names: set[str] = set()
        for pname, p in sig.parameters.items():
            ann = p.annotation
            struct = isinstance(ann, type) and issubclass(ann, msgspec.Struct)
            if struct or isinstance(ann, TensorSpec | StructSpec | AnySpec | Port):
                port = _as_port(ann)
                if p.default is not inspect.Parameter.empty:
                    port = Port(port.spec, required=False, doc=port.doc)
                self.inputs[pname] = port
            elif p.default is not inspect.Parameter.empty or pname in self.params:
                self._param_names.add(pname)
            else:
                raise TypeError(
                    f"@node {fn.__name__}: parameter {pname!r} has no port type and no default; "
                    "annotate it with Tensor(...)/a Struct class/ANY, or give it a default to make "
                    "it a parameter"
                )
        unknown = set(self.params) - self._param_names
        if unknown:
            raise TypeError(f"@node {fn.__name__}: unknown parameter(s) {sorted(unknown)}")
        if outputs is None:
            ret = sig.return_annotation
            if ret is inspect.Signature.empty:
                raise TypeError(
                    f"@node {fn.__name__}: declare outputs=..., or annotate the return with a port type"
                )
            outputs = {"out": ret}
        self.outputs = {k: _as_port(v) for k, v in outputs.items()}
        self.__doc__ = fn.__doc__

    def forward(self, **inputs: Any) -> Any:
        return self.fn(**inputs, **self.params)

    def with_params(self, name: str | None = None, **params: Any) -> FunctionNode:
        """A copy with some parameters set (and optionally another name)."""
        other = self.renamed(name) if name else copy.copy(self)
        unknown = set(params) - self._param_names
        if unknown:
            raise TypeError(f"node {self.name!r}: unknown parameter(s) {sorted(unknown)}")
        other.params = {**self.params, **params}
        other._init_args = (other._init_args[0], {**other._init_args[1], "params": other.params})
        return other

    def __call__(self, *args: Any, name: str | None = None, **kwargs: Any) -> Any:
        params = {k: kwargs.pop(k) for k in list(kwargs) if k in self._param_names}
        target = self.with_params(name, **params) if (params or name) else self
        return Node.__call__(target, *args, **kwargs)

    def config(self) -> dict[str, Any]:
        # Rebuilt from the decorated object found at `ref`, so only what differs is kept.
        return {"name": self.name, "params": dict(self.params)}

    @property
    def ref(self) -> str:
        from yatt_graph.refs import ref_of

        return ref_of(self.fn)

    @property
    def label(self) -> str:
        return f"@{self.fn.__name__}"


def node(
    fn: Callable[..., Any] | None = None,
    *,
    outputs: Mapping[str, Any] | None = None,
    kind: str = "function",
    name: str | None = None,
    placement: str | int | None = None,
    batch_policy: BatchPolicy | None = None,
) -> Any:
    """Make a :class:`FunctionNode` from a function. Ports come from the annotations."""

    wrap = functools.partial(FunctionNode, outputs=outputs, kind=kind, name=name,
                             placement=placement, batch_policy=batch_policy)  # fmt: skip
    return wrap(fn) if fn is not None else wrap
