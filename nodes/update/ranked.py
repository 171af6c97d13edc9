"""What an update node does that depends on whether it trains alone or as a rank group.

Alone (``ranks=1``), a call trains in this process, the published weights are a snapshot (or
the live tensors of a model shared in-process), and the state is the modules' own
``state_dict()``. As a group (``ranks > 1``), the executor starts the other ranks and gives
the node its side of the group (``rank_group``, from ``runtime.ranks``): rank 0 checks the
call's inputs and sends them to the ranks, and then every rank runs the same step. The
published weights and the state are gathered onto rank 0 by the group, unsharded and in the
1-rank layout, so a checkpoint written with one K resumes with any other K. A group's state
calls are themselves group operations: rank 0 tells the ranks to join each of them. This
module starts no process and imports no torch.distributed: the group does both.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

import nodes.models.offload as offload_module
from nodes.models.policy import build_policy
from nodes.shared_models import live_weights
from nodes.sync import WeightUpdate
from nodes.update.micro import View
from yatt_graph import UsageError

__all__ = ["NonFiniteError"]


class NonFiniteError(UsageError):
    """A non-finite value stopped an update with ``on_nonfinite="raise"`` (no step was kept;
    in a rank group every rank raises it alike): the learning rate or the inputs to fix."""


def _snapshot(module: nn.Module) -> dict[str, Tensor]:
    """A CPU copy of the state dict, so later optimizer steps cannot change it."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def _weights(module: nn.Module, shared: bool) -> dict[str, Tensor]:
    """What an update publishes: a snapshot, or, when the module is shared with its consumers
    in this process (on-policy only), its live tensors (they skip loading their own storage)."""
    return live_weights(module) if shared else _snapshot(module)


class _Ranked:
    """Mixin of :class:`nodes.update.base._Update`: the rank group, the call, weights, state."""

    _ranks: Any = None
    """The node's joined rank group (``rank_group`` once built), or None alone."""
    _counters: tuple[str, ...] = ("version", "updates")
    """The integer attributes a checkpoint keeps beside the models."""
    execution_options: tuple[str, ...] = (
        "ranks",
        "train_backend",
        "rank_timeout_s",
        "share",
        "critic_share",
    )
    """Options that choose how the node runs, not what it computes: its checkpoints are in
    one layout whatever they are, so a run may resume with other values of them."""

    def setup(self) -> None:
        """Build the node (:meth:`yatt_graph.Node.setup`); a group whose build failed on
        rank 0 is ended, not left waiting for it."""
        try:
            super().setup()  # type: ignore[misc]
        except BaseException:
            self.close()
            self._ranks = None
            raise

    def _join_ranks(self) -> None:
        """Take this process's side of the group the executor started (``rank_group``) and
        compute on this rank's device: on CUDA, one GPU per rank from the node's device on."""
        group = self.rank_group
        if group is None:
            raise ValueError(
                f"node {self.name!r}: ranks={self.ranks} trains as a group of processes, which an "
                "executor starts (runtime.ranks.start_groups, before setup()): run the node in "
                "LocalExecutor, ZmqExecutor or yatt-graph run"
            )
        if self.device.type == "cuda":
            first = self.device.index or 0
            if torch.cuda.device_count() < first + self.ranks:
                raise ValueError(
                    f"node {self.name!r}: ranks={self.ranks} on {self.device} needs GPUs "
                    f"{first}..{first + self.ranks - 1}; torch sees {torch.cuda.device_count()}"
                )
            self.device = torch.device("cuda", first + group.rank)
            torch.cuda.set_device(self.device)
        group.set_device(self.device)
        self._ranks = group

    def _shard(self, module: nn.Module, method: str, pick: Callable[[Any], Tensor]) -> Any:
        return self._ranks.shard(module, self.train_backend, method, pick)

    def close(self) -> None:
        """End the rank group (no-op alone); the node cannot train afterwards."""
        group = self.rank_group
        if group is not None and group.rank == 0:
            group.close()

    # --- the call: alone, or rank 0 telling its group --------------------------------------
    def forward(self, **inputs: Any) -> dict[str, Any]:
        if self._ranks is None:
            return self._step(self._checked_view(inputs))
        self._switch_group(off=False)  # (the executor reloads first; a direct call may not)
        full = self._checked_view(inputs)  # bad inputs are refused before the ranks see them
        with self._ranks.guard(f"update {self.updates + 1}", keep=(NonFiniteError,)):
            self._ranks.command("step", inputs, {"step": self.step})
            return self._step(full)

    def _step(self, full: View) -> dict[str, Any]:
        raise NotImplementedError

    def serve_rank(self, op: str, values: dict[str, Any], meta: dict[str, Any]) -> None:
        """Run rank 0's call ``op`` on this rank (``python -m runtime.ranks.worker``)."""
        if op == "step":
            self.begin_step(int(meta["step"]))
            with contextlib.suppress(NonFiniteError):  # rank 0 raised it too and reports it
                self._step(self._checked_view(values))
        elif op == "state":
            self.state_dict()
        elif op == "load":
            self._load_models({}, meta)
        elif op in ("offload", "reload"):
            self._move_shards(op == "offload", bool(meta["copy"]))
        else:
            raise ValueError(f"node {self.name!r}: unknown rank operation {op!r}")

    # --- the device, when roles take turns on it --------------------------------------------
    _shards_off = False
    """Whether this rank's shards are on the host (:meth:`_switch_group`)."""

    def _switch_group(self, off: bool) -> int:
        """Offload (``off``) or reload a group's state: rank 0 tells every rank, and each moves
        its own shards (FSDP2; :meth:`_move_shards`). Idempotent. DDP keeps its state where it
        is: its reducer holds the parameters and their gradient buckets on the device."""
        if self._ranks is None or self.train_backend != "fsdp" or self._shards_off == off:
            return 0
        op = "offload" if off else "reload"
        copy = offload_module.ALWAYS_COPY
        with self._ranks.guard(f"{op} of the group's state"):
            self._ranks.command(op, meta={"copy": copy})
            return self._move_shards(off, copy)

    def _move_shards(self, off: bool, copy: bool) -> int:
        moved = 0
        for _, _, model, optimizer in self._models():
            moved += self._ranks.move(model, optimizer, off, copy)
        self._shards_off = off
        return moved

    def _weights_of(self, module: nn.Module, share: str | None, metrics: dict[str, float]) -> Any:
        """What the node publishes of ``module``; in a group, the full state gathered on rank 0
        (``metrics["time/weight_gather"]`` sums its seconds)."""
        if self._ranks is None:
            return _weights(module, self._is_shared(share))
        start = time.perf_counter()
        weights = self._ranks.full_weights(module)
        key = "time/weight_gather"
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start
        return weights

    def _publish(self, metrics: dict[str, float]) -> WeightUpdate:
        self.version += 1
        return WeightUpdate(self._weights_of(self.policy, self.share, metrics), self.version)

    # --- export --------------------------------------------------------------------------
    def save_policy(self, path: Any, state: Mapping[str, Any] | None = None) -> None:
        """Save the trained policy with ``save_pretrained`` (a LoRA policy merged): the weights
        of ``state`` (this node's :meth:`state_dict`, written with any K) when given, else the
        node's own. Built alone in this process, the node saves its own policy; otherwise (a
        rank group, whose sharded parameters only the whole group could gather, or a node not
        built here) a fresh one-process copy is built from the spec and loaded, so nothing
        waits on a collective."""
        if self.ranks == 1 and self.is_set_up:
            policy = self.policy  # its own weights, unless ``state`` says otherwise
        else:
            policy = build_policy(self.policy_spec)
            if state is None:
                state = self.state_dict()  # in a group, gathered on rank 0
        if state is not None:
            policy.load_state_dict(state["policy"])
        policy.save_pretrained(path)

    # --- state ---------------------------------------------------------------------------
    def _models(self) -> list[tuple[str, str, nn.Module, torch.optim.Optimizer]]:
        """(state key of the model, of its optimizer, model, optimizer) for each trained model."""
        return [("policy", "optimizer", self.policy, self.optimizer)]

    def state_dict(self) -> dict[str, Any]:
        """Each model and optimizer (unsharded, in the 1-rank layout: any K loads it) and the
        counters."""
        self.setup()  # a group exists only once built; its state calls are group operations
        if self._ranks is not None and self._ranks.rank == 0:
            self._switch_group(off=False)  # gathered from the device the group formed on
            with self._ranks.guard("gathering the state"):
                self._ranks.command("state")
                return self._state()
        return self._state()

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for model_key, optim_key, model, optimizer in self._models():
            if self._ranks is None:
                state[model_key] = _snapshot(model)
                state[optim_key] = copy.deepcopy(optimizer.state_dict())
            else:
                state[model_key], state[optim_key] = self._ranks.full_state(model, optimizer)
        return {**state, **{k: getattr(self, k) for k in self._counters}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.setup()
        if self._ranks is not None and self._ranks.rank == 0:
            self._switch_group(off=False)
        keys = {k for m in self._models() for k in m[:2]} | set(self._counters)
        if set(state) != keys:
            raise ValueError(
                f"node {self.name!r}: expected state keys {sorted(keys)}, got {sorted(state)}"
            )
        counters = {k: int(state[k]) for k in self._counters}
        fresh = {  # optimizers with no step yet: their settings, which every rank applies
            key: [{k: v for k, v in g.items() if k != "params"} for g in state[key]["param_groups"]]
            for _, key, _, _ in self._models()
            if not state[key].get("state")
        }
        meta = {"counters": counters, "fresh": fresh}
        if self._ranks is not None and self._ranks.rank == 0:
            with self._ranks.guard("loading the state"):
                self._ranks.command("load", meta=meta)
                self._load_models(state, meta)
        else:
            self._load_models(state, meta)

    def _load_models(self, state: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        for model_key, optim_key, model, optimizer in self._models():
            # a copy: torch's optimizer keeps the given tensors (Adam's step, and its moments
            # where dtype and device match), and its steps would then change ``state``
            optim = copy.deepcopy(state.get(optim_key, {}))
            if self._ranks is None:
                model.load_state_dict(state[model_key])
                optimizer.load_state_dict(optim)
            else:
                weights, fresh = state.get(model_key, {}), meta["fresh"].get(optim_key)
                self._ranks.load_full_state(model, optimizer, weights, optim, fresh)
        for k, v in meta["counters"].items():
            setattr(self, k, int(v))
