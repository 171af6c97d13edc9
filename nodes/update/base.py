"""What the PPO and GRPO updates share: input checks, micro-batches, the guarded step and
the published weights (see :mod:`nodes.update` for the behaviour they have in common)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from nodes.models.policy import Policy, PromptBatch, build_policy, check_policy_spec
from nodes.reference import _prompt_batch
from nodes.rl.losses import (
    logprobs_from_logits,
    token_entropy_from_logits,
)
from nodes.rl.masked import _check_finite
from nodes.rollout import _step_seed
from nodes.shared_models import Sharing, check_share_key, fingerprint
from nodes.sync import WeightUpdate
from yatt_graph import ANY, BatchPolicy, Node, Port
from yatt_graph import Tensor as TensorPort
from yatt_graph.node import Built

__all__: list[str] = []  # private: the updates are public in nodes.update

log = logging.getLogger(__name__)

_TOKENS = TensorPort("float32", "B", "R")
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
_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


class _NonFinite(Exception):
    """Raised inside a step when a model output, the loss or a gradient is not finite."""


def _snapshot(module: nn.Module) -> dict[str, Tensor]:
    """A CPU copy of the state dict, so later optimizer steps cannot change it."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def _weights(module: nn.Module, shared: bool) -> dict[str, Tensor]:
    """What an update publishes: a snapshot, or, when the module is shared with its consumers
    in this process (on-policy only), its live tensors (they skip loading their own storage)."""
    if shared:
        return {k: v.detach() for k, v in module.state_dict().items()}
    return _snapshot(module)


def _item(x: Tensor) -> float:
    return float(x.detach())


def _require_finite(what: str, x: Tensor, real: Tensor) -> None:
    if not bool(torch.isfinite(x[real]).all()):
        raise _NonFinite(what)


class _Update(Sharing, Node):
    """What PPO and GRPO updates share: input checks, micro-batches, the guarded step, weights."""

    kind = "update"
    _metric_keys: tuple[str, ...] = ()
    # an update must see its whole batch: two halves on two devices would be two updates
    batch_policy = BatchPolicy(splittable=False)
    policy = Built("the policy this node trains, built from the ``policy`` spec by setup()")
    optimizer = Built("the policy's AdamW")
    _trained = Built("(metric name, what it is in messages, parameters, optimizer) per model")

    # --- construction --------------------------------------------------------------------
    def _init_common(
        self,
        policy: str | Mapping[str, Any],
        lr: float,
        weight_decay: float,
        clip_eps: float,
        clip_eps_high: float | None,
        entropy_coef: float,
        kl_coef: float,
        epochs: int,
        micro_batch_size: int,
        max_grad_norm: float | None,
        temperature: float,
        seed: int,
        device: str,
        on_nonfinite: str,
        share: str | None = None,
    ) -> None:
        where = f"node {self.name!r}"
        checks = [
            (lr > 0, f"lr={lr}; it must be > 0"),
            (weight_decay >= 0, f"weight_decay={weight_decay}; it must be >= 0"),
            (0 < clip_eps < 1, f"clip_eps={clip_eps}; it must be in (0, 1)"),
            (
                clip_eps_high is None or clip_eps_high > 0,
                f"clip_eps_high={clip_eps_high}; it must be > 0 (or None for clip_eps)",
            ),
            (entropy_coef >= 0, f"entropy_coef={entropy_coef}; it must be >= 0"),
            (kl_coef >= 0, f"kl_coef={kl_coef}; it must be >= 0 (0 disables the KL term)"),
            (int(epochs) >= 1, f"epochs={epochs}; it must be >= 1"),
            (int(micro_batch_size) >= 0, f"micro_batch_size={micro_batch_size}; 0 = whole batch"),
            (
                max_grad_norm is None or max_grad_norm >= 0,
                f"max_grad_norm={max_grad_norm}; it must be >= 0 (0 or None: no clipping)",
            ),
            (temperature > 0, f"temperature={temperature}; it must be > 0 (the rollout's)"),
            (
                on_nonfinite in ("skip", "error"),
                f"on_nonfinite={on_nonfinite!r}; choose 'skip' or 'error'",
            ),
        ]
        for ok, why in checks:
            if not ok:
                raise ValueError(f"{where}: {why}")
        self.lr = float(lr)
        self.clip_eps = float(clip_eps)
        self.clip_eps_high = None if clip_eps_high is None else float(clip_eps_high)
        self.entropy_coef = float(entropy_coef)
        self.kl_coef = float(kl_coef)
        self.epochs = int(epochs)
        self.micro_batch_size = int(micro_batch_size)
        self.max_grad_norm = float(max_grad_norm or 0.0)
        self.temperature = float(temperature)
        self.seed = int(seed)
        self.on_nonfinite = on_nonfinite
        self.device = torch.device(device)
        check_policy_spec(policy)
        self.policy_spec = policy
        self.share = check_share_key(share, where)
        self.weight_decay = float(weight_decay)
        self.version = 0
        self.updates = 0

    def build(self) -> None:
        self.policy = self._acquire(
            self.share,
            fingerprint("policy", self.policy_spec, self.device),
            lambda: build_policy(self.policy_spec).to(self.device),
        ).eval()
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

    def _slices(self, B: int, group: int) -> list[slice]:
        """Micro-batch row ranges; with per-prompt image rows they hold whole groups."""
        size = self.micro_batch_size or B
        size = -(-size // group) * group  # round up to a multiple of the group
        return [slice(i, min(i + size, B)) for i in range(0, B, size)]

    def _prompt_batch(
        self,
        policy: Policy,
        t: dict[str, Tensor],
        rows: slice,
        group: int,
        image_embeds: Tensor | None,
        images: Any,
    ) -> PromptBatch:
        """The policy's batch for rows ``rows`` (image inputs repeated as reference.py does)."""
        prompts = slice(rows.start // group, rows.stop // group)  # rows of the image inputs
        embeds = None if image_embeds is None else image_embeds[prompts].to(self.device)
        imgs = None if images is None else list(images[prompts])
        return _prompt_batch(
            self, policy, t["prompt_ids"][rows], t["prompt_mask"][rows], embeds, imgs
        )

    # --- model terms ---------------------------------------------------------------------
    def _policy_terms(
        self, batch: PromptBatch, ids: Tensor, mask: Tensor, real: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Teacher-forced logprobs of ``logits / T`` and per-token entropy, both float[b, R]."""
        logits = self.policy.forward_response(batch, ids, mask).logits  # (b, R, V)
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

    def _train(
        self,
        slices: list[slice],
        micro_loss: Callable[[slice], tuple[Tensor, dict[str, float]] | None],
    ) -> dict[str, float]:
        """Run ``epochs`` guarded steps; ``micro_loss(rows)`` returns the micro-batch's weighted
        loss and weighted stats (None when it has no real token). Returns the metrics."""
        done: list[dict[str, float]] = []
        attempt: dict[str, float] = {}
        skipped = False
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(_step_seed(self.seed, self.updates))
            for epoch in range(self.epochs):
                self._zero_grad()
                attempt = {}
                try:
                    norms = self._accumulate(slices, micro_loss, attempt)
                except _NonFinite as bad:
                    self._zero_grad()
                    what = f"non-finite {bad} in update {self.updates + 1}, epoch {epoch + 1}"
                    if self.on_nonfinite == "error":
                        raise ValueError(
                            f"node {self.name!r}: {what}; no step was taken (on_nonfinite="
                            "'skip' skips such steps; lower lr or check the inputs)"
                        ) from None
                    log.warning("node %r: %s; step skipped", self.name, what)
                    skipped = True
                    break
                for (_, _, params, opt), norm in zip(self._trained, norms):
                    if self.max_grad_norm > 0:
                        torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm)
                    opt.step()
                done.append(attempt)
        self._zero_grad()  # free the gradients' memory until the next call
        self.updates += 1
        # the mean over the epochs that stepped; with none, what the skipped attempt reached
        rows = done or [attempt]
        keys = [*self._metric_keys, *(["kl_ref"] if self.kl_coef > 0 else [])]
        metrics = {k: sum(r.get(k, math.nan) for r in rows) / len(rows) for k in keys}
        metrics["skipped_nonfinite"] = float(skipped)
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        return metrics

    def _accumulate(
        self,
        slices: list[slice],
        micro_loss: Callable[[slice], tuple[Tensor, dict[str, float]] | None],
        stats: dict[str, float],
    ) -> list[Tensor]:
        """Backward over every micro-batch; return the finite gradient norm of each model."""
        for rows in slices:
            got = micro_loss(rows)
            if got is None:
                continue
            loss, micro_stats = got
            if not bool(torch.isfinite(loss)):
                raise _NonFinite("loss")
            loss.backward()
            for k, v in micro_stats.items():
                stats[k] = stats.get(k, 0.0) + v
        norms = []
        for metric, who, params, _ in self._trained:
            grads = [p.grad for p in params if p.grad is not None]
            norm = (
                torch.nn.utils.get_total_norm(grads)
                if grads
                else torch.zeros((), device=self.device)
            )  # ()
            stats[metric] = float(norm)
            if not math.isfinite(stats[metric]):
                raise _NonFinite(f"gradient of the {who} (norm {stats[metric]})")
            norms.append(norm)
        return norms

    def _publish(self) -> WeightUpdate:
        self.version += 1
        return WeightUpdate(_weights(self.policy, self._is_shared(self.share)), self.version)

    # --- state ---------------------------------------------------------------------------
    def _load_checked(self, state: Mapping[str, Any], keys: set[str]) -> None:
        if set(state) != keys:
            raise ValueError(
                f"node {self.name!r}: expected state keys {sorted(keys)}, got {sorted(state)}"
            )
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.updates = int(state["updates"])
