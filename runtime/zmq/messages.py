"""Every message of the ZeroMQ runtime, in one module.

A message on the wire is a list of frames::

    [head, *value_frames]

``head`` is one kind byte (a :class:`Kind`, so a socket loop can route a message from its
first byte) followed by the message Struct below in msgpack (``array_like``, so field
order is the wire format: append fields at the end, with defaults, and bump
:data:`PROTOCOL_VERSION` on any other change); one frame, because each frame costs more
than its bytes on the dispatch path; ``value_frames`` carry a value encoded by
:mod:`runtime.codec` (a msgpack tree plus raw tensor buffers) for the kinds that have one
(DATA, STEP_DONE).

Conversation (driver D, controllers C0..Cn-1)::

    C -> D  HELLO(protocol, controller, pid, host, data_address, work_identity)   at start-up
    D -> C  REFUSED(reason)                                         protocol mismatch, then C exits
    D -> C  SETUP(plan, peers, knobs)                               once all HELLOs are in
    C -> D  READY(nodes) (work link)  |  ERROR(...)                 nodes built (or not)
    D -> C  RUN(until)                                              steps < until may run
    D -> C  RESOURCES(resources)                                    new cores/threads (adaptive)
    C -> C  DATA(step, src, port) + value                           the data plane, never via D
    C -> C  RELEASE(segment)                                        a shared-memory slot is free again
    C -> D  STEP_DONE(step, node_seconds[, resources]) + outputs    per controller per step
    C -> D  ERROR(node, step, message, traceback)                   a node raised or timed out
    C -> D  WARN(node, step, message)                               a node runs far past its usual time
    C <-> D HEARTBEAT                                               both ways, every interval
    D -> C  STATE_REQUEST(step); C -> D STATE_REPLY + state         between steps: checkpoint
    D -> C  STATE_LOAD(step, epoch) + state; C -> D STATE_LOADED    between steps: restore
    D -> C  SHUTDOWN(reason);  C -> D GOODBYE                       explicit end

Each controller has two DEALERs to the driver's ROUTER. The **control link** (HELLO, SETUP,
heartbeats both ways, SHUTDOWN, timeout errors) belongs to its IO thread; the **work link**
(``work_identity``, announced in HELLO: RUN and STATE_* in, READY, STEP_DONE, node errors,
STATE_* replies and GOODBYE out) belongs to its compute thread, which also reads its data
PULL itself: a RUN or a peer's DATA reaches the thread that acts on it with no hand-off
between threads.

A receiver drops (and logs) what does not decode, what exceeds ``max_message_bytes`` and
what comes from a stranger; see docs/RELIABILITY.md.

A replica process (:mod:`runtime.zmq.replicas`) has one PAIR socket to the process that
started it and speaks the child processes' style (:class:`runtime.children.ChildMessage`):
``[header, *value_frames]``, the header a tagged Struct, the value frames the codec's::

    P -> R  ReplicaBuild(spec)                        first: the node to build
    R -> P  ReplicaReady  |  ReplicaFailed(message)   built (or not)
    P -> R  ReplicaCall(context, rows) + inputs       a piece
    R -> P  ReplicaDone + outputs  |  ReplicaFailed   its answer
    P -> R  ReplicaStop                               explicit end
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from runtime.children import ChildMessage, Messages
from runtime.engine.config import RunConfig
from runtime.errors import ProtocolError
from runtime.ranks.placement import HostPlacement
from runtime.sched.devices import Resources

__all__ = [
    "PROTOCOL_VERSION",
    "Data",
    "Error",
    "Goodbye",
    "Heartbeat",
    "Hello",
    "Kind",
    "ProtocolError",
    "Ready",
    "Refused",
    "Release",
    "ReplicaBuild",
    "ReplicaCall",
    "ReplicaDone",
    "ReplicaFailed",
    "ReplicaReady",
    "ReplicaStop",
    "Run",
    "SetResources",
    "Setup",
    "Shutdown",
    "State",
    "StateLoad",
    "StateLoaded",
    "StateReply",
    "StateRequest",
    "StepDone",
    "Warn",
    "FROM_REPLICA",
    "MAX_HEADER_BYTES",
    "TO_REPLICA",
    "decode_header",
    "encode_header",
    "hello_protocol",
]

PROTOCOL_VERSION = 9
"""Bumped on any change to the messages below other than an appended field with a default; a
peer of another version is refused with both versions named. A HELLO whose kind and header
come in two frames (an older peer's) is still read, so that it too is refused with the reason."""

MAX_HEADER_BYTES = 16 << 20
"""A header frame (the Struct, not the value frames) larger than this is refused undecoded."""


class Kind(enum.IntEnum):
    """The first frame of every message: what the header frame holds."""

    HELLO = 1
    REFUSED = 2
    SETUP = 3
    READY = 4
    RUN = 5
    DATA = 6
    RELEASE = 7
    STEP_DONE = 8
    ERROR = 9
    HEARTBEAT = 10
    SHUTDOWN = 11
    GOODBYE = 12
    STATE_REQUEST = 13
    STATE_REPLY = 14
    STATE_LOAD = 15
    STATE_LOADED = 16
    WARN = 17
    RESOURCES = 18

    @property
    def frame(self) -> bytes:
        return _KIND_FRAMES[self]


_KIND_FRAMES = {k: bytes([k.value]) for k in Kind}
_KIND_BY_BYTE = {k.value: k for k in Kind}


class State(enum.IntEnum):
    """Life of a controller as the driver sees it."""

    STARTING = 0
    """Process started, no HELLO yet."""
    CONNECTED = 1
    """HELLO received, SETUP sent."""
    READY = 2
    """Nodes built; steps may run."""
    STOPPING = 3
    """SHUTDOWN sent."""
    STOPPED = 4
    """GOODBYE received or the process has exited."""
    FAILED = 5
    """Died, timed out or reported an error."""


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass


class Hello(_Msg):
    """Controller -> driver, first message. ``protocol`` stays the first field in every version."""

    protocol: int
    controller: int = -1
    """The index the controller was started for; -1 lets the driver assign one."""
    pid: int = 0
    host: str = ""
    data_address: str = ""
    """Where the controller's PULL socket listens for peers."""
    work_identity: bytes = b""
    """The identity of the controller's work-link DEALER (random: no other peer can claim it)."""


class Refused(_Msg):
    """Driver -> controller: the handshake failed (protocol mismatch, too many controllers)."""

    reason: str


class Setup(_Msg):
    """Driver -> controller: what to run and with whom."""

    controller: int
    plan_json: bytes
    """``Plan.to_json()``; empty when the nodes are rebuilt from ``graph_ref`` instead."""
    graph_ref: str = ""
    """A module or file whose ``build_graph(**graph_options)`` rebuilds the graph."""
    graph_options_json: bytes = b"{}"
    assignment: dict[str, int] = {}
    """Node -> controller (needed when rebuilding from ``graph_ref``)."""
    peers: list[str] = []
    """Data address of every controller, by index."""
    config: RunConfig = msgspec.field(default_factory=RunConfig)
    """The run's options (runtime.engine.config)."""
    run_id: str = ""
    """Prefix of this run's shared-memory segments (the driver removes leftovers)."""
    order: list[str] = []
    """Every node of the graph in topological order."""
    digest: str = ""
    """A hash of the graph's edges and outputs: a graph rebuilt from ``graph_ref`` must match it."""
    resources: Resources | None = None
    """The cores, threads and GPUs it computes on (runtime.sched.devices); None: every core of
    its host, one thread per core (a controller on another host)."""
    cuda_ipc_gpus: list[list[int]] = []
    """Per controller, by index: the physical GPUs (ordinals among the driver's) it may receive
    CUDA IPC tensors on, in its local-ordinal order; ``[]`` for one on another host or not
    started by the driver, and for all when CUDA IPC is off (runtime.codec.cuda_ipc)."""
    offload_controllers: list[int] = []
    """The controllers that offload their nodes' device state when their part of a step ends
    and reload it before their next model call (runtime.engine.switch, ``offload=``)."""
    devices: dict[str, str] = {}
    """Every node's device by name: what each reader takes of a value, as it is or a host copy
    (runtime.engine.calls)."""
    rank_groups: dict[str, HostPlacement] = {}
    """The rank groups that span hosts, by node: where each rank runs and the store they meet
    at (runtime.ranks.placement); the others start on their node's controller."""
    replica_hosts: dict[str, HostPlacement] = {}
    """The nodes whose replicas span hosts (a run on several hosts), by node: where each
    replica runs and the store where it finds its node (runtime.zmq.replicas)."""


class Ready(_Msg):
    controller: int
    nodes: list[str] = []
    resources: Resources | None = None
    """What the controller applied: the cores it may run on, torch's threads, its GPUs."""


class Run(_Msg):
    """Driver -> controller: steps ``< until`` may run (nodes start as their inputs arrive)."""

    until: int


class SetResources(_Msg):
    """Driver -> controller (work link): compute on these from the next node call on."""

    resources: Resources


class Data(_Msg):
    """Controller -> controller: output ``port`` of node ``src`` at ``step``; the value follows."""

    step: int
    src: str
    port: str
    sender: int = -1
    epoch: int = 0
    """Bumped by every STATE_LOAD: data sent before a restore is dropped, not mixed in."""
    piece: int = -1
    """A streamed output (:mod:`runtime.engine.streams`): the piece's index; -1: the whole value."""
    rows: list[int] = []
    """A piece's rows (positions in the node's whole output batch)."""
    end: bool = False
    """The end of a stream: ``piece`` is then the number of pieces, and no value follows."""
    size: int = -1
    """A piece's whole batch size, when the streaming node said it; -1: not said."""


class Release(_Msg):
    """Receiver -> sender: the shared-memory segment holding a tensor may be reused."""

    segment: str


class StepDone(_Msg):
    """Controller -> driver: all of its nodes finished ``step``; the graph outputs it owns follow."""

    controller: int
    step: int
    node_seconds: dict[str, float] = {}
    node_start: dict[str, float] = {}
    """``time.time()`` at each node's call start (comparable across processes on one host)."""
    resources: Resources | None = None
    """Set in the first STEP_DONE after a RESOURCES: what the controller applied."""
    staleness: dict[str, int | None] = {}
    """Versions old of each delayed-edge read here, by "dst.port" (``StepResult.staleness``)."""
    switches: list[tuple[str, float, float, int, int]] = []
    """Its offloads and reloads of the step (``StepResult.switches``)."""
    replicas: dict[str, list[int]] = {}
    """Per node cut across replicas, the replica of each input row (``StepResult.replicas``)."""
    ipc_bytes: int = 0
    """The bytes of the tensors it opened by CUDA IPC since its last STEP_DONE
    (``sched/ipc_bytes``)."""


class Error(_Msg):
    """Controller -> driver: something failed; the run stops."""

    controller: int
    message: str
    node: str = ""
    step: int = -1
    traceback: str = ""
    during: str = "step"
    """``setup`` (building nodes), ``build`` (a library node refused what the user gave it:
    a one-line input error), ``step`` (a node call), ``data`` (a node call stopped on a
    sample the user gave: a one-line :class:`~yatt_graph.UsageError`), ``send`` (encoding), ``io``,
    ``timeout`` (a node call ran past its limit), ``state`` (state_dict/load_state_dict),
    ``replica`` (a replica process of the node died: a process fault, restartable)."""
    seconds: float = 0.0
    """With ``timeout``: how long the call had been running."""
    limit_s: float = 0.0
    """With ``timeout``: the limit it ran past."""


class Heartbeat(_Msg):
    controller: int = -1
    """The sender; -1 for the driver."""
    step: int = -1
    """The lowest step the controller has not finished (for 'stuck at step' messages)."""
    running: str = ""
    """The node being called when the beat left ("" when idle)."""
    running_s: float = 0.0
    """How long that call had been running."""
    running_step: int = -1
    """The step of that call."""


class StateRequest(_Msg):
    """Driver -> controller, between steps: send the state of your nodes after ``step`` steps."""

    step: int


class StateReply(_Msg):
    """Controller -> driver: its nodes' state, delayed-edge values and RNG states follow."""

    controller: int
    step: int


class StateLoad(_Msg):
    """Driver -> controller: restore the state that follows; the next step to run is ``step``."""

    step: int
    epoch: int


class StateLoaded(_Msg):
    controller: int
    step: int


class Warn(_Msg):
    """Controller -> driver: a node call runs far past its usual time (the stack follows in
    ``message``); the run goes on."""

    controller: int
    message: str
    node: str = ""
    step: int = -1


class Shutdown(_Msg):
    reason: str = ""


class Goodbye(_Msg):
    controller: int


_TYPES: dict[Kind, type[_Msg]] = {
    Kind.HELLO: Hello,
    Kind.REFUSED: Refused,
    Kind.SETUP: Setup,
    Kind.READY: Ready,
    Kind.RUN: Run,
    Kind.DATA: Data,
    Kind.RELEASE: Release,
    Kind.STEP_DONE: StepDone,
    Kind.ERROR: Error,
    Kind.HEARTBEAT: Heartbeat,
    Kind.SHUTDOWN: Shutdown,
    Kind.GOODBYE: Goodbye,
    Kind.STATE_REQUEST: StateRequest,
    Kind.STATE_REPLY: StateReply,
    Kind.STATE_LOAD: StateLoad,
    Kind.STATE_LOADED: StateLoaded,
    Kind.WARN: Warn,
    Kind.RESOURCES: SetResources,
}
_KIND_OF = {cls: kind for kind, cls in _TYPES.items()}
_encoder = msgspec.msgpack.Encoder()
_decoders = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in _TYPES.items()}


def encode_header(msg: _Msg) -> list[bytes]:
    """``[head]``: the kind byte and the header of a message, in one frame."""
    return [_KIND_OF[type(msg)].frame + _encoder.encode(msg)]


def _nbytes(frame: Any) -> int:
    try:
        return memoryview(frame).nbytes
    except TypeError as exc:
        raise ProtocolError(f"a frame that is not bytes ({type(frame).__name__})") from exc


def decode_header(head: Any) -> tuple[Kind, Any]:
    """The kind and message Struct from a message's head frame; ProtocolError if it does not decode.

    Never raises anything else, whatever the frame holds (tests/runtime/test_fuzz.py).
    """
    size = _nbytes(head)
    view = memoryview(head).cast("B") if size else None
    kind = _KIND_BY_BYTE.get(view[0]) if view is not None else None
    if kind is None:
        first = bytes(view[:8]) if view is not None else b""
        raise ProtocolError(
            f"unknown message kind byte {first!r}; is the sender a yatt-graph peer?"
        )
    if size - 1 > MAX_HEADER_BYTES:
        raise ProtocolError(
            f"a {kind.name} header of {size - 1} bytes is over the {MAX_HEADER_BYTES}-byte limit"
        )
    try:
        return kind, _decoders[kind].decode(view[1:])
    except (msgspec.DecodeError, TypeError, ValueError) as exc:
        raise ProtocolError(
            f"cannot decode a {kind.name} header ({size - 1} bytes): {exc}; "
            f"the peer may run another protocol version (this side speaks {PROTOCOL_VERSION})"
        ) from exc


def hello_protocol(header: Any) -> int:
    """The protocol version of a HELLO's msgpack header (the head frame without its kind
    byte, or a protocol-2 header frame), readable whatever the rest of the message holds."""
    try:
        if _nbytes(header) > MAX_HEADER_BYTES:
            raise ValueError(f"header over {MAX_HEADER_BYTES} bytes")
        fields = msgspec.msgpack.decode(header)
        return int(fields[0])
    except Exception as exc:
        raise ProtocolError(f"a HELLO whose protocol version cannot be read: {exc}") from exc


# --- a replica process's link (runtime.zmq.replicas) ---------------------------------------------


class ReplicaBuild(ChildMessage, tag="build"):
    """Parent -> replica, first: the node to build."""

    spec: bytes
    """The node's :class:`~yatt_graph.serialize.NodeSpec` in JSON."""


class ReplicaCall(ChildMessage, tag="call"):
    """Parent -> replica: run a piece; its inputs follow as the codec's frames."""

    context: dict[str, int] | None = None
    """The piece context (``Node.begin_piece``); None: a plain ``node.run``."""
    rows: list[int] = []
    """The piece's rows in the whole call."""


class ReplicaStop(ChildMessage, tag="stop"):
    """Parent -> replica: exit now."""


class ReplicaReady(ChildMessage, tag="ready"):
    """Replica -> parent: the node is built."""

    pid: int = 0
    """The replica's process id (on its host)."""
    host: str = ""
    """The host it runs on, when that is not its parent's."""


class ReplicaDone(ChildMessage, tag="done"):
    """Replica -> parent: the piece ran; its outputs follow as the codec's frames."""


class ReplicaFailed(ChildMessage, tag="failed"):
    """Replica -> parent: the build or the piece raised; the error and its traceback."""

    message: str


TO_REPLICA = Messages("a replica process", ReplicaBuild, ReplicaCall, ReplicaStop)
FROM_REPLICA = Messages("a replica's parent", ReplicaReady, ReplicaDone, ReplicaFailed)
