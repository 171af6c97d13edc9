"""An update's training, in the order a call runs it: the inputs checked into the batch's
:class:`View`, the batch cut into mini-batches and micro-batches, and the guarded optimization loop.
The update node owns one :class:`Trainer`, built with its models; the losses are the node's
(``nodes.rl``).

A batch of B rows is cut into *units*: one row each, or one prompt's ``group`` consecutive
rows when the image inputs come one row per prompt. As a group (``ranks > 1``, the node's
``rank_group`` from ``runtime.ranks``), the code is SPMD: the runtime runs each call, state
gathering and load, offload and reload on every rank with the same arguments, and the trainer
only calls the group's collectives. The units are split across the K ranks by token cost
(:func:`yatt_graph.partition.lpt`),
and every rank runs as many backward passes (each ends in the group's gradient reduction): a
rank with fewer micro-batches pads with *filler* micro-batches, a real unit whose loss is
scaled by 0. The state is gathered onto rank 0, unsharded and in the 1-rank layout, so a
checkpoint written with one K resumes with any other K. This module starts no process and
imports no torch.distributed: the group does both.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

import nodes.models.offload as offload_module
from nodes.batches import View, read_mask, token_budget_parts
from nodes.reference import _responses_per_row
from nodes.rl.losses import _distill_advantages, _is_weights
from nodes.rl.masked import _check_finite
from nodes.seeding import seeded, step_seed
from nodes.update.options import UpdateHyper
from nodes.update.schedule import lr_factor
from yatt_graph import UsageError
from yatt_graph.partition import lpt

__all__ = ["MicroLoss", "NonFiniteError", "Trained", "Trainer", "View", "plan_micro_batches"]

log = logging.getLogger(__name__)

MicroLoss = Callable[[View, slice], tuple[Tensor, dict[str, float]] | None]
"""A micro-batch's weighted loss and stats from its view and rows (None: no real token)."""


class NonFiniteError(UsageError):
    """A non-finite value stopped an update with ``on_nonfinite="raise"`` (no step was kept;
    in a rank group every rank raises it alike): the learning rate or the inputs to fix."""


class _NonFinite(Exception):
    """Raised inside a step when a model output, the loss or a gradient is not finite."""


class Trained(NamedTuple):
    """A model the update trains, with its optimizer, in the order they step."""

    key: str
    """Its state key (``"policy"``), and its optimizer's (``"optimizer"``)."""
    optim_key: str
    metric: str
    """The metric of its gradient norm (``"grad_norm"``)."""
    what: str
    """What it is in messages (``"policy"``)."""
    module: nn.Module
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer


class Micro(NamedTuple):
    """One micro-batch: its rows of a view and the scales of its loss and its metrics."""

    view: View
    rows: slice
    grad_scale: float
    """The loss is multiplied by this before backward: 1 alone, K in a group of K ranks (the
    group averages gradients), 0 for a filler."""
    stat_scale: float
    """1, or 0 for a filler."""


def token_micro_batches(
    view: View, budget: int, max_rows: int = 0, packed: bool = False
) -> list[View]:
    """``view`` cut by :func:`~nodes.batches.token_budget_parts`, each part trimmed."""
    parts = token_budget_parts(view, budget, max_rows, packed)
    return [view.take(part).trimmed() for part in parts]


Cut = Callable[[View], list[tuple[View, slice]]]
"""A node's cut of a view into micro-batches: each its view and its rows of that view."""


def plan_micro_batches(
    full: View, cut: Cut, rank: int, world: int
) -> tuple[list[Micro], Micro | None]:
    """This rank's micro-batches, padded with fillers to the largest count over the ranks,
    and the filler itself (None with one rank). ``cut`` is the node's cut of a view."""
    B = full.real.shape[0]
    if world == 1:
        return [Micro(view, rows, 1.0, 1.0) for view, rows in cut(full)], None
    g = full.group
    costs = full.real.reshape(B // g, -1).sum(1).tolist()  # real tokens per unit
    shares = lpt(costs, world)  # a pure function: every rank cuts alike
    cuts = [cut(full.take(s)) if s else [] for s in shares]
    first = next(u for u, c in enumerate(costs) if c > 0)  # the batch has a real token
    filler = Micro(full, slice(first * g, (first + 1) * g), 0.0, 0.0)
    micros = [Micro(view, rows, float(world), 1.0) for view, rows in cuts[rank]]
    return micros + [filler] * (max(map(len, cuts)) - len(micros)), filler


# --- the guard: the weights before a step, put back when it made them (or what they compute
# next) non-finite; a parameter sharded by FSDP2 (a DTensor) through this rank's shard ---------
def _shards(trained: Sequence[Trained]) -> list[list[Tensor]]:
    """Each trained model's weights as plain tensors: this rank's shard of a DTensor."""
    return [[getattr(p, "_local_tensor", p).detach() for p in m.params] for m in trained]


def weights_finite(trained: Sequence[Trained], ranks: Any = None) -> bool:
    """Whether every trained weight is finite (with a rank group: on every rank): one fused
    norm per model, not finite when a weight is not (or so large its square overflows)."""
    with torch.no_grad():
        bad = any(
            local and not bool(torch.stack(torch._foreach_norm(local)).isfinite().all())
            for local in _shards(trained)
        )
    return not (ranks.any_flag(bad) if ranks is not None else bad)


def copy_weights(
    trained: Sequence[Trained], into: list[list[Tensor]] | None = None
) -> list[list[Tensor]]:
    """The trained weights as they are (into the buffers of an earlier copy, if given)."""
    with torch.no_grad():
        if into is None:
            return [[t.clone() for t in local] for local in _shards(trained)]
        for local, saved in zip(_shards(trained), into):
            torch._foreach_copy_(saved, local)
    return into


def restore_weights(trained: Sequence[Trained], saved: list[list[Tensor]]) -> None:
    """Put a :func:`copy_weights` copy back into the trained weights."""
    with torch.no_grad():
        for local, copies in zip(_shards(trained), saved):
            torch._foreach_copy_(local, copies)


def _full(norm: Tensor) -> Tensor:
    """A total norm as a plain tensor (FSDP's is a DTensor that still needs its reduction)."""
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm


class Trainer:
    """An update's training (see the module docstring): the node's models in ``trained``, its
    hyper-parameters, its rank group (None alone) and its count of calls."""

    def __init__(
        self,
        name: str,
        hp: UpdateHyper,
        device: torch.device,
        metric_keys: tuple[str, ...],
        group: Any = None,
        backend: str = "fsdp",
    ) -> None:
        self.where, self.hp, self.device, self.group = f"node {name!r}", hp, device, group
        self.metric_keys, self.backend = metric_keys, backend
        self.trained: list[Trained] = []
        self.updates = 0
        """Calls trained (the schedule's step count and the published weights' version)."""
        self.response_stats: dict[str, float] = {}
        self.shards_off = False
        """Whether this rank's shards are on the host (:meth:`switch`)."""

    # --- the call ---------------------------------------------------------------------------
    def call(
        self, inputs: Mapping[str, Any], run: Callable[[View], dict[str, Any]]
    ) -> dict[str, Any]:
        """``run`` (the node's step) on the checked inputs."""
        if self.group is not None:
            self._on_every_rank("a call")
            self.switch(off=False)  # (the executor reloads first; a direct call may not)
        return run(self.view(inputs))

    def _on_every_rank(self, what: str) -> None:
        """Refuse ``what`` on rank 0 when the runtime did not start it on every rank: the
        group's first collective would wait for ranks that never come."""
        if not self.group.in_operation():
            raise ValueError(
                f"{self.where}: {what} of a node trained by {self.group.world} ranks runs on "
                "every rank; call it through an executor or runtime.engine.calls.node_op"
            )

    # --- the call's batch ---------------------------------------------------------------------
    def _check_inputs(
        self, tensors: dict[str, Tensor | None], image_embeds: Tensor | None, images: Any
    ) -> tuple[dict[str, Tensor], Tensor, int]:
        """Move the token tensors to the device and check them.

        Returns the tensors, the real-token mask (bool[B, R]) and the number of responses per
        image row (``B // N`` when image inputs come one per prompt, else 1).
        """
        where, hp = self.where, self.hp
        if hp.kl_coef > 0 and tensors.get("ref_logprobs") is None:
            raise ValueError(
                f"{where}: kl_coef={hp.kl_coef} needs the 'ref_logprobs' input connected "
                "(from a ReferenceLogprobs node), or set kl_coef=0"
            )
        if hp.distill_coef > 0 and tensors.get("teacher_logprobs") is None:
            raise ValueError(
                f"{where}: distill_coef={hp.distill_coef} needs the 'teacher_logprobs' input "
                "connected (from a TeacherLogprobs node), or set distill_coef=0"
            )
        if hp.tis_cap > 0 and tensors.get("rollout_logprobs") is None:
            raise ValueError(
                f"{where}: tis_cap={hp.tis_cap} needs the 'rollout_logprobs' input connected "
                "(the Rollout's, with recompute_logprobs=True), or set tis_cap=0"
            )
        out = {k: v.to(self.device) for k, v in tensors.items() if v is not None}
        B, R = out["response_ids"].shape
        if B == 0:
            raise ValueError(f"{where}: input 'response_ids' is empty (B = 0); nothing to train on")
        if R == 0:
            raise ValueError(f"{where}: input 'response_ids' has no tokens (R = 0)")
        mask = out["response_mask"]
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(
                f"{where}: input 'response_mask' must hold only 0.0 (padding) and 1.0 (real token)"
            )
        real = mask > 0  # (B, R)
        if not bool(real.any()):
            raise ValueError(
                f"{where}: input 'response_mask' has no real token; every response is empty"
            )
        for port, x in out.items():
            if x.is_floating_point() and port != "response_mask":
                _check_finite(where, f"input {port!r}", x, real)
        group = 1
        for port, value in (("image_embeds", image_embeds), ("images", images)):
            if value is None:
                continue
            if isinstance(value, str) or not isinstance(value, Sequence | Tensor):
                raise ValueError(
                    f"{where}: input {port!r} must be a list or tensor, got {type(value).__name__}"
                )
            group = _responses_per_row(where, port, value, B)
        return out, real, group

    def view(self, inputs: Mapping[str, Any]) -> View:
        """The call's inputs, checked, as the whole batch's :class:`View`; with
        ``mask_truncated`` the responses the rollout cut leave the loss."""
        image_embeds, images = inputs.get("image_embeds"), inputs.get("images")
        skip = ("image_embeds", "images", "truncated")
        tensors = {k: v for k, v in inputs.items() if k not in skip}
        t, real, group = self._check_inputs(tensors, image_embeds, images)
        stats = self.response_stats = {}
        cut = inputs.get("truncated")
        if cut is not None:
            cut = cut.to(real.device).reshape(-1) > 0  # (B,)
            if cut.shape[0] != real.shape[0]:
                raise ValueError(
                    f"{self.where}: input 'truncated' has {cut.shape[0]} rows for "
                    f"{real.shape[0]} responses"
                )
            lengths = real.sum(1).float()  # (B,)
            ended = lengths[~cut]
            stats["truncated"] = float(cut.float().mean())
            stats["ended_length"] = float(ended.mean()) if len(ended) else 0.0
            if self.hp.mask_truncated and bool((real & ~cut[:, None]).any()):
                real = real & ~cut[:, None]  # (B, R) (all cut: trained on as they are, and said)
            elif self.hp.mask_truncated:
                log.warning("%s: every response was cut at max_new_tokens; they are trained "
                            "on this step (raise max_new_tokens)", self.where)  # fmt: skip
        read_mask(self.where, t["response_mask"], t.get("context_mask"))  # checked
        self._distill(t, real)
        sampled = t.pop("rollout_logprobs", None)
        if sampled is not None:
            gap = (t["logprobs"] - sampled).abs()[real]  # (n,) |log pi_old - log pi_rollout|
            stats["logprob_gap_mean"] = float(gap.mean()) if len(gap) else 0.0
            stats["logprob_gap_max"] = float(gap.max()) if len(gap) else 0.0
            hp = self.hp
            if hp.tis_cap > 0:
                weights = _is_weights(
                    t["logprobs"], sampled, real, hp.tis_cap, hp.tis_level, hp.tis_mode
                )  # (B, R): a sequence's weight needs all its tokens, so the whole batch's
                t["tis_weights"] = weights
                stats["tis_weight_mean"] = float(weights[real].mean())
                if hp.tis_mode == "mask":
                    stats["tis_masked"] = float((weights[real] == 0).float().mean())
        return View(t, real, image_embeds, images, group)

    def _distill(self, t: dict[str, Tensor], real: Tensor) -> None:
        """The teacher's part in ``t`` (checked inputs): ``distill/kl``, the mean reverse KL
        ``log pi_old - log pi_teacher`` of the sampled tokens, and the advantages weighed by
        ``reward_coef``, with the teacher's term in advantage mode."""
        hp = self.hp
        teacher = t.get("teacher_logprobs") if hp.distill_coef > 0 else None
        if teacher is not None:
            reverse_kl = (t["logprobs"] - teacher)[real]  # (n,) k1 of each sampled token
            self.response_stats["distill/kl"] = float(reverse_kl.mean())
        if teacher is not None and hp.distill_mode == "advantage":
            t["advantages"] = _distill_advantages(
                t["advantages"], t["logprobs"], teacher, real, hp.distill_coef, hp.reward_coef
            )  # (B, R)
        elif hp.reward_coef != 1.0:
            t["advantages"] = hp.reward_coef * t["advantages"]  # (B, R)

    def mini_batches(self, full: View, epoch: int) -> list[View]:
        """The epoch's ``mini_batches`` parts of the batch, whole units shuffled with the step's
        seed (the whole batch, in order, with one)."""
        if self.hp.mini_batches == 1:
            return [full]
        units = full.real.shape[0] // full.group
        gen = torch.Generator().manual_seed(step_seed(self.hp.seed, self.updates) + epoch)
        order = torch.randperm(units, generator=gen).tolist()
        m = min(self.hp.mini_batches, units)
        return [full.take(sorted(order[i::m])) for i in range(m)]

    def slices(self, B: int, group: int) -> list[slice]:
        """Micro-batch row ranges; with per-prompt image rows they hold whole groups."""
        size = self.hp.micro_batch_size or B
        size = -(-size // group) * group  # round up to a multiple of the group
        return [slice(i, min(i + size, B)) for i in range(0, B, max(size, 1))]

    def _cut(self, view: View) -> list[tuple[View, slice]]:
        """Micro-batches of ``view``: by ``micro_batch_tokens`` when set, else by rows."""
        hp = self.hp
        if hp.micro_batch_tokens:
            subs = token_micro_batches(
                view, hp.micro_batch_tokens, hp.micro_batch_size, hp.pack_sequences
            )
            return [(sub, slice(0, sub.real.shape[0])) for sub in subs]
        return [(view, rows) for rows in self.slices(view.real.shape[0], view.group)]

    def micro_batches(self, full: View) -> tuple[list[Micro], Micro | None]:
        """This rank's micro-batches (the whole batch's, alone) and the group's filler."""
        rank, world = (0, 1) if self.group is None else (self.group.rank, self.group.world)
        return plan_micro_batches(full, self._cut, rank, world)

    # --- the guarded optimization loop --------------------------------------------------------
    def train(self, full: View, loss_over: Callable[[View], MicroLoss]) -> dict[str, float]:
        """Run ``epochs`` passes of ``mini_batches`` guarded optimizer steps each;
        ``loss_over(mini)`` gives the loss of a micro-batch of the mini-batch ``mini``:
        ``micro_loss(view, rows)`` returns its weighted loss and weighted stats (None when it
        has no real token). Returns the metrics."""
        hp = self.hp
        factor = lr_factor(self.updates, hp.lr_schedule, hp.lr_warmup_steps, hp.lr_decay_steps)
        for m in self.trained:
            for group in m.optimizer.param_groups:  # "initial_lr": the peak, as torch's keep it
                group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor
        done: list[dict[str, float]] = []
        attempt: dict[str, float] = {}
        skipped = False
        before: list[list[Tensor]] | None = None  # the weights before this call's last step
        steps = [(e, i, mini) for e in range(hp.epochs) for i, mini in enumerate(self.mini_batches(full, e))]  # fmt: skip
        with seeded(step_seed(hp.seed, self.updates), self.device):
            for epoch, i, mini in steps:
                self._zero_grad()
                attempt = {}
                where = f"in update {self.updates + 1}, epoch {epoch + 1}" + (
                    f", mini-batch {i + 1}" if hp.mini_batches > 1 else ""
                )
                micros, filler = self.micro_batches(mini)
                try:
                    norms = self._accumulate(micros, filler, loss_over(mini), attempt)
                except _NonFinite as bad:  # after a step of this call: that step caused it
                    done = [] if before is not None else done
                    self._skip(f"non-finite {bad} {where}", undo=before)
                    skipped = True
                    break
                before = copy_weights(self.trained, into=before)
                self._optimizer_step(norms)
                if not weights_finite(self.trained, self.group):
                    done = []
                    self._skip(f"non-finite weights after the optimizer step {where}", before)
                    skipped = True
                    break
                done.append(attempt)
        self._zero_grad()  # free the gradients' memory until the next call
        self.updates += 1
        # the mean over the epochs that stepped; with none, what the skipped attempt reached
        rows = done or [attempt]
        keys = [*self.metric_keys, *hp.loss_terms]
        metrics = {k: sum(r.get(k, math.nan) for r in rows) / len(rows) for k in keys}
        metrics["skipped_nonfinite"] = float(skipped)
        metrics.update(self.response_stats)  # the share cut at max_new_tokens, if told
        metrics["lr"] = self.lr(0)
        return metrics

    def _accumulate(
        self,
        micros: list[Micro],
        filler: Micro | None,
        micro_loss: MicroLoss,
        stats: dict[str, float],
    ) -> list[Tensor]:
        """Backward over every micro-batch; return the finite gradient norm of each model.

        In a group every rank runs as many backward passes (fillers where it has no rows),
        agrees on a non-finite value before any backward (one all-reduce per micro-batch),
        and sums its stats with the others'."""
        group = self.group
        for micro in micros:
            got, bad = None, ""
            try:
                got = micro_loss(micro.view, micro.rows)
                if got is None and filler is not None:  # a backward is due all the same
                    micro = filler
                    got = micro_loss(micro.view, micro.rows)
                if got is not None and not bool(torch.isfinite(got[0])):
                    bad = "loss"
            except _NonFinite as why:
                bad = str(why)
            if group is not None and group.any_flag(bool(bad)) and not bad:
                bad = "values on another rank"
            if bad:
                raise _NonFinite(bad)
            if got is None:
                continue
            loss, micro_stats = got
            (loss if micro.grad_scale == 1.0 else loss * micro.grad_scale).backward()
            for k, v in micro_stats.items():
                stats[k] = stats.get(k, 0.0) + micro.stat_scale * v
        if group is not None:  # the per-micro-batch stats, in a fixed order
            keys = [k for k in self.metric_keys if not k.endswith("grad_norm")]
            keys += self.hp.loss_terms
            stats.update(zip(keys, group.all_sum([stats.get(k, 0.0) for k in keys])))
        norms = []
        for m in self.trained:
            grads = [p.grad for p in m.params if p.grad is not None]
            norm = (
                torch.nn.utils.get_total_norm(grads)
                if grads
                else torch.zeros((), device=self.device)
            )  # ()
            stats[m.metric] = float(_full(norm))
            if not math.isfinite(stats[m.metric]):
                raise _NonFinite(f"gradient of the {m.what} (norm {stats[m.metric]})")
            norms.append(norm)
        return norms

    def _optimizer_step(self, norms: list[Tensor]) -> None:
        """One optimizer step per trained model, gradients clipped to ``max_grad_norm``."""
        for m, norm in zip(self.trained, norms):
            if self.hp.max_grad_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(m.params, self.hp.max_grad_norm, norm)
            m.optimizer.step()

    def _skip(self, what: str, undo: list[list[Tensor]] | None) -> None:
        """Drop the step that found a non-finite value: put back the weights from before this
        call's last optimizer step (``undo``: that step led to it), then warn or raise
        (``on_nonfinite``). The optimizer's moments keep that step's (finite) gradient."""
        self._zero_grad()
        if undo is not None:
            restore_weights(self.trained, undo)
            what += (
                f"; the optimizer step that led to it (lr {self.lr(0):g}) was undone: lower lr "
                "or set max_grad_norm"
            )
        if self.hp.on_nonfinite == "raise":
            raise NonFiniteError(
                f"{self.where}: {what}; no step was kept (on_nonfinite='skip' skips such "
                "steps; lower lr or check the inputs)"
            )
        log.warning("%s: %s; step skipped", self.where, what)

    def _zero_grad(self) -> None:
        for m in self.trained:
            m.optimizer.zero_grad(set_to_none=True)

    def lr(self, model: int) -> float:
        """The learning rate the last step of model ``model`` took (in training order)."""
        return float(self.trained[model].optimizer.param_groups[0]["lr"])

    # --- the device, when roles take turns on it: a group's shards -----------------------------
    def switch(self, off: bool) -> int:
        """Offload (``off``) or reload a group's state, this rank's own shards (FSDP2
        DTensors, which a move of ``.data`` would break); every rank does it alike.
        Idempotent. DDP keeps its state where it is: its reducer holds the parameters and
        their gradient buckets on the device."""
        if self.group is None or self.backend == "ddp" or self.shards_off == off:
            return 0
        self._on_every_rank("offload" if off else "reload")
        copy = offload_module.ALWAYS_COPY
        moved = sum(self.group.move(m.module, m.optimizer, off, copy) for m in self.trained)
        self.shards_off = off
        return moved

    # --- state --------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Each model and optimizer (unsharded, in the 1-rank layout: any K loads it) and
        ``updates``; in a group, gathered on rank 0 (the others' models and optimizers are
        empty)."""
        if self.group is not None:
            self._on_every_rank("gathering the state")
            self.switch(off=False)  # gathered from the device the group formed on
        state: dict[str, Any] = {}
        for m in self.trained:
            if self.group is None:
                state[m.key] = snapshot(m.module)
                state[m.optim_key] = copy.deepcopy(m.optimizer.state_dict())
            else:
                state[m.key], state[m.optim_key] = self.group.full_state(m.module, m.optimizer)
        return {**state, "updates": self.updates}

    def load(self, state: Mapping[str, Any]) -> None:
        """Load a :meth:`state` (written with any K) into every rank: given on rank 0, its
        outline (every tensor None) on the others."""
        fresh = {  # optimizers with no step yet: their settings, which every rank applies
            m.optim_key: [
                {k: v for k, v in g.items() if k != "params"}
                for g in state[m.optim_key]["param_groups"]
            ]
            for m in self.trained
            if not state[m.optim_key].get("state")
        }
        if self.group is not None:
            self._on_every_rank("loading the state")
            self.switch(off=False)
        for m in self.trained:
            # a copy: torch's optimizer keeps the given tensors (Adam's step, and its moments
            # where dtype and device match), and its steps would then change ``state``
            optim = copy.deepcopy(state.get(m.optim_key, {}))
            if self.group is None:
                m.module.load_state_dict(state[m.key])
                m.optimizer.load_state_dict(optim)
            else:
                weights, settings = state.get(m.key) or {}, fresh.get(m.optim_key)
                self.group.load_full_state(m.module, m.optimizer, weights, optim, settings)
        self.updates = int(state["updates"])


def snapshot(module: nn.Module) -> dict[str, Tensor]:
    """A CPU copy of the state dict, so later optimizer steps cannot change it."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
