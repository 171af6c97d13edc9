"""A node as an SPMD group of K ranks under torch.distributed: the runtime's side.

A node whose ``ranks`` is K > 1 (an update node's option) runs as K processes. The node in the
executor's process is rank 0, the *leader*. Before it is built, the executor starts K-1 rank
processes (:func:`start_groups`: ``python -m runtime.ranks.worker``, plain subprocesses, never
a fork of a process that has torch loaded) and sets the node's ``rank_group``, its side of the
group's collectives (:class:`Ranks`). Each rank rebuilds the same node from its plan spec
(builds are seeded from the config, so every rank starts from the same weights), and all join
one process group (gloo on the CPU, NCCL on CUDA) through a TCPStore that rank 0 hosts on
127.0.0.1.

The node is written SPMD and commands nobody: every rank runs the same operation on the same
arguments, and the node's code only calls collectives. The runtime calls a grouped node through
:func:`lead`, as the fan-out layer calls a node cut over slots or replicas: for each of the
operations in :data:`OPS` (a call, ``state_dict``, ``load_state_dict``, ``offload``,
``reload``) the leader encodes its arguments with the one codec (:mod:`runtime.codec`: plain
frames, no shared memory, no CUDA IPC, nothing pickled) and writes a small command under
``yatt/cmd/<n>`` in the store, a tagged Struct of the child processes' style
(:class:`runtime.children.ChildMessage`, decoded with :data:`TO_RANK`): a :class:`RankCall`
(the operation, the step of a call, the codec's header and the size of each buffer frame), or
a :class:`RankClose` at the end. The ranks poll the store while idle, so an idle group holds no
collective that could time out. Each rank reads the command, receives each frame by
``broadcast`` from rank 0 (a uint8 tensor on the group's device) and decodes the arguments.
Then every rank runs the operation, and its collectives carry the group's ``timeout_s``. A state
to load stays on rank 0, where the group's load broadcasts it from (as
``torch.distributed.checkpoint``'s ``broadcast_from_rank0`` does); the other ranks get its
outline, every tensor None, so a 7B model's state is not copied K times.

An operation that raises on every rank alike (bad inputs, a step that went non-finite) leaves
the group in step: each other rank reports its failure under ``yatt/failed/<n>/<rank>`` and
waits for the next command, and the leader, after its own raise, finds every report and
raises its error as it is. Any other failure breaks the group (below).

Supervision:

* A supervisor thread on the leader polls its children every :data:`_WATCH_S`. When one dies
  after the group formed, or reports a failure of the operation rank 0 is still running
  :data:`_DEATH_GRACE_S` later (the group is out of step: rank 0 waits on a collective the
  rank will not join), it aborts the process group (``ProcessGroup.abort()``, from that
  thread): with NCCL a collective whose peer died neither fails nor returns until the
  collective timeout, so the abort is what makes it return. The leader also polls before
  each call, and after any failed collective, giving a dying rank a moment to be reaped.
  A dead rank becomes a :class:`RankError` that names the node, the rank, its pid and its
  exit code or signal, plus the error the rank wrote to the store if it wrote one; a group
  operation that ends after its group was aborted raises it too, even if it returned (what
  an aborted NCCL collective leaves in its tensors is garbage). From then on the group is
  broken: its other ranks are killed, its process group is aborted rather than destroyed
  (``destroy_process_group()`` can wait on a dead peer), which frees torch's state so a
  restart in the same process can start a new group, and every call raises the same error.
* A rank exits when its parent (rank 0) is gone, by the one rule of every child process
  (:func:`runtime.children.exit_with_parent`, started by its entry point); a lost store or a
  broken collective ends it too. Rank 0 tells a dead rank as every parent does
  (:class:`runtime.children.Child`). :meth:`RankGroup.close` ends the ranks
  cleanly: the close command, then a join, then a kill after a grace period. It is also
  registered with ``atexit``.

One process holds at most one group, because torch.distributed has one default process
group; the grouped nodes of one process share it (:func:`start_groups`: a reference sharded
beside its update, ``Node.rank_with``). Each rank then builds every one of them, each
command names its node (:attr:`RankCall.node`), and rank 0 runs one operation at a time, so
the nodes' collectives reach every rank in one order. A group whose node was garbage
collected is closed when the next one starts.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import msgspec
import torch
import torch.distributed as dist

import runtime.ranks.sharding as sharding
from runtime.children import Child, ChildMessage, Messages, python_env, start_child, stop
from runtime.codec import decode_value, encode_value
from runtime.errors import ProcessFault
from runtime.ranks.placement import HostPlacement, interface_of, nodes_label, place_ranks

__all__ = [
    "OPS",
    "TO_RANK",
    "RankCall",
    "RankClose",
    "RankError",
    "RankGroup",
    "RankLink",
    "Ranks",
    "host_store",
    "lead",
    "leave_group",
    "rendezvous",
    "report_deaths",
    "set_interface",
    "start_groups",
    "store_client",
]

log = logging.getLogger(__name__)

_CMD = "yatt/cmd/"
_READY = "yatt/ready/"
_ERROR = "yatt/error/"
_FAILED = "yatt/failed/"
_READ = "yatt/read/"  # how many ranks have read command n
_DEAD = "yatt/dead/"  # a rank on another host, as its controller saw it die
_ABORT = "yatt/abort"  # rank 0 broke the group: the ranks exit
_NODE = "yatt/node"
_DEATH_GRACE_S = 5.0  # after a failed collective: how long a dying rank has to be reaped
_WATCH_S = 0.1  # how often the supervisor looks at the ranks
_CLOSE_GRACE_S = 10.0
_SETTLE_S = 0.5  # after a dead rank is found: how long the ranks it takes with it have to show


OPS = ("run", "state_dict", "load_state_dict", "offload", "reload")
"""The node operations a group runs on every rank (:func:`lead`): a call (``run``, its inputs
the argument), the state's gathering and loading, and the device switch's moves."""


class RankCall(ChildMessage, tag="call"):
    """What rank 0 writes to the store for command ``n``: run the node's operation ``op`` (one
    of :data:`OPS`); the frames of its argument follow by broadcast."""

    op: str
    """The node's method, one of :data:`OPS`."""
    step: int
    """The step of a ``run`` (``node.begin_step`` before it); 0 for the other operations."""
    header: bytes
    """The codec's header of the argument, ``{"value": ...}`` or ``{}`` for none
    (:func:`runtime.codec.encode_value`)."""
    sizes: list[int]
    """The bytes of each buffer frame, in broadcast order (an empty one is not sent)."""
    node: str = ""
    """The node of the group that runs it ('': the group's first)."""


class RankClose(ChildMessage, tag="close"):
    """What rank 0 writes to the store as its last command: exit cleanly."""


TO_RANK = Messages("a training rank", RankCall, RankClose)


def _frame_tensor(frame: Any) -> torch.Tensor:
    """A buffer frame of the codec as a flat uint8 tensor, sharing its memory where it may."""
    view = memoryview(frame).cast("B")
    if view.readonly:  # bytes (an image's pixels): torch wraps writable memory only
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8)  # (nbytes,)


class RankError(ProcessFault):
    """A rank of a training group died, or a collective of the group failed: a process fault,
    like a dead controller, so ``--restart on-failure`` restarts the run from its last
    checkpoint."""


class Ranks:
    """A rank's side of its group as its node sees it (``node.rank_group``): its rank and
    the world's size, the device, and the collectives every rank calls in the same order;
    rank 0's :class:`RankGroup` and the other ranks' :class:`RankLink` are one each."""

    rank: int
    world: int
    store: Any
    local_rank = 0
    """This rank's index among its host's ranks of the group (its GPU, on CUDA)."""
    hosts: Sequence[str] = ()
    """Each rank's host, when the group spans hosts (hybrid sharding's mesh); empty: one."""
    members: Mapping[str, Any] = {}
    """The group's nodes in this process, by name (a critic beside its update reads the
    update's value model through it)."""

    def __init__(self, who: str, world: int, device: torch.device, timeout_s: float) -> None:
        self.who = who
        self.world = int(world)
        self.set_device(device)
        self.timeout = datetime.timedelta(seconds=float(timeout_s))

    def in_operation(self) -> bool:
        """Whether every rank runs the operation this rank runs now (rank 0: one that
        :func:`lead` started)."""
        return True

    def set_device(self, device: torch.device) -> None:
        """Compute (and communicate: gloo on the CPU, NCCL on CUDA) on ``device``."""
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"

    def _init_group(self) -> None:
        store = dist.PrefixStore("pg/", self.store)
        # Bound to its GPU, NCCL makes its communicator now, on that GPU, instead of guessing
        # the device at the first collective.
        device_id = self.device if self.device.type == "cuda" else None
        dist.init_process_group(
            self.backend, store=store, rank=self.rank, world_size=self.world,
            timeout=self.timeout, device_id=device_id,
        )  # fmt: skip

    # --- collectives every rank calls in the same order ---------------------------------------
    def all_sum(self, numbers: Sequence[float]) -> list[float]:
        """The sum over ranks of each number (float64)."""
        x = torch.tensor(list(numbers), dtype=torch.float64, device=self.device)  # (n,)
        dist.all_reduce(x)
        return x.tolist()

    def sum_into(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (on the group's device) summed over the ranks, in place; returned."""
        dist.all_reduce(tensor)
        return tensor

    def any_flag(self, flag: bool) -> bool:
        """Whether any rank passed True."""
        x = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self.device)  # (1,)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return bool(x.item())

    # --- the node's models across the group (runtime.ranks.sharding) --------------------------
    def shard(self, module: torch.nn.Module, backend: str, method: str, pick: Any) -> Any:
        """Shard (FSDP2) or replicate (DDP) ``module``; the callable to train through."""
        return sharding.shard_module(
            module, backend, self.device, self.world, method, pick, self.hosts
        )

    def full_weights(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The unsharded weights, gathered onto rank 0's CPU."""
        return sharding.full_weights(module)

    def full_state(self, model: torch.nn.Module, optimizer: Any) -> tuple[dict, dict]:
        """The unsharded model and optimizer state on rank 0, in the 1-rank layout."""
        return sharding.full_state(model, optimizer)

    def move(self, model: torch.nn.Module, optimizer: Any, off: bool, copy: bool = False) -> int:
        """This rank's shards of ``model`` and ``optimizer`` to the host (``off``) or back to
        its device (:func:`sharding.move_shards`); then synchronized, and after an offload
        the freed blocks handed back to the driver. Returns the bytes moved."""
        device = torch.device("cpu") if off else self.device
        moved = sharding.move_shards(model, optimizer, device, copy)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if off:
                torch.cuda.empty_cache()
        return moved

    def load_full_state(
        self, model: torch.nn.Module, optimizer: Any, weights: Any, optim: Any, fresh: Any
    ) -> None:
        """Load a 1-rank layout state (given on rank 0) into every rank."""
        sharding.load_full_state(model, optimizer, weights, optim, self.rank, fresh)


def leave_group(clean: bool) -> None:
    """Leave this process's group: destroy it when every rank is alive and done (``clean``),
    else abort it. With a dead peer ``destroy_process_group()`` can wait on it for good (NCCL
    finalizes its communicators), while an abort returns and frees torch's state all the
    same."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):
        if clean:
            dist.destroy_process_group()
        else:
            dist.distributed_c10d._abort_process_group()


def _abort_collectives() -> None:
    """Make the collectives of this process's group return now, from any thread
    (``ProcessGroup.abort()``: NCCL aborts its communicators and stops its watchdog, so the
    collective timeout does not end the process); torch's state is left for
    :func:`leave_group`."""
    dist.group.WORLD.abort()


# --- rank 0 ---------------------------------------------------------------------------------------

_current: list[tuple[weakref.ref, RankGroup]] = []


def _close_all() -> None:
    for _, group in list(_current):
        group.close()


atexit.register(_close_all)


class RankGroup(Ranks):
    """Rank 0's side: starts and supervises the other ranks, sends them each call."""

    rank = 0

    def __init__(
        self, names: Sequence[str], world: int, device: torch.device, timeout_s: float
    ) -> None:
        super().__init__(nodes_label(names), world, device, timeout_s)
        self.names = list(names)
        self.timeout_s = float(timeout_s)
        self.procs: list[Child] = []
        self.broken: str | None = None
        self.closed = False
        self.death = ""
        """The first rank found dead by the supervisor (as :meth:`_dead` says it), or ''."""
        self._next = 0
        self.running: tuple[int, str] | None = None
        """The command rank 0 runs now (its number and operation), for the supervisor."""
        self._joined = False
        self._lock = threading.Lock()  # the supervisor's abort against close()
        self._turn = threading.Lock()  # one operation at a time: two nodes' collectives
        self.remote: list[int] = []
        """Ranks that other controllers started (on other hosts), watched through the store."""

    def in_operation(self) -> bool:
        return self.running is not None

    @classmethod
    def start(
        cls, nodes: Sequence[Any], placement: HostPlacement | None = None, here: int = 0
    ) -> RankGroup:
        """Host the store and start ranks 1..K-1 (K: the nodes' ``ranks``), each building
        every node of ``nodes`` from its spec; they compute on the CPU until a node sets its
        device. With a ``placement`` (a group across hosts, this process being controller
        ``here``) the store is the driver's, and only the ranks ``here`` starts are started
        here. Nodes of one group share its ranks: each rank holds one model of each (a
        reference sharded beside its update)."""
        from yatt_graph.serialize import node_spec

        node = nodes[0]
        for owner, old in list(_current):
            if owner() is None:  # its node is gone: nothing will use it again
                old.close()
        if _current or dist.is_initialized():
            holder = _current[0][1].who if _current else "another user of torch.distributed"
            raise RuntimeError(
                f"node {node.name!r}: this process already holds a process group ({holder}); "
                "a process runs one rank group at a time: close() that node first, or place "
                "this one on another controller"
            )
        world = int(node.ranks)
        timeout_s = max(float(n.rank_timeout_s) for n in nodes)
        self = cls([n.name for n in nodes], world, torch.device("cpu"), timeout_s)
        self.members = weakref.WeakValueDictionary({n.name: n for n in nodes})  # (no cycle)
        if placement is None:
            self.store = dist.TCPStore(
                "127.0.0.1", 0, world, is_master=True, timeout=self.timeout,
                wait_for_workers=False,
            )  # fmt: skip
            address, mine = f"127.0.0.1:{self.store.port}", list(range(1, world))
            local = mine
        else:
            if placement.world != world:
                raise ValueError(
                    f"node {node.name!r}: the driver placed {placement.world} ranks for "
                    f"ranks={world}; run the same graph on every host"
                )
            self.store = store_client(placement.store, world, self.timeout)
            address, mine = placement.store, placement.ranks_of(here)
            local = [placement.local[r] for r in mine]
            self.remote = [r for r in range(1, world) if r not in mine]
            self.hosts = list(placement.hosts)
            set_interface(placement.hosts[0])
        self.store.set(_NODE, msgspec.json.encode([node_spec(n) for n in nodes]))
        self.procs = start_ranks(address, mine, local, world, timeout_s, self.hosts)
        _current.append((weakref.ref(node), self))
        threading.Thread(target=self._supervise, daemon=True, name="rank-supervisor").start()
        return self

    def _supervise(self) -> None:
        """Until the group closes: find the first dead rank, or a rank that failed the
        operation rank 0 still runs a grace period later, and abort the process group so that
        a collective waiting on it returns now, not at the collective timeout."""
        seen: tuple[tuple[int, str], float] | None = None  # (a failed command, when seen)
        while not self.closed:
            dead = self._dead()
            running = self.running
            if not dead and running is not None and (failed := self._failures(running[0])):
                if seen is None or seen[0] != running:
                    seen = (running, time.monotonic())
                elif time.monotonic() - seen[1] > _DEATH_GRACE_S:
                    dead = f"{failed[0]}, while rank 0 still ran it (the group is out of step)"
            if dead:
                with self._lock:
                    if self.closed:  # a rank that close() ended is no fault
                        return
                    self.death = dead
                    if self._joined:
                        with contextlib.suppress(Exception):
                            _abort_collectives()
                return
            time.sleep(_WATCH_S)

    def join(self) -> None:
        """Wait until every rank has built its first node, then form the process group (once:
        a later node of the group finds it formed)."""
        if self._joined:
            return
        deadline = time.monotonic() + self.timeout_s
        keys = [f"{_READY}{r}" for r in range(1, self.world)]
        while not self.store.check(keys):
            if dead := self._dead():
                self._fail(f"{self.who}: {dead} while building its node")
            if time.monotonic() > deadline:
                self._fail(
                    f"{self.who}: the ranks were not ready after {self.timeout_s:.0f} s; "
                    "raise rank_timeout_s if building the model takes longer"
                )
            time.sleep(0.01)
        with self.guard("forming the process group"):
            self._init_group()
        self._joined = True

    # --- calls ---------------------------------------------------------------------------------
    def lead(
        self, op: str, run: Callable[[], Any], value: Any = None, step: int = 0, node: str = ""
    ) -> Any:
        """Tell every rank to run ``op`` of ``node`` (with ``value`` as its argument, when not
        None), then ``run`` it here, in :meth:`guard`: rank 0's result. One operation at a
        time: the group's nodes may be called from several threads, and their collectives
        must reach every rank in one order."""
        what = f"{op} of step {step}" if op == "run" else op
        if len(self.names) > 1:
            what = f"{node!r} {what}"
        args = {} if value is None else {"value": value}  # refused here, before a rank hears
        header, *frames = encode_value(args, where=f"{self.who} {what}", any_keys=True)
        with self._turn:
            return self._lead(RankCall(op, int(step), header, [], node), frames, run, what)

    def _lead(self, call: RankCall, frames: list[Any], run: Callable[[], Any], what: str) -> Any:
        try:
            with self.guard(what):
                n = self._command(call, frames, what)
                self.running = (n, call.op)
                result = run()
                if failed := self._failures(n):  # a rank failed where rank 0 did not
                    self.death = (
                        self.death
                        or f"{failed[0]}, where rank 0 did not (the group is out of step)"
                    )
                return result
        finally:
            self.running = None

    def _command(self, command: RankCall, frames: list[Any], what: str) -> int:
        """Write the command and broadcast its argument's frames; its number."""
        if dead := self._dead():
            self._fail(f"{self.who}: {dead}; the group cannot run {what}")
        command.sizes = sizes = [memoryview(f).nbytes for f in frames]
        n = self._write(command)
        for frame, size in zip(frames, sizes, strict=True):
            if size:
                dist.broadcast(_frame_tensor(frame).to(self.device), src=0)
        return n

    def _write(self, command: RankCall | RankClose) -> int:
        """The next command, under ``yatt/cmd/<n>`` (the last rank to read it deletes it:
        :meth:`RankLink.commands`); its number ``n``."""
        n = self._next
        self._next += 1
        self.store.set(f"{_CMD}{n}", TO_RANK.encode(command))
        return n

    def _failures(self, n: int) -> list[str]:
        """'rank 2 failed: ValueError: ...' for each rank that reported a failure of command
        ``n``."""
        found = []
        for rank in range(1, self.world):
            key = f"{_FAILED}{n}/{rank}"
            with contextlib.suppress(Exception):
                if self.store.check([key]):
                    found.append(f"rank {rank} failed: {self.store.get(key).decode()}")
        return found

    def _failed_alike(self, n: int, exc: BaseException) -> bool:
        """Whether every other rank reported a failure of command ``n`` of the same type as
        rank 0's ``exc`` (waiting up to :data:`_DEATH_GRACE_S` for them, not past a death)."""
        deadline = time.monotonic() + _DEATH_GRACE_S
        while len(failures := self._failures(n)) < self.world - 1:
            if self.death or self._dead() or time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        alike = f" failed: {type(exc).__name__}: "
        return all(alike in text for text in failures)

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run a group operation; an error every rank raised alike (each other rank reported
        it for the command running) passes through and leaves the group in step. Any other
        failure, or any end of the operation after the supervisor aborted the group, becomes
        a :class:`RankError` naming the rank that died (or saying that none did), and the
        group is then broken."""
        if self.broken:
            raise RankError(self.broken)
        try:
            yield
        except RankError:
            raise
        except Exception as exc:
            running = self.running
            if running is not None and not self.death and self._failed_alike(running[0], exc):
                raise
            dead = self._dead(wait_s=_DEATH_GRACE_S) or self.death
            if dead:
                self._fail(f"{self.who}: {dead} during {what}", exc)
            self._fail(
                f"{self.who}: a collective failed during {what} with every rank alive "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                exc,
            )
        if self.death:  # it returned, but from an aborted group: its results are garbage
            self._fail(f"{self.who}: {self.death} during {what}")

    def _fail(self, text: str, cause: BaseException | None = None) -> None:
        """Break the group for good: end the other ranks at once (they could only wait on a
        collective that will not come), free the process group, raise the error."""
        self.broken = f"{text}; restart the run (from its last checkpoint) to continue"
        self.close()
        raise RankError(self.broken) from cause

    def _dead(self, wait_s: float = 0.0) -> str:
        """'rank 1 (pid 123) was killed by SIGKILL (9)' for each dead rank (a rank on another
        host as its controller reported it to the store), those killed by a signal first:
        the others mostly left because a collective with a dead peer broke. '' for none,
        after waiting up to ``wait_s`` for one; once one is found after a wait, the others
        that follow it within :data:`_SETTLE_S` are named too."""
        deadline = time.monotonic() + wait_s
        while True:
            found = self._dead_now()
            if found and wait_s > 0:
                time.sleep(_SETTLE_S)
                found = self._dead_now()
            if found or time.monotonic() >= deadline:
                return "; ".join(sorted(found, key=lambda text: " killed by " not in text))
            time.sleep(0.05)

    def _dead_now(self) -> list[str]:
        found = []
        for proc in self.procs:
            if text := proc.dead():
                found.append(self._with_error(int(proc.label.split()[-1]), text))
        for rank in self.remote:
            with contextlib.suppress(Exception):
                if self.store.check([f"{_DEAD}{rank}"]):
                    text = self.store.get(f"{_DEAD}{rank}").decode()
                    found.append(self._with_error(rank, text))
        return found

    def _with_error(self, rank: int, text: str) -> str:
        """``text`` and the error rank ``rank`` left in the store, if it left one."""
        with contextlib.suppress(Exception):
            if self.store.check([f"{_ERROR}{rank}"]):
                text += f": {self.store.get(f'{_ERROR}{rank}').decode()}"
        return text

    def close(self) -> None:
        """End the ranks (a close command, a join, then :func:`runtime.children.stop`) and the group."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        clean = self._joined and not self.broken and not self.death and not self._dead()
        with contextlib.suppress(Exception):
            if clean:
                self._write(RankClose())
            else:  # ranks on other hosts stop polling for commands that will not come
                self.store.set(_ABORT, b"1")
        stop(self.procs, _CLOSE_GRACE_S if clean else 0.0)
        if self._joined:
            leave_group(clean)
        _current[:] = [(o, g) for o, g in _current if g is not self]


# --- ranks 1..K-1 ---------------------------------------------------------------------------------


class RankLink(Ranks):
    """A rank's side: the store and the calls it receives from rank 0."""

    def __init__(
        self,
        store: str,
        rank: int,
        world: int,
        timeout_s: float,
        local_rank: int,
        hosts: Sequence[str] = (),
    ) -> None:
        super().__init__(f"rank {rank}", world, torch.device("cpu"), timeout_s)
        self.rank, self.local_rank, self.hosts = int(rank), int(local_rank), list(hosts)
        self.store = store_client(store, world, self.timeout)

    def node_specs(self) -> bytes:
        """The JSON list of the group's node specs, as rank 0 left it."""
        return self.store.get(_NODE)

    def join(self) -> None:
        """Say this rank is ready and form the process group (once: the group's later nodes
        find it formed)."""
        if dist.is_initialized():
            return
        self.store.set(f"{_READY}{self.rank}", b"1")
        self._init_group()

    def report(self, text: str) -> None:
        """Leave an error for rank 0 to name when it finds this rank dead."""
        with contextlib.suppress(Exception):
            self.store.set(f"{_ERROR}{self.rank}", text.encode())

    def failed(self, n: int, text: str) -> None:
        """Report that this rank's run of command ``n`` raised (:meth:`RankGroup.guard`)."""
        self.store.set(f"{_FAILED}{n}/{self.rank}", text.encode())

    def commands(self) -> Iterator[tuple[int, RankCall, Any]]:
        """``(n, command, argument)`` per command of rank 0 (the argument None where it gave
        none), until it says ``close``."""
        n = 0
        while True:
            key = f"{_CMD}{n}"
            idle = time.monotonic()
            polls = 0
            while not self.store.check([key]):  # polled: an idle wait is no collective
                polls += 1
                if polls % 100 == 0 and self.store.check([_ABORT]):
                    raise RuntimeError(f"{self.who}: rank 0 broke the group")
                time.sleep(0.001 if time.monotonic() - idle < 0.2 else 0.01)
            command = TO_RANK.decode(self.store.get(key))
            if self.store.add(f"{_READ}{n}", 1) == self.world - 1:  # the last to read it
                self.store.delete_key(key)  # (an operation may run no collective, so rank
                self.store.delete_key(f"{_READ}{n}")  # 0 cannot tell who has read it)
            if isinstance(command, RankClose):
                return
            frames = []
            for size in command.sizes:
                t = torch.empty(size, dtype=torch.uint8, device=self.device)  # (size,)
                if size:
                    dist.broadcast(t, src=0)
                frames.append(t.cpu().numpy())
            args = decode_value([command.header, *frames], where=f"{self.who} {command.op}")
            yield n, command, args.get("value")
            n += 1


def store_client(address: str, world: int, timeout: datetime.timedelta) -> Any:
    """A client of the TCPStore at ``address`` (``HOST:PORT``, or ``[HOST]:PORT`` for an
    IPv6 host, as :func:`host_store` writes it)."""
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host.strip("[]"), int(port), world, is_master=False, timeout=timeout)


def report_deaths(
    children: Mapping[str, Child], store: Any, host: str, closed: Callable[[], bool]
) -> None:
    """Watch ``children`` (started here for a node on another host) from a thread: each that
    ends with a non-zero code is written, ``... on host HOST`` and its log's tail, under its
    key of ``children`` in ``store``, where the node's process reads it. The thread ends
    once every child has ended, or ``closed()``."""

    def watch() -> None:
        told: set[str] = set()
        while not closed():
            for key, child in children.items():
                if key not in told and child.returncode is not None:
                    told.add(key)
                    if child.returncode != 0:
                        said = f"{child.dead()} on host {host}{child.log_tail()}"
                        with contextlib.suppress(Exception):
                            store.set(key, said.encode())
            if len(told) == len(children):
                return
            time.sleep(_WATCH_S)

    threading.Thread(target=watch, daemon=True, name="remote-children").start()


def _outline(value: Any) -> Any:
    """``value`` with every tensor None (in dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, Mapping):
        return {k: _outline(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_outline(v) for v in value]
    return value


def lead(node: Any, op: str, value: Any = None, step: int = 0) -> Any:
    """``node.<op>(value)`` (no argument when ``value`` is None; ``op`` one of :data:`OPS`):
    the runtime's call of a node. When this process leads the node's rank group, every other
    rank runs the same operation on the same argument (a state to load: its outline, see
    the module doc); otherwise the node runs it alone."""
    method = getattr(node, op)
    args = () if value is None else (value,)
    group = node.rank_group
    if not isinstance(group, RankGroup) or op not in OPS:
        return method(*args)
    node.setup()  # the group forms in the build: the ranks build theirs before they serve
    sent = _outline(value) if op == "load_state_dict" else value
    return group.lead(op, lambda: method(*args), sent, step, node.name)


def serve(link: RankLink) -> None:
    """A rank's side of :func:`lead`: run each of rank 0's commands on the node of the group
    it names (``link.members``, the first when it names none) until it says close. An
    operation that raises is reported (:meth:`RankLink.failed`) and the rank waits for the
    next: rank 0 raised it too, or breaks the group. A broken collective (a
    ``torch.distributed`` error) ends the rank instead."""
    by_name = link.members
    first = next(iter(by_name.values()))
    for n, command, value in link.commands():
        if command.op not in OPS:
            raise ValueError(f"{link.who}: rank 0 sent the unknown operation {command.op!r}")
        if command.node and command.node not in by_name:
            raise ValueError(f"{link.who}: rank 0 sent {command.op} of the unknown node "
                             f"{command.node!r}; this rank holds {sorted(by_name)}")  # fmt: skip
        node = by_name[command.node] if command.node else first
        try:
            if command.op == "run":
                node.begin_step(command.step)
            getattr(node, command.op)(*(() if value is None else (value,)))
        except Exception as exc:
            link.failed(n, f"{type(exc).__name__}: {exc}")
            if isinstance(exc, dist.DistError):
                # a broken collective: the group cannot go on, and leaving closes this rank's
                # connections, so the ranks still waiting on it fail now, not at the timeout
                raise
            log.warning("%s: %s failed: %s: %s", link.who, command.op, type(exc).__name__, exc)


def set_interface(host: str) -> None:
    """Have gloo bind this process's collectives to the interface holding ``host``, which the
    other hosts reach (``GLOO_SOCKET_IFNAME``; one the user set stays)."""
    name = interface_of(host)
    if name is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)


def start_ranks(
    store: str,
    ranks: Sequence[int],
    local_ranks: Sequence[int],
    world: int,
    timeout_s: float,
    hosts: Sequence[str] = (),
) -> list[Child]:
    """Start ``ranks`` of a group of ``world`` (``python -m runtime.ranks.worker``) as children of
    this process, meeting at ``store`` (``HOST:PORT``); ``local_ranks`` are their indices on
    this host, ``hosts`` every rank's host when the group spans hosts."""
    threads = torch.get_num_threads()
    env = python_env(threads)
    procs = []
    for rank, local in zip(ranks, local_ranks, strict=True):
        args = [
            "--store", store, "--rank", str(rank), "--world", str(world),
            "--local-rank", str(local), "--parent-pid", str(os.getpid()),
            "--timeout", str(timeout_s), "--threads", str(threads), "--hosts", ",".join(hosts),
        ]  # fmt: skip
        procs.append(start_child("runtime.ranks.worker", args, env, f"rank {rank}"))
    return procs


class RemoteRanks:
    """The ranks a controller starts for a group whose rank 0 is on another controller (on
    another host): it watches them and tells rank 0 through the group's store when one dies;
    :meth:`close` ends what is left (they end by themselves when rank 0 closes the group)."""

    def __init__(self, names: Sequence[str], placement: HostPlacement, here: int) -> None:
        self.who = nodes_label(names)
        ranks = placement.ranks_of(here)
        host = placement.hosts[ranks[0]]
        set_interface(host)
        timeout = datetime.timedelta(seconds=placement.timeout_s)
        self.store = store_client(placement.store, placement.world, timeout)
        local = [placement.local[r] for r in ranks]
        self.procs = start_ranks(
            placement.store, ranks, local, placement.world, placement.timeout_s, placement.hosts
        )
        self.closed = False
        watched = {f"{_DEAD}{r}": proc for r, proc in zip(ranks, self.procs, strict=True)}
        report_deaths(watched, self.store, host, lambda: self.closed)

    def close(self) -> None:
        self.closed = True
        stop(self.procs, _CLOSE_GRACE_S)


def rendezvous(
    nodes: Mapping[str, Any],
    assignment: Mapping[str, int],
    per_host: int,
    hosts: Sequence[str],
    driver_host: str,
) -> tuple[dict[str, HostPlacement], list[Any]]:
    """The driver's side of groups across hosts: for each node of ``nodes`` whose ``ranks``
    spill past its host's ``per_host`` (``hosts``: each controller's host, by index), where
    each rank runs (:func:`runtime.ranks.placement.place_ranks`) and a TCPStore hosted here,
    at ``driver_host``, for the group to meet at. Returns the placements and the stores,
    which the caller keeps as long as the run."""
    placements: dict[str, HostPlacement] = {}
    stores: list[Any] = []
    if not per_host:
        return placements, stores
    by_owner: dict[int, HostPlacement] = {}  # a controller's nodes share its one group
    for name, node in nodes.items():
        if node.ranks <= per_host:
            continue
        owner = assignment[name]
        if owner in by_owner and by_owner[owner].world == node.ranks:
            placements[name] = by_owner[owner]
            continue
        controllers, where, local = place_ranks(name, node.ranks, per_host, owner, hosts)
        store, address = host_store(driver_host, node.ranks, float(node.rank_timeout_s))
        stores.append(store)
        placements[name] = by_owner[owner] = HostPlacement(
            address, controllers, where, local, float(node.rank_timeout_s)
        )
    return placements, stores


def host_store(host: str, world: int, timeout_s: float) -> tuple[Any, str]:
    """A TCPStore hosted by this process at ``host`` on a free port, for ``world`` clients,
    and the ``HOST:PORT`` (``[HOST]:PORT`` for IPv6) that :func:`store_client` reads."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
    address = f"[{host}]" if ":" in host else host
    return store, f"{address}:{store.port}"


def start_groups(
    nodes: Mapping[str, Any],
    placements: Mapping[str, HostPlacement] | None = None,
    here: int = 0,
) -> list[Any]:
    """Start the group of each node whose ``ranks`` is above 1 and that has none yet, and set
    its ``rank_group``; call it before the nodes' ``setup()``, where each joins its group.
    With ``placements`` (groups that span hosts; this process is controller ``here``), also
    start the ranks ``here`` holds of groups whose node is elsewhere. Returns what it started
    (groups and :class:`RemoteRanks`), for the caller to ``close()`` when it is done."""
    placements = placements or {}
    grouped = [n for n in nodes.values() if n.ranks > 1 and n.rank_group is None]
    grouped.sort(key=lambda n: n.rank_with is not None)  # the group's own node first
    for node in grouped:
        if node.streaming:
            raise ValueError(
                f"node {node.name!r}: ranks={node.ranks} runs a node as a group of processes, "
                "which a streaming node cannot be; set ranks=1"
            )
        if node.ranks != grouped[0].ranks:
            raise ValueError(
                f"nodes {grouped[0].name!r} (ranks={grouped[0].ranks}) and {node.name!r} "
                f"(ranks={node.ranks}) run in one process, which holds one rank group: give "
                "them the same ranks, or place them on different controllers"
            )
    started: list[Any] = []
    shared: dict[str, list[str]] = {}  # a group's store: the names of its nodes
    for name, placement in sorted(placements.items()):
        shared.setdefault(placement.store, []).append(name)
    for names in shared.values():
        placement = placements[names[0]]
        if here in placement.controllers:
            print(f"yatt-graph controller {here}: {placement.describe(names, here)}",
                  file=sys.stderr, flush=True)  # fmt: skip
    try:
        if grouped:
            group = RankGroup.start(grouped, placements.get(grouped[0].name), here)
            started.append(group)
            for node in grouped:
                node.rank_group = group
        for names in shared.values():
            placement = placements[names[0]]
            if not set(names) & set(nodes) and placement.ranks_of(here):
                started.append(RemoteRanks(names, placement, here))
    except BaseException:
        for group in started:
            group.close()
        raise
    return started
