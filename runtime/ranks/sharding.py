"""How a rank group trains a module: FSDP2 or DDP, and the full state gathered on rank 0.

* ``fsdp``: ``torch.distributed.fsdp.fully_shard`` on each transformer block (the classes an
  HF model names in ``_no_split_modules``), then on the module itself (the root: embeddings,
  heads, the prefix-VLM's projector). Each rank then holds 1/K of the parameters, gradients
  and optimizer state. A policy is called through ``forward_response``, so that method is
  registered with ``register_fsdp_forward_method``: it unshards the root's parameters, as
  ``__call__`` would.
* ``ddp``: ``DistributedDataParallel`` around a small module whose ``forward`` is the method
  (DDP's gradient hooks need its own ``__call__``), ``find_unused_parameters=True`` (a text
  batch leaves a prefix-VLM's projector unused).

Both average gradients over the K ranks. The update therefore scales each rank's loss by K,
with every loss weight taken as a share of the *global* batch, so the K-rank step equals the
1-rank one up to the order of float sums.

State: :func:`full_state` gathers the unsharded model and optimizer state onto rank 0's CPU
with ``torch.distributed.checkpoint.state_dict.get_state_dict(full_state_dict=True,
cpu_offload=True)``. It converts the optimizer state to the 1-rank layout (parameter indices,
as ``optimizer.state_dict()`` writes it), so a checkpoint loads into a node with any K.
:func:`load_full_state` is the inverse, and rank 0 broadcasts the state to the other ranks.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "BACKENDS",
    "full_state",
    "full_weights",
    "load_full_state",
    "move_shards",
    "shard_module",
]

BACKENDS = ("fsdp", "hsdp", "ddp")

# FSDP2 warns that a module returned a view (the policy's logits are one): harmless, because
# nothing here writes into that view in place.
_VIEW_WARNING = r"FSDP2-wrapped module .* returned a view tensor"


def _block_classes(module: nn.Module) -> set[str]:
    names: set[str] = set()
    for m in module.modules():
        names |= set(getattr(m, "_no_split_modules", None) or ())
    return names


class _MethodModule(nn.Module):
    """``forward(*args)`` = ``getattr(module, method)(*args)``, with an optional output view."""

    def __init__(self, module: nn.Module, method: str, pick: Callable[[Any], Tensor]) -> None:
        super().__init__()
        self.module = module
        self.method = method
        self.pick = pick

    def forward(self, *args: Any) -> Tensor:
        fn = self.module if self.method == "forward" else getattr(self.module, self.method)
        return self.pick(fn(*args))


def shard_module(
    module: nn.Module,
    backend: str,
    device: torch.device,
    world: int,
    method: str = "forward",
    pick: Callable[[Any], Tensor] = lambda out: out,
    hosts: Sequence[str] = (),
) -> Callable[..., Tensor]:
    """Shard ``module`` across the process group; return the callable to train through
    (``pick(module.<method>(*args))``, with the backend's gradient reduction). ``hosts``:
    each rank's host, for ``hsdp`` (ranks of a host in one block; none: one host)."""
    if backend in ("fsdp", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        if backend == "hsdp":
            mesh = init_device_mesh(
                device.type,
                hybrid_shape(hosts or ["here"] * world),
                mesh_dim_names=("replicate", "shard"),
            )
        else:
            mesh = init_device_mesh(device.type, (world,))
        blocks = _block_classes(module)
        for m in list(module.modules()):
            if m is not module and type(m).__name__ in blocks:
                fully_shard(m, mesh=mesh)
        fully_shard(module, mesh=mesh)
        if method != "forward":
            register_fsdp_forward_method(module, method)
        fn = module if method == "forward" else getattr(module, method)  # __call__: the hooks

        def call(*args: Any) -> Tensor:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_VIEW_WARNING)
                return pick(fn(*args))

        return call
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(
        _MethodModule(module, method, pick), device_ids=ids, find_unused_parameters=True
    )


def hybrid_shape(hosts: Sequence[str]) -> tuple[int, int]:
    """``(hosts, ranks a host)``, the device mesh of hybrid sharding for ranks whose hosts are
    ``hosts`` (each host's ranks one block): each host's ranks shard the state, and the hosts
    hold replicas of it; a ValueError when the hosts hold unequal counts."""
    counts = Counter(hosts)
    blocks = [h for i, h in enumerate(hosts) if i == 0 or hosts[i - 1] != h]
    if len(set(counts.values())) > 1 or len(blocks) != len(counts):
        raise ValueError(
            "train_backend='hsdp' shards within each host and replicates across hosts, so "
            f"every host needs as many ranks: these hold {dict(counts)}; make --train-ranks "
            "the hosts times --ranks-per-host, or use fsdp"
        )
    return len(counts), len(hosts) // len(counts)


def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The model's name of each optimizer parameter, in the optimizer's index order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _live_storages(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> set[int]:
    tensors = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {getattr(t, "_local_tensor", t).untyped_storage().data_ptr() for t in tensors}


def _detached(state: Any, live: set[int]) -> Any:
    """``state`` with every tensor that is the live model's or optimizer's own (a CPU tensor
    that ``cpu_offload`` did not copy: DDP's parameters, Adam's ``step``) cloned, so that later
    steps cannot change a published or checkpointed state."""
    if isinstance(state, dict):
        return {k: _detached(v, live) for k, v in state.items()}
    if isinstance(state, list):
        return [_detached(v, live) for v in state]
    if torch.is_tensor(state) and state.untyped_storage().data_ptr() in live:
        return state.detach().clone()
    return state


def full_weights(model: nn.Module) -> dict[str, Tensor]:
    """The unsharded state dict on rank 0's CPU (``{}`` on the other ranks); collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    weights = get_model_state_dict(model, options=_options(cpu_offload=True))
    return _detached(weights, _live_storages(model, None)) if weights else weights


def full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Model and optimizer state, unsharded, on rank 0's CPU, the optimizer's by parameter
    index as ``optimizer.state_dict()`` lays it out (``({}, {})`` on the other ranks);
    collective."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if not optimizer.state:  # no step yet: get_state_dict would take a zero step to make some
        weights = full_weights(model)
        if dist.get_rank() != 0:
            return weights, {}
        return weights, {"state": {}, "param_groups": optimizer.state_dict()["param_groups"]}
    names = _param_names(model, optimizer)
    weights, optim = get_state_dict(model, optimizer, options=_options(cpu_offload=True))
    if not optim:
        return weights, {}
    live = _live_storages(model, optimizer)
    weights, optim = _detached(weights, live), _detached(optim, live)
    index = {n: i for i, n in enumerate(names)}
    state = {index[k]: dict(v) for k, v in optim["state"].items()}
    groups = [{**g, "params": [index[k] for k in g["params"]]} for g in optim["param_groups"]]
    return weights, {"state": state, "param_groups": groups}


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    weights: Mapping[str, Tensor],
    optim: Mapping[str, Any],
    rank: int,
    fresh: list[dict[str, Any]] | None = None,
) -> None:
    """Load :func:`full_state`'s form (given on rank 0; ignored elsewhere) into every rank's
    shards; collective. ``fresh``, the same on every rank: the optimizer state has no step
    yet, and these are its param groups' settings (then only the model is sent)."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = _options(broadcast_from_rank0=True)
    if fresh is not None:
        set_model_state_dict(model, dict(weights) if rank == 0 else {}, options=options)
        optimizer.state.clear()  # as before the first step, and no zero step taken to fill it
        for group, settings in zip(optimizer.param_groups, fresh, strict=True):
            group.update({k: tuple(v) if k == "betas" else v for k, v in settings.items()})
        return
    names = _param_names(model, optimizer)
    if rank == 0:
        state = {names[int(i)]: v for i, v in optim.get("state", {}).items()}
        groups = [
            {**g, "params": [names[int(i)] for i in g["params"]]}
            for g in optim.get("param_groups", [])
        ]
        fqn_optim: dict[str, Any] = {"state": state, "param_groups": groups}
        weights = dict(weights)
    else:
        weights, fqn_optim = {}, {}
    # two calls: set_state_dict skips the model's broadcast where its model state is empty
    set_model_state_dict(model, weights, options=options)
    set_optimizer_state_dict(model, optimizer, fqn_optim, options=options)


def move_shards(model: nn.Module, optimizer: Any, device: torch.device, copy: bool = False) -> int:
    """This rank's shards of an FSDP2 ``model`` (parameters, gradients, buffers) and its
    ``optimizer``'s state (none: a model without one) moved to ``device``, as verl offloads FSDP2: ``model._apply`` (what
    ``model.to`` runs; FSDP2 reshards first and registers the moved shards as its parameters
    again, and each ``Parameter`` keeps its identity, so the optimizer still holds it), then
    the optimizer's state entry by entry (Adam's CPU ``step`` stays). ``copy``: what is on
    ``device`` already is copied too (tests on a CPU). Returns the bytes of shards moved."""
    moved = 0

    def convert(t: Tensor) -> Tensor:
        nonlocal moved
        if t.device == device and not copy:
            return t
        local = t.to_local() if hasattr(t, "to_local") else t
        moved += local.numel() * local.element_size()
        return t.clone() if t.device == device else t.to(device)

    model._apply(convert)
    for state in optimizer.state.values() if optimizer is not None else ():
        for key, value in state.items():
            if isinstance(value, Tensor) and not (key == "step" and value.dim() == 0):
                state[key] = convert(value)
    return moved
