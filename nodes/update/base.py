"""What the PPO and GRPO updates share: input checks, micro-batches, the guarded step and
the published weights (see :mod:`nodes.update` for the behaviour they have in common)."""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from nodes.models.offload import Offload
from nodes.models.policy import Policy, PromptBatch, build_policy, check_policy_spec
from nodes.models.sampling import temperature_problem
from nodes.reference import _prompt_batch
from nodes.rl.losses import (
    logprobs_from_logits,
    token_entropy_from_logits,
)
from nodes.rl.masked import _check_finite
from nodes.seeding import seeded, step_seed
from nodes.shared_models import Sharing, check_share_key, fingerprint
from nodes.update.guard import copy_weights, restore_weights, weights_finite
from nodes.update.ranked import NonFiniteError, _Ranked
from nodes.update.micro import Micro, View, plan_micro_batches
from yatt_graph import ANY, BatchPolicy, Node, Port
from yatt_graph import Tensor as TensorPort
from yatt_graph.node import Built

__all__ = ["NonFiniteError"]  # the updates themselves are public in nodes.update

log = logging.getLogger(__name__)

_TOKENS = TensorPort("float32", "B", "R")
TRAIN_BACKENDS = ("fsdp", "ddp")
"""How a rank group trains the models: FSDP2 (sharded) or DDP (replicated); runtime.ranks."""

_INPUTS = {
    "prompt_ids": TensorPort("int64", "B", "P"),
    "prompt_mask": TensorPort("int64", "B", "P"),
    "response_ids": TensorPort("int64", "B", "R"),
    "response_mask": _TOKENS,
    "logprobs": Port(_TOKENS, doc="sampling-policy logprobs, from the rollout"),
    "advantages": _TOKENS,
    "ref_logprobs": Port(_TOKENS, required=False, doc="needed when kl_coef > 0"),
    "image_embeds": Port(TensorPort("float32", "N", "D"), required=False, doc="PrefixVLM"),
    "images": Port(ANY, required=False, doc="list[PIL.Image] (HF VLMs)"),
}


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
"""The largest learning rate an optimizer step can apply (larger ones do not convert)."""


class _NonFinite(Exception):
    """Raised inside a step when a model output, the loss or a gradient is not finite."""


def _item(x: Tensor) -> float:
    return float(x.detach())


def _require_finite(what: str, x: Tensor, real: Tensor) -> None:
    if not bool(torch.isfinite(x[real]).all()):
        raise _NonFinite(what)


class _Update(Offload, _Ranked, Sharing, Node):
    """What PPO and GRPO updates share: input checks, micro-batches, the guarded step, weights,
    and the rank group (``ranks > 1``: ``runtime.ranks``)."""

    kind = "update"
    _metric_keys: tuple[str, ...] = ()
    # an update must see its whole batch: two halves on two devices would be two updates
    batch_policy = BatchPolicy(splittable=False)
    policy = Built("the policy this node trains, built from the ``policy`` spec by setup()")
    optimizer = Built("the policy's AdamW")
    _trained = Built("(metric name, what it is in messages, parameters, optimizer) per model")

    # --- construction --------------------------------------------------------------------
    def _init_common(self) -> None:
        """Check and keep the options every update takes, read from the constructor's arguments
        (given or default): PPO's and GRPO's constructors name them alike."""
        args, kwargs = self._init_args
        bound = inspect.signature(type(self)).bind(*args, **kwargs)
        bound.apply_defaults()
        o = SimpleNamespace(**bound.arguments)
        where = f"node {self.name!r}"
        hot = temperature_problem(o.temperature, greedy=False)
        checks = [
            (0 < o.lr <= _FLOAT32_MAX, f"lr={o.lr}; it must be > 0 and fit float32"),
            (o.weight_decay >= 0, f"weight_decay={o.weight_decay}; it must be >= 0"),
            (0 < o.clip_eps < 1, f"clip_eps={o.clip_eps}; it must be in (0, 1)"),
            (
                o.clip_eps_high is None or o.clip_eps_high > 0,
                f"clip_eps_high={o.clip_eps_high}; it must be > 0 (or None for clip_eps)",
            ),
            (o.entropy_coef >= 0, f"entropy_coef={o.entropy_coef}; it must be >= 0"),
            (o.kl_coef >= 0, f"kl_coef={o.kl_coef}; it must be >= 0 (0 disables the KL term)"),
            (int(o.epochs) >= 1, f"epochs={o.epochs}; it must be >= 1"),
            (
                int(o.micro_batch_size) >= 0,
                f"micro_batch_size={o.micro_batch_size}; 0 = whole batch",
            ),
            (
                o.max_grad_norm is None or o.max_grad_norm >= 0,
                f"max_grad_norm={o.max_grad_norm}; it must be >= 0 (0 or None: no clipping)",
            ),
            (hot is None, f"{hot} (the rollout's)"),
            (
                o.on_nonfinite in ("raise", "skip"),
                f"on_nonfinite={o.on_nonfinite!r}; choose 'raise' or 'skip' (as on_bad_sample)",
            ),
            (
                isinstance(o.ranks, int) and not isinstance(o.ranks, bool) and o.ranks >= 1,
                f"ranks={o.ranks!r}; it must be an int >= 1 (the processes that train together)",
            ),
            (
                o.train_backend in TRAIN_BACKENDS,
                f"train_backend={o.train_backend!r}; choose one of {', '.join(TRAIN_BACKENDS)}",
            ),
            (o.rank_timeout_s > 0, f"rank_timeout_s={o.rank_timeout_s}; it must be > 0"),
        ]
        for ok, why in checks:
            if not ok:
                raise ValueError(f"{where}: {why}")
        self.lr = float(o.lr)
        self.clip_eps = float(o.clip_eps)
        self.clip_eps_high = None if o.clip_eps_high is None else float(o.clip_eps_high)
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        self._clip = (self.clip_eps, high)  # the ratio's clip range below and above 1
        self.entropy_coef = float(o.entropy_coef)
        self.kl_coef = float(o.kl_coef)
        self.epochs = int(o.epochs)
        self.micro_batch_size = int(o.micro_batch_size)
        self.max_grad_norm = float(o.max_grad_norm or 0.0)
        self.temperature = float(o.temperature)
        self.seed = int(o.seed)
        self.on_nonfinite = o.on_nonfinite
        self.device = torch.device(o.device)
        check_policy_spec(o.policy)
        self.policy_spec = o.policy
        self.share = check_share_key(o.share, where)
        self.weight_decay = float(o.weight_decay)
        self.ranks = int(o.ranks)
        self.train_backend = o.train_backend
        self.rank_timeout_s = float(o.rank_timeout_s)
        self.version = 0
        self.updates = 0

    # --- the device, when roles take turns on it (nodes/models/offload.py) -------------------
    def offload(self) -> int:
        """Off the device, alone; with ``ranks > 1`` the state stays: it is sharded over K
        processes (FSDP2's parameters are DTensors, which a move of ``.data`` would break)."""
        return 0 if self.ranks > 1 else super().offload()

    def reload(self) -> int:
        return 0 if self.ranks > 1 else super().reload()

    def claim(self) -> None:
        if self.ranks == 1:
            super().claim()

    def build(self) -> None:
        if self.ranks > 1:
            self._join_ranks()
            policy = build_policy(self.policy_spec).to(self.device).eval()
            self._ranks.join()
            self.policy = policy
            self._policy_logits = self._shard(policy, "forward_response", lambda out: out.logits)
        else:
            self.policy = self._acquire(
                self.share,
                fingerprint("policy", self.policy_spec, self.device),
                lambda: build_policy(self.policy_spec).to(self.device),
            ).eval()
            self._policy_logits = lambda *args: self.policy.forward_response(*args).logits
        if any(p.dtype == torch.float16 for p in self.policy.parameters() if p.requires_grad):
            raise ValueError(
                f"node {self.name!r}: the policy to train has float16 weights; AdamW on float16 "
                "weights with no loss scaler overflows (its eps, 1e-8, is 0 in float16) and "
                "every step would be undone: train in bfloat16 or float32 (float16 serves "
                "inference: the rollout and the reference)"
            )
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=self.lr, weight_decay=self.weight_decay
        )
        # stepped in this order
        self._trained: list[tuple[str, str, list[nn.Parameter], torch.optim.Optimizer]] = [
            ("grad_norm", "policy", list(self.policy.parameters()), self.optimizer)
        ]

    # --- inputs ----------------------------------------------------------------------------
    def _check_inputs(
        self, tensors: dict[str, Tensor | None], image_embeds: Tensor | None, images: Any
    ) -> tuple[dict[str, Tensor], Tensor, int]:
        """Move the token tensors to the device and check them.

        Returns the tensors, the real-token mask (bool[B, R]) and the number of responses per
        image row (``B // N`` when image inputs come one per prompt, else 1).
        """
        where = f"node {self.name!r}"
        if self.kl_coef > 0 and tensors.get("ref_logprobs") is None:
            raise ValueError(
                f"{where}: kl_coef={self.kl_coef} needs the 'ref_logprobs' input connected "
                "(from a ReferenceLogprobs node), or set kl_coef=0"
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
            N = len(value)
            if N == 0 or B % N != 0:
                raise ValueError(
                    f"{where}: input {port!r} has {N} rows for {B} responses; give one per "
                    "response or one per prompt (B must be a multiple of it)"
                )
            group = B // N
        return out, real, group

    def _checked_view(self, inputs: Mapping[str, Any]) -> View:
        """The call's inputs, checked, as the whole batch's :class:`View`."""
        image_embeds, images = inputs.get("image_embeds"), inputs.get("images")
        tensors = {k: v for k, v in inputs.items() if k not in ("image_embeds", "images")}
        t, real, group = self._check_inputs(tensors, image_embeds, images)
        return View(t, real, image_embeds, images, group)

    def _slices(self, B: int, group: int) -> list[slice]:
        """Micro-batch row ranges; with per-prompt image rows they hold whole groups."""
        size = self.micro_batch_size or B
        size = -(-size // group) * group  # round up to a multiple of the group
        return [slice(i, min(i + size, B)) for i in range(0, B, max(size, 1))]

    def _micro_batches(self, full: View) -> tuple[list[Micro], Micro | None]:
        """This rank's micro-batches (the whole batch's, alone) and the group's filler."""
        rank, world = (0, 1) if self._ranks is None else (self._ranks.rank, self._ranks.world)
        return plan_micro_batches(full, lambda b: self._slices(b, full.group), rank, world)

    def _prompt_batch(self, policy: Policy, view: View, rows: slice) -> PromptBatch:
        """The policy's batch for rows ``rows`` (image inputs repeated as reference.py does)."""
        group = view.group
        prompts = slice(rows.start // group, rows.stop // group)  # rows of the image inputs
        embeds = None if view.image_embeds is None else view.image_embeds[prompts]
        imgs = None if view.images is None else list(view.images[prompts])
        t = view.t
        return _prompt_batch(
            self,
            policy,
            t["prompt_ids"][rows],
            t["prompt_mask"][rows],
            None if embeds is None else embeds.to(self.device),
            imgs,
        )

    # --- model terms ---------------------------------------------------------------------
    def _policy_terms(
        self, batch: PromptBatch, ids: Tensor, mask: Tensor, real: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Teacher-forced logprobs of ``logits / T`` and per-token entropy, both float[b, R]."""
        logits = self._policy_logits(batch, ids, mask)  # (b, R, V)
        if self.temperature != 1.0:
            logits = logits / self.temperature  # (b, R, V)
        logprobs = logprobs_from_logits(logits, ids, mask).float()  # (b, R)
        _require_finite("policy logprobs", logprobs, real)
        if self.entropy_coef > 0:
            entropy = token_entropy_from_logits(logits, mask)  # (b, R)
        else:
            with torch.no_grad():
                entropy = token_entropy_from_logits(logits.detach(), mask)  # (b, R)
        return logprobs, entropy.float()

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

    def _train(
        self,
        full: View,
        micro_loss: Callable[[View, slice], tuple[Tensor, dict[str, float]] | None],
    ) -> dict[str, float]:
        """Run ``epochs`` guarded steps; ``micro_loss(view, rows)`` returns the micro-batch's
        weighted loss and weighted stats (None when it has no real token). Returns the metrics."""
        micros, filler = self._micro_batches(full)
        done: list[dict[str, float]] = []
        attempt: dict[str, float] = {}
        skipped = False
        before: list[list[Tensor]] | None = None  # the weights before this call's last step
        with seeded(step_seed(self.seed, self.updates), self.device):
            for epoch in range(self.epochs):
                self._zero_grad()
                attempt = {}
                where = f"in update {self.updates + 1}, epoch {epoch + 1}"
                try:
                    norms = self._accumulate(micros, filler, micro_loss, attempt)
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
        metrics["lr"] = self._lr()
        return metrics

    def _accumulate(
        self,
        micros: list[Micro],
        filler: Micro | None,
        micro_loss: Callable[[View, slice], tuple[Tensor, dict[str, float]] | None],
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
