"""An update's guarded optimization loop: epochs of mini-batches, each one optimizer step over
its micro-batches' accumulated gradients, a step that leads to a non-finite value undone
(:mod:`nodes.update.guard`), and the learning-rate schedule (:mod:`nodes.update.schedule`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import Tensor

from nodes.seeding import seeded, step_seed
from nodes.update.guard import copy_weights, restore_weights, weights_finite
from nodes.update.micro import Micro, View
from nodes.update.ranked import NonFiniteError
from nodes.update.schedule import lr_factor

__all__ = ["MicroLoss"]

log = logging.getLogger(__name__)

MicroLoss = Callable[[View, slice], tuple[Tensor, dict[str, float]] | None]
"""A micro-batch's weighted loss and stats from its view and rows (None: no real token)."""


class _NonFinite(Exception):
    """Raised inside a step when a model output, the loss or a gradient is not finite."""


class _Loop:
    """The optimization loop of :class:`nodes.update.base._Update` (a mixin: the node holds
    the models, their optimizers in ``_trained`` and the rank group)."""

    # --- the guarded optimization step ---------------------------------------------------
    def _zero_grad(self) -> None:
        for _, _, _, opt in self._trained:
            opt.zero_grad(set_to_none=True)

    def _stat_keys(self) -> list[str]:
        """The per-micro-batch stats, in a fixed order (what a group all-reduces)."""
        keys = [k for k in self._metric_keys if not k.endswith("grad_norm")]
        return keys + (["kl_ref"] if self.kl_coef > 0 else [])

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _optimizer_step(self, norms: list[Tensor]) -> None:
        """One optimizer step per trained model, gradients clipped to ``max_grad_norm``."""
        for (_, _, params, opt), norm in zip(self._trained, norms):
            if self.max_grad_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm)
            opt.step()

    def _skip(self, what: str, undo: list[list[Tensor]] | None) -> None:
        """Drop the step that found a non-finite value: put back the weights from before this
        call's last optimizer step (``undo``: that step led to it), then warn or raise
        (``on_nonfinite``). The optimizer's moments keep that step's (finite) gradient."""
        self._zero_grad()
        if undo is not None:
            restore_weights(self._trained, undo)
            what += (
                f"; the optimizer step that led to it (lr {self._lr():g}) was undone: lower lr "
                "or set max_grad_norm"
            )
        if self.on_nonfinite == "raise":
            raise NonFiniteError(
                f"node {self.name!r}: {what}; no step was kept (on_nonfinite='skip' skips such "
                "steps; lower lr or check the inputs)"
            )
        log.warning("node %r: %s; step skipped", self.name, what)

    def _train(self, full: View, loss_over: Callable[[View], MicroLoss]) -> dict[str, float]:
        """Run ``epochs`` passes of ``mini_batches`` guarded optimizer steps each;
        ``loss_over(mini)`` gives the loss of a micro-batch of the mini-batch ``mini``:
        ``micro_loss(view, rows)`` returns its weighted loss and weighted stats (None when it
        has no real token). Returns the metrics."""
        factor = lr_factor(self.updates, *self._schedule)
        for _, _, _, opt in self._trained:
            for group in opt.param_groups:  # "initial_lr": the peak, as torch's schedulers keep it
                group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor
        done: list[dict[str, float]] = []
        attempt: dict[str, float] = {}
        skipped = False
        before: list[list[Tensor]] | None = None  # the weights before this call's last step
        steps = [(e, i, mini) for e in range(self.epochs) for i, mini in enumerate(self._mini_batches(full, e))]  # fmt: skip
        with seeded(step_seed(self.seed, self.updates), self.device):
            for epoch, i, mini in steps:
                self._zero_grad()
                attempt = {}
                where = f"in update {self.updates + 1}, epoch {epoch + 1}" + (
                    f", mini-batch {i + 1}" if self.mini_batches > 1 else ""
                )
                micros, filler = self._micro_batches(mini)
                try:
                    norms = self._accumulate(micros, filler, loss_over(mini), attempt)
                except _NonFinite as bad:  # after a step of this call: that step caused it
                    done = [] if before is not None else done
                    self._skip(f"non-finite {bad} {where}", undo=before)
                    skipped = True
                    break
                before = copy_weights(self._trained, into=before)
                self._optimizer_step(norms)
                if not weights_finite(self._trained, self._ranks):
                    done = []
                    self._skip(f"non-finite weights after the optimizer step {where}", before)
                    skipped = True
                    break
                done.append(attempt)
        self._zero_grad()  # free the gradients' memory until the next call
        self.updates += 1
        # the mean over the epochs that stepped; with none, what the skipped attempt reached
        rows = done or [attempt]
        keys = [*self._metric_keys, *(["kl_ref"] if self.kl_coef > 0 else [])]
        metrics = {k: sum(r.get(k, math.nan) for r in rows) / len(rows) for k in keys}
        metrics["skipped_nonfinite"] = float(skipped)
        metrics.update(self._response_stats)  # the share cut at max_new_tokens, if told
        metrics["lr"] = self._lr()
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
        group = self._ranks
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
        if group is not None:
            keys = self._stat_keys()
            stats.update(zip(keys, group.all_sum([stats.get(k, 0.0) for k in keys])))
        norms = []
        for metric, who, params, _ in self._trained:
            grads = [p.grad for p in params if p.grad is not None]
            norm = (
                torch.nn.utils.get_total_norm(grads)
                if grads
                else torch.zeros((), device=self.device)
            )  # ()
            stats[metric] = float(_full(norm))
            if not math.isfinite(stats[metric]):
                raise _NonFinite(f"gradient of the {who} (norm {stats[metric]})")
            norms.append(norm)
        return norms


def _full(norm: Tensor) -> Tensor:
    """A total norm as a plain tensor (FSDP's is a DTensor that still needs its reduction)."""
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm
