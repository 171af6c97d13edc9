"""Update nodes: one PPO or GRPO optimization step per batch, publishing versioned weights.

* :class:`PPOUpdate`: clipped policy loss (``nodes.rl.losses.ppo_policy_loss``), clipped value loss
  on a separate critic (``value_loss``), an optional entropy bonus and an optional k3
  KL-to-reference loss term. Trains its own copy of the policy and its own value model, built
  from the same specs as the rollout and critic nodes so that all start identical, and emits
  their weights for those nodes' ``weights`` inputs.
* :class:`GRPOUpdate`: ``nodes.rl.losses.grpo_loss`` (group advantages, no critic).

Each call runs ``epochs`` optimizer steps over the whole batch. With ``micro_batch_size > 0``
the batch is cut into micro-batches whose gradients are accumulated before each step; every
micro-batch loss is weighted by its share of the batch's real tokens (token-mean terms) or of
its non-empty samples (seq-mean-token-mean terms), so the accumulated gradient equals the
full-batch gradient (up to float rounding). When image inputs come one row per prompt (B = N *
n), micro-batches hold whole groups of n rows (the size is rounded up to a multiple of n).
Gradients are freed after the last step of a call. Every call publishes new weight versions,
also when its steps were skipped.

A non-finite policy logprob, value, loss or gradient (norm) skips the step: gradients are
zeroed, no optimizer steps, ``metrics["skipped_nonfinite"]`` is 1.0 and the remaining epochs
of the call are dropped (they would see the same batch and weights as the failed one). With
``on_nonfinite="error"`` a ValueError names the node and the quantity instead. Non-finite
*inputs* (advantages, returns, ...) at real tokens are bad data and always a ValueError.

The models run in eval mode (dropout off), as the rollout samples: a PPO ratio must compare the
very function that sampled the tokens.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from nodes.models.policy import Policy, PromptBatch, build_policy
from nodes.reference import ValueModel, _prompt_batch
from nodes.rl.losses import (
    aggregate_token_loss,
    grpo_loss,
    kl_loss,
    logprobs_from_logits,
    ppo_policy_loss,
    token_entropy_from_logits,
    value_loss,
)
from nodes.rl.masked import _check_finite
from nodes.rollout import _step_seed
from nodes.sync import WeightUpdate
from yatt_graph import ANY, BatchPolicy, Node, Port, Resources
from yatt_graph import Tensor as TensorPort

__all__ = ["GRPOUpdate", "PPOUpdate"]

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


def _item(x: Tensor) -> float:
    return float(x.detach())


def _require_finite(what: str, x: Tensor, real: Tensor) -> None:
    if not bool(torch.isfinite(x[real]).all()):
        raise _NonFinite(what)


class _Update(Node):
    """What PPO and GRPO updates share: input checks, micro-batches, the guarded step, weights."""

    kind = "update"
    _metric_keys: tuple[str, ...] = ()
    # an update must see its whole batch: two halves on two devices would be two updates
    batch_policy = BatchPolicy(splittable=False)

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
        self.policy: Policy = build_policy(policy).to(self.device).eval()
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=self.lr, weight_decay=float(weight_decay)
        )
        self.version = 0
        self.updates = 0
        # (metric name, what it is in messages, parameters, optimizer), stepped in this order
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
        return WeightUpdate(_snapshot(self.policy), self.version, complete=True)

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


class PPOUpdate(_Update):
    """PPO on the policy and a separate critic: ``loss = pg + vf_coef * vf - entropy_coef * H
    + kl_coef * KL_k3(pi || pi_ref)``; one AdamW per model.

    Inputs (B responses of up to R tokens, P prompt tokens): the rollout's ``prompt_ids``,
    ``prompt_mask``, ``response_ids``, ``response_mask``, ``logprobs`` (old), the advantage
    node's ``advantages`` and ``returns``, the critic node's ``values`` (old), optionally
    ``ref_logprobs`` (required when ``kl_coef > 0``) and ``image_embeds`` / ``images`` (one
    row per response, or one per prompt: repeated to B).

    Outputs: ``weights`` and ``critic_weights`` (:class:`nodes.sync.WeightUpdate` snapshots of
    the policy's and the value model's state dicts, versions 1, 2, ...; feed them to the
    Rollout's and the Critic's ``weights`` inputs) and ``metrics`` (floats, the mean over the
    call's epochs: loss, pg_loss, vf_loss, entropy, clip_fraction, approx_kl, kl_ref (with
    kl_coef > 0), value_clip_fraction, grad_norm, critic_grad_norm (before clipping), lr,
    critic_lr, skipped_nonfinite).

    Args:
        policy: a :func:`nodes.models.policy.build_policy` spec, the same as the rollout's.
        critic: a spec for the critic trunk, the same as the Critic node's ``critic``.
        detach_trunk, head_seed: as in :class:`nodes.reference.Critic` (with ``detach_trunk``
            only the value head is trained).
        lr, critic_lr: AdamW learning rates (``critic_lr=None``: ``lr``).
        weight_decay: AdamW weight decay of both optimizers.
        clip_eps, clip_eps_high: policy ratio clip range (``clip_eps_high``: DAPO's upper one).
        value_clip_eps: value clip range around the old values; None disables it.
        vf_coef, entropy_coef: weights of the value loss and the entropy bonus.
        kl_coef: weight of the k3 KL-to-reference loss term; 0 disables it (KL in the reward
            is GAEAdvantage's ``kl_coef``).
        epochs: optimizer steps per call, each over the whole batch.
        micro_batch_size: samples per gradient-accumulation micro-batch; 0 = whole batch.
        max_grad_norm: clip each model's gradient norm to this; 0 or None = no clipping.
        temperature: the rollout's sampling temperature (logprobs are of ``logits / T``).
        seed: seeds randomness inside a step (dropout, if a model has any); the global RNG is
            left as it was.
        on_nonfinite: ``"skip"`` or ``"error"`` (see the module docstring).
        device: where the models train; outputs come back on the CPU.
    """

    _metric_keys = (
        "loss",
        "pg_loss",
        "vf_loss",
        "entropy",
        "clip_fraction",
        "approx_kl",
        "value_clip_fraction",
        "grad_norm",
        "critic_grad_norm",
    )
    inputs = {  # noqa: RUF012
        **_INPUTS,
        "returns": _TOKENS,
        "values": Port(_TOKENS, doc="old values, from the Critic node"),
    }
    outputs = {  # noqa: RUF012
        "weights": Port(ANY, doc="WeightUpdate of the policy"),
        "critic_weights": Port(ANY, doc="WeightUpdate of the value model"),
        "metrics": Port(ANY, doc="dict[str, float]"),
    }

    def __init__(
        self,
        policy: str | Mapping[str, Any] = "tiny-prefix-vlm",
        critic: str | Mapping[str, Any] = "tiny-prefix-vlm",
        detach_trunk: bool = False,
        head_seed: int = 0,
        lr: float = 1e-4,
        critic_lr: float | None = None,
        weight_decay: float = 0.0,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        value_clip_eps: float | None = 0.2,
        vf_coef: float = 0.5,
        entropy_coef: float = 0.0,
        kl_coef: float = 0.0,
        epochs: int = 1,
        micro_batch_size: int = 0,
        max_grad_norm: float | None = 1.0,
        temperature: float = 1.0,
        seed: int = 0,
        on_nonfinite: str = "skip",
        device: str = "cpu",
        name: str | None = None,
        *,
        placement: str | int | None = None,
        batch_policy: BatchPolicy | None = None,
        resources: Resources | None = None,
    ) -> None:
        super().__init__(name, placement=placement, batch_policy=batch_policy, resources=resources)
        where = f"node {self.name!r}"
        if critic_lr is not None and not critic_lr > 0:
            raise ValueError(f"{where}: critic_lr={critic_lr}; it must be > 0 (or None for lr)")
        if value_clip_eps is not None and not value_clip_eps > 0:
            raise ValueError(
                f"{where}: value_clip_eps={value_clip_eps}; it must be > 0 (or None: no clip)"
            )
        if vf_coef < 0:
            raise ValueError(f"{where}: vf_coef={vf_coef}; it must be >= 0")
        self._init_common(
            policy,
            lr,
            weight_decay,
            clip_eps,
            clip_eps_high,
            entropy_coef,
            kl_coef,
            epochs,
            micro_batch_size,
            max_grad_norm,
            temperature,
            seed,
            device,
            on_nonfinite,
        )
        self.value_clip_eps = None if value_clip_eps is None else float(value_clip_eps)
        self.vf_coef = float(vf_coef)
        # built exactly as nodes.reference.Critic builds it, so both start identical
        trunk = build_policy(critic).to(self.device)
        self.value_model = ValueModel(trunk, detach_trunk=detach_trunk, seed=head_seed)
        self.value_model.eval()
        critic_params = list(
            (self.value_model.head if detach_trunk else self.value_model).parameters()
        )
        self.critic_optimizer = torch.optim.AdamW(
            critic_params,
            lr=float(critic_lr if critic_lr is not None else lr),
            weight_decay=float(weight_decay),
        )
        self._trained.append(
            ("critic_grad_norm", "value model", critic_params, self.critic_optimizer)
        )
        self.critic_version = 0

    def forward(
        self,
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        logprobs,
        advantages,
        ref_logprobs,
        image_embeds,
        images,
        returns,
        values,
    ) -> dict[str, Any]:
        t, real, group = self._check_inputs(
            {
                "prompt_ids": prompt_ids,
                "prompt_mask": prompt_mask,
                "response_ids": response_ids,
                "response_mask": response_mask,
                "logprobs": logprobs,
                "advantages": advantages,
                "returns": returns,
                "values": values,
                "ref_logprobs": ref_logprobs,
            },
            image_embeds,
            images,
        )
        n_tokens = int(real.sum())

        def micro_loss(rows: slice) -> tuple[Tensor, dict[str, float]] | None:
            r, mask, ids = real[rows], t["response_mask"][rows], t["response_ids"][rows]
            n = int(r.sum())
            if n == 0:
                return None
            w = n / n_tokens  # this micro-batch's share of the token-mean
            batch = self._prompt_batch(self.policy, t, rows, group, image_embeds, images)
            new_logprobs, token_entropy = self._policy_terms(batch, ids, mask, r)  # (b, R)
            pg_loss, pg_stats = ppo_policy_loss(
                new_logprobs,
                t["logprobs"][rows],
                t["advantages"][rows],
                mask,
                self.clip_eps,
                self.clip_eps_high,
            )
            entropy = aggregate_token_loss(token_entropy, mask)  # ()
            trunk = self.value_model.trunk
            critic_batch = self._prompt_batch(trunk, t, rows, group, image_embeds, images)
            new_values = self.value_model(critic_batch, ids, mask)  # (b, R)
            _require_finite("values of the value model", new_values, r)
            vf_loss, vf_stats = value_loss(
                new_values, t["values"][rows], t["returns"][rows], mask, self.value_clip_eps
            )
            loss = pg_loss + self.vf_coef * vf_loss - self.entropy_coef * entropy  # ()
            stats = {
                "pg_loss": _item(pg_loss),
                "vf_loss": _item(vf_loss),
                "entropy": _item(entropy),
                "clip_fraction": _item(pg_stats["clip_fraction"]),
                "approx_kl": _item(pg_stats["approx_kl"]),
                "value_clip_fraction": _item(vf_stats["value_clip_fraction"]),
            }
            if self.kl_coef > 0:
                kl_ref = kl_loss(new_logprobs, t["ref_logprobs"][rows], mask, "k3")  # ()
                loss = loss + self.kl_coef * kl_ref  # ()
                stats["kl_ref"] = _item(kl_ref)
            stats["loss"] = _item(loss)
            return loss * w, {k: w * v for k, v in stats.items()}

        metrics = self._train(self._slices(real.shape[0], group), micro_loss)
        metrics["critic_lr"] = float(self.critic_optimizer.param_groups[0]["lr"])
        self.critic_version += 1
        critic_weights = WeightUpdate(_snapshot(self.value_model), self.critic_version)
        return {"weights": self._publish(), "critic_weights": critic_weights, "metrics": metrics}

    # --- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Both models, both optimizers, the weight versions and the update counter."""
        return {
            "policy": _snapshot(self.policy),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "value_model": _snapshot(self.value_model),
            "critic_optimizer": copy.deepcopy(self.critic_optimizer.state_dict()),
            "version": self.version,
            "critic_version": self.critic_version,
            "updates": self.updates,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        keys = {"policy", "optimizer", "value_model", "critic_optimizer", "version"}
        self._load_checked(state, keys | {"critic_version", "updates"})
        self.value_model.load_state_dict(state["value_model"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        self.critic_version = int(state["critic_version"])


class GRPOUpdate(_Update):
    """GRPO (``nodes.rl.losses.grpo_loss``): the clipped surrogate with group advantages plus
    ``kl_coef`` * k3 KL to the reference, minus ``entropy_coef`` * entropy; no critic.

    Inputs: the rollout's ``prompt_ids``, ``prompt_mask``, ``response_ids``, ``response_mask``,
    ``logprobs`` (old), ``advantages`` float32[B, R] (from GroupAdvantage), optionally
    ``ref_logprobs`` (required when ``kl_coef > 0``) and ``image_embeds`` / ``images``.
    Outputs: ``weights`` (a WeightUpdate of the policy) and ``metrics`` (loss, pg_loss, entropy,
    clip_fraction, approx_kl, kl_ref (with kl_coef > 0), grad_norm, lr, skipped_nonfinite).

    Args:
        aggregation: ``"seq-mean-token-mean"`` (the paper's ``1/G sum_i 1/|o_i| sum_t``) or
            ``"token-mean"``; it also aggregates the entropy term.
        kl_coef: GRPO's beta (the paper uses 0.04; 0 disables the term and the input).
        The others are as in :class:`PPOUpdate`.
    """

    _metric_keys = ("loss", "pg_loss", "entropy", "clip_fraction", "approx_kl", "grad_norm")
    inputs = _INPUTS
    outputs = {  # noqa: RUF012
        "weights": Port(ANY, doc="WeightUpdate of the policy"),
        "metrics": Port(ANY, doc="dict[str, float]"),
    }

    def __init__(
        self,
        policy: str | Mapping[str, Any] = "tiny-prefix-vlm",
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        kl_coef: float = 0.0,
        entropy_coef: float = 0.0,
        aggregation: str = "seq-mean-token-mean",
        epochs: int = 1,
        micro_batch_size: int = 0,
        max_grad_norm: float | None = 1.0,
        temperature: float = 1.0,
        seed: int = 0,
        on_nonfinite: str = "skip",
        device: str = "cpu",
        name: str | None = None,
        *,
        placement: str | int | None = None,
        batch_policy: BatchPolicy | None = None,
        resources: Resources | None = None,
    ) -> None:
        super().__init__(name, placement=placement, batch_policy=batch_policy, resources=resources)
        if aggregation not in _AGGREGATIONS:
            raise ValueError(
                f"node {self.name!r}: aggregation={aggregation!r}; choose one of {_AGGREGATIONS}"
            )
        self.aggregation = aggregation
        self._init_common(
            policy,
            lr,
            weight_decay,
            clip_eps,
            clip_eps_high,
            entropy_coef,
            kl_coef,
            epochs,
            micro_batch_size,
            max_grad_norm,
            temperature,
            seed,
            device,
            on_nonfinite,
        )

    def forward(
        self,
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        logprobs,
        advantages,
        ref_logprobs,
        image_embeds,
        images,
    ) -> dict[str, Any]:
        t, real, group = self._check_inputs(
            {
                "prompt_ids": prompt_ids,
                "prompt_mask": prompt_mask,
                "response_ids": response_ids,
                "response_mask": response_mask,
                "logprobs": logprobs,
                "advantages": advantages,
                "ref_logprobs": ref_logprobs,
            },
            image_embeds,
            images,
        )
        n_tokens = int(real.sum())
        n_seqs = int(real.any(dim=1).sum())
        per_seq = self.aggregation == "seq-mean-token-mean"

        def micro_loss(rows: slice) -> tuple[Tensor, dict[str, float]] | None:
            r, mask, ids = real[rows], t["response_mask"][rows], t["response_ids"][rows]
            n = int(r.sum())
            if n == 0:
                return None
            w_tok = n / n_tokens  # share of the batch's tokens (token-mean stats)
            w = int(r.any(dim=1).sum()) / n_seqs if per_seq else w_tok  # share of the loss
            batch = self._prompt_batch(self.policy, t, rows, group, image_embeds, images)
            new_logprobs, token_entropy = self._policy_terms(batch, ids, mask, r)  # (b, R)
            ref = t["ref_logprobs"][rows] if self.kl_coef > 0 else None
            loss, stats = grpo_loss(
                new_logprobs,
                t["logprobs"][rows],
                ref,
                t["advantages"][rows],
                mask,
                self.clip_eps,
                self.clip_eps_high,
                beta=self.kl_coef,
                aggregation=self.aggregation,
            )
            entropy = aggregate_token_loss(token_entropy, mask, self.aggregation)  # ()
            loss = loss - self.entropy_coef * entropy  # ()
            out = {
                "loss": w * _item(loss),
                "pg_loss": w * _item(stats["pg_loss"]),
                "entropy": w * _item(entropy),
                "clip_fraction": w_tok * _item(stats["clip_fraction"]),
                "approx_kl": w_tok * _item(stats["approx_kl"]),
            }
            if self.kl_coef > 0:
                out["kl_ref"] = w * _item(stats["ref_kl"])
            return loss * w, out

        metrics = self._train(self._slices(real.shape[0], group), micro_loss)
        return {"weights": self._publish(), "metrics": metrics}

    # --- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The policy, its optimizer, the weight version and the update counter."""
        return {
            "policy": _snapshot(self.policy),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "version": self.version,
            "updates": self.updates,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._load_checked(state, {"policy", "optimizer", "version", "updates"})
