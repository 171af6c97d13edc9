"""The options every update takes, PPO's and GRPO's alike: declared once, checked, and kept
as attributes (their meanings are in :class:`nodes.update.PPOUpdate`'s docstring)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from nodes.models.policy import check_policy_spec
from nodes.models.precision import PRECISIONS
from nodes.models.sampling import temperature_problem
from nodes.rl.advantages import KL_ESTIMATORS
from nodes.shared_models import check_share_key
from nodes.update.schedule import schedule_problem
from yatt_graph import BatchPolicy
from yatt_graph.options import unknown_keywords

__all__ = ["TRAIN_BACKENDS"]

TRAIN_BACKENDS = ("fsdp", "ddp")
"""How a rank group trains the models: FSDP2 (sharded) or DDP (replicated); runtime.ranks."""

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
"""The largest learning rate an optimizer step can apply (larger ones do not convert)."""


class _Options:
    """The update's constructor, less what is its own (PPO's critic, GRPO's aggregation): a
    mixin before the node's others, whose ``__init__`` is the node's (``Node.__init__`` last)."""

    name: str

    def __init__(
        self,
        policy: str | Mapping[str, Any] = "tiny-prefix-vlm",
        *,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        dual_clip: float | None = None,
        kl_estimator: str = "k3",
        entropy_coef: float = 0.0,
        kl_coef: float = 0.0,
        epochs: int = 1,
        micro_batch_size: int = 0,
        micro_batch_tokens: int = 0,
        mask_truncated: bool = False,
        tis_cap: float = 0.0,
        pack_sequences: bool = False,
        mini_batches: int = 1,
        mixed_precision: str = "no",
        lr_schedule: str = "constant",
        lr_warmup_steps: int = 0,
        lr_decay_steps: int = 0,
        max_grad_norm: float | None = 1.0,
        temperature: float = 1.0,
        seed: int = 0,
        on_nonfinite: str = "skip",
        device: str = "cpu",
        name: str | None = None,
        share: str | None = None,
        ranks: int = 1,
        train_backend: str = "fsdp",
        rank_timeout_s: float = 300.0,
        placement: str | int | None = None,
        batch_policy: BatchPolicy | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:  # named for the node, not this mixin, with the nearest option
            raise unknown_keywords(type(self), unknown)
        super().__init__(name, placement=placement, batch_policy=batch_policy)  # type: ignore[call-arg]
        where = f"node {self.name!r}"
        hot = temperature_problem(temperature, greedy=False)
        checks = [
            (0 < lr <= _FLOAT32_MAX, f"lr={lr}; it must be > 0 and fit float32"),
            (weight_decay >= 0, f"weight_decay={weight_decay}; it must be >= 0"),
            (0 < clip_eps < 1, f"clip_eps={clip_eps}; it must be in (0, 1)"),
            (
                clip_eps_high is None or clip_eps_high > 0,
                f"clip_eps_high={clip_eps_high}; it must be > 0 (or None for clip_eps)",
            ),
            (
                dual_clip is None or (dual_clip > 1 and math.isfinite(dual_clip)),
                f"dual_clip={dual_clip}; it must be a finite number > 1 (or None: off)",
            ),
            (entropy_coef >= 0, f"entropy_coef={entropy_coef}; it must be >= 0"),
            (kl_coef >= 0, f"kl_coef={kl_coef}; it must be >= 0 (0 disables the KL term)"),
            (int(epochs) >= 1, f"epochs={epochs}; it must be >= 1"),
            (
                int(micro_batch_size) >= 0,
                f"micro_batch_size={micro_batch_size}; 0 = whole batch",
            ),
            (
                int(micro_batch_tokens) >= 0,
                f"micro_batch_tokens={micro_batch_tokens}; it must be >= 0 (0: no budget)",
            ),
            (
                int(mini_batches) >= 1,
                f"mini_batches={mini_batches}; it must be >= 1 (optimizer steps per epoch)",
            ),
            (
                mixed_precision in PRECISIONS,
                f"mixed_precision={mixed_precision!r}; choose one of {', '.join(PRECISIONS)}",
            ),
            (
                (why := schedule_problem(lr_schedule, lr_warmup_steps, lr_decay_steps)) is None,
                why,
            ),
            (
                max_grad_norm is None or max_grad_norm >= 0,
                f"max_grad_norm={max_grad_norm}; it must be >= 0 (0 or None: no clipping)",
            ),
            (hot is None, f"{hot} (the rollout's)"),
            (
                on_nonfinite in ("raise", "skip"),
                f"on_nonfinite={on_nonfinite!r}; choose 'raise' or 'skip' (as on_bad_sample)",
            ),
            (
                isinstance(ranks, int) and not isinstance(ranks, bool) and ranks >= 1,
                f"ranks={ranks!r}; it must be an int >= 1 (the processes that train together)",
            ),
            (
                train_backend in TRAIN_BACKENDS,
                f"train_backend={train_backend!r}; choose one of {', '.join(TRAIN_BACKENDS)}",
            ),
            (rank_timeout_s > 0, f"rank_timeout_s={rank_timeout_s}; it must be > 0"),
            (
                tis_cap >= 0 and math.isfinite(tis_cap),
                f"tis_cap={tis_cap}; it must be a finite number >= 0 (0: no correction)",
            ),
        ]
        for ok, why in checks:
            if not ok:
                raise ValueError(f"{where}: {why}")
        self.lr = float(lr)
        self.clip_eps = float(clip_eps)
        self.clip_eps_high = None if clip_eps_high is None else float(clip_eps_high)
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        self.dual_clip = None if dual_clip is None else float(dual_clip)
        # the ratio's clip range below and above 1, and the dual clip of negative advantages
        self._clip = (self.clip_eps, high, self.dual_clip)
        self.kl_estimator = KL_ESTIMATORS.check(kl_estimator, f"{where}: kl_estimator")
        self.entropy_coef = float(entropy_coef)
        self.kl_coef = float(kl_coef)
        self.epochs = int(epochs)
        self.micro_batch_size = int(micro_batch_size)
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.mask_truncated = bool(mask_truncated)
        self.tis_cap = float(tis_cap)
        self.pack_sequences = bool(pack_sequences)
        self._response_stats: dict[str, float] = {}
        self.mini_batches = int(mini_batches)
        self.mixed_precision = mixed_precision
        self._schedule = (lr_schedule, int(lr_warmup_steps), int(lr_decay_steps))
        self.max_grad_norm = float(max_grad_norm or 0.0)
        self.temperature = float(temperature)
        self.seed = int(seed)
        self.on_nonfinite = on_nonfinite
        self.device = torch.device(device)
        check_policy_spec(policy)
        self.policy_spec = policy
        self.share = check_share_key(share, where)
        self.weight_decay = float(weight_decay)
        self.ranks = int(ranks)
        self.train_backend = train_backend
        self.rank_timeout_s = float(rank_timeout_s)
        self.version = 0
        self.updates = 0
