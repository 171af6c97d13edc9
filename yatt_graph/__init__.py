"""yatt-graph: typed dataflow graphs for multimodal RLHF.

The core package: ports and types, nodes, graphs, validation, plans, pictures and
serialization. It imports neither torch nor zmq; executors live in ``runtime``.
"""

from yatt_graph.errors import (
    CycleError,
    DuplicateNodeError,
    GraphError,
    GraphLookupError,
    GraphValidationError,
    MissingInputError,
    NodeBuildError,
    NodeExecutionError,
    NodeInputError,
    NodeOutputError,
    NodeUsageError,
    PortTypeError,
    ShapeError,
    UnusedOutputWarning,
    UsageError,
)
from yatt_graph.function_node import FunctionNode, node
from yatt_graph.graph import Edge, Graph, Handle, Outputs
from yatt_graph.node import BatchPolicy, Node, Port
from yatt_graph.plan import Channel, Plan, Subgraph
from yatt_graph.types import ANY, AnySpec, PortSpec, StructSpec, Tensor, TensorSpec, WeightUpdate

__all__ = [
    "ANY",
    "AnySpec",
    "BatchPolicy",
    "Channel",
    "CycleError",
    "DuplicateNodeError",
    "Edge",
    "FunctionNode",
    "Graph",
    "GraphError",
    "GraphLookupError",
    "GraphValidationError",
    "Handle",
    "MissingInputError",
    "Node",
    "NodeBuildError",
    "NodeExecutionError",
    "NodeInputError",
    "NodeOutputError",
    "NodeUsageError",
    "Outputs",
    "Plan",
    "Port",
    "PortSpec",
    "PortTypeError",
    "ShapeError",
    "StructSpec",
    "Subgraph",
    "Tensor",
    "TensorSpec",
    "UnusedOutputWarning",
    "UsageError",
    "WeightUpdate",
    "node",
]

__version__ = "0.1.0"
