"""What the PPO and GRPO updates share: input checks, micro-batches, the guarded step and
the published weights (see :mod:`nodes.update` for the behaviour they have in common)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from nodes.batches import read_mask
from nodes.models.offload import Offload
from nodes.models.policy import Policy, PromptBatch, build_policy
from nodes.models.precision import autocast
from nodes.reference import _prompt_batch, _responses_per_row
from nodes.rl.losses import _tis_weights, logprobs_from_logits, token_entropy_from_logits
from nodes.rl.masked import _check_finite
from nodes.seeding import step_seed
from nodes.shared_models import Sharing
from nodes.update.loop import MicroLoss, _Loop, _NonFinite
from nodes.update.micro import Micro, View, plan_micro_batches, token_micro_batches
from nodes.update.options import _Options
from nodes.update.ranked import NonFiniteError, _Ranked
from yatt_graph import ANY, BatchPolicy, Node, Port
from yatt_graph import Tensor as TensorPort
from yatt_graph.node import Built

__all__ = ["MicroLoss", "NonFiniteError"]  # the updates themselves are public in nodes.update

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
    "rollout_logprobs": Port(
        _TOKENS,
        required=False,
        doc="the sampler's own logprobs where 'logprobs' were recomputed by the trainer: the "
        "gap is reported, and tis_cap weighs each token by their ratio",
    ),
    "truncated": Port(
        TensorPort("float32", "B"), required=False, doc="1.0 where the rollout cut the response"
    ),
    "context_mask": Port(
        _TOKENS,
        required=False,
        doc="a multi-turn trajectory's response tokens the model reads: the policy's turns "
        "and the observations between them (response_mask is 1 on the policy's alone)",
    ),
    "image_embeds": Port(TensorPort("float32", "N", "D"), required=False, doc="PrefixVLM"),
    "images": Port(ANY, required=False, doc="list[PIL.Image] (HF VLMs)"),
}


class _PolicyTerms(NamedTuple):
    """A micro-batch through the policy, as the losses read it (all of ``b`` rows)."""

    real: Tensor
    """bool[b, R]: the tokens trained on, checked once for the call (no 0/1 scan per term)."""
    tokens: int
    """How many tokens ``real`` holds (> 0)."""
    ids: Tensor
    """int64[b, R]: the response tokens."""
    reads: Tensor
    """bool[b, R]: the tokens the model reads (observations too, in a multi-turn trajectory)."""
    logprobs: Tensor
    """float[b, R]: teacher-forced logprobs of ``logits / T``, 0 off ``real``, checked finite."""
    entropy: Tensor
    """float[b, R]: per-token entropy, 0 off ``real`` (with grad when ``entropy_coef > 0``)."""


def _item(x: Tensor) -> float:
    return float(x.detach())


def _require_finite(what: str, x: Tensor, real: Tensor) -> None:
    if not bool(torch.isfinite(x[real]).all()):
        raise _NonFinite(what)


class _Update(_Options, _Loop, Offload, _Ranked, Sharing, Node):
    """What PPO and GRPO updates share: their options (:mod:`nodes.update.options`), input
    checks, micro-batches, the guarded step, weights, and the rank group (``ranks > 1``:
    ``runtime.ranks``)."""

    kind = "update"
    _metric_keys: tuple[str, ...] = ()
    # an update must see its whole batch: two halves on two devices would be two updates
    batch_policy = BatchPolicy(splittable=False)
    policy = Built("the policy this node trains, built from the ``policy`` spec by setup()")
    optimizer = Built("the policy's AdamW")
    _trained = Built("(metric name, what it is in messages, parameters, optimizer) per model")

    # --- the memory plan (nodes/memory.py) -----------------------------------------------------
    def memory(self, load: Any) -> dict[str, int]:
        """The trained policy's weights, gradients, AdamW state and snapshots, and the
        activations of the largest micro-batch (see :func:`nodes.memory.training_memory`)."""
        from nodes.memory import training_memory

        held = training_memory(self.policy_spec, load, **self._memory_options(self.share))
        if self.ranks > 1:  # the ranks' own sharded copy, not the rollout's module
            held["weights@"] = held.pop("weights")
        return held

    def _memory_options(self, share: str | None) -> dict[str, Any]:
        fsdp = self.ranks > 1 and self.train_backend == "fsdp"
        return {
            "budget": self.micro_batch_tokens,
            "rows": self.micro_batch_size,
            "mini_batches": self.mini_batches,
            "mixed": self.mixed_precision != "no",
            "live": share is not None and self.ranks == 1,  # a group gathers a snapshot
            "shards": self.ranks if fsdp else 1,
        }

    # --- the device, when roles take turns on it (nodes/models/offload.py) -------------------
    def offload(self) -> int:
        """Off the device. A rank group (``ranks > 1``) moves every rank's shards
        (:meth:`_switch_group`): its parameters are FSDP2 DTensors, which a move of ``.data``
        would break."""
        return self._switch_group(off=True) if self.ranks > 1 else super().offload()

    def reload(self) -> int:
        return self._switch_group(off=False) if self.ranks > 1 else super().reload()

    def claim(self) -> None:
        if self.ranks == 1:
            super().claim()

    def _packed_logits(self) -> Any:
        """The policy's logits from one packed sequence a micro-batch (``pack_sequences``)."""
        packed = getattr(self.policy, "forward_packed_logits", None)
        if packed is None or self.ranks > 1:
            why = "ranks > 1" if packed is not None else f"a {type(self.policy).__name__} policy"
            raise ValueError(
                f"node {self.name!r}: pack_sequences=True needs a text causal LM trained in one "
                f"process; it is not built for {why} (set pack_sequences=False)"
            )
        return packed

    def build(self) -> None:
        if self.ranks > 1:
            self._join_ranks()
            policy = build_policy(self.policy_spec).to(self.device).eval()
            self._ranks.join()
            self.policy = policy
            self._policy_logits = self._shard(policy, "forward_response", lambda out: out.logits)
        else:
            self.policy = self._shared_policy(self.share, self.policy_spec).eval()
            self._policy_logits = lambda *args: self.policy.forward_response(*args).logits
        if self.pack_sequences:
            self._policy_logits = self._packed_logits()
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
        if self.tis_cap > 0 and tensors.get("rollout_logprobs") is None:
            raise ValueError(
                f"{where}: tis_cap={self.tis_cap} needs the 'rollout_logprobs' input connected "
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

    def _checked_view(self, inputs: Mapping[str, Any]) -> View:
        """The call's inputs, checked, as the whole batch's :class:`View`; with
        ``mask_truncated`` the responses the rollout cut leave the loss."""
        image_embeds, images = inputs.get("image_embeds"), inputs.get("images")
        skip = ("image_embeds", "images", "truncated")
        tensors = {k: v for k, v in inputs.items() if k not in skip}
        t, real, group = self._check_inputs(tensors, image_embeds, images)
        self._response_stats = {}
        cut = inputs.get("truncated")
        if cut is not None:
            cut = cut.to(real.device).reshape(-1) > 0  # (B,)
            if cut.shape[0] != real.shape[0]:
                raise ValueError(
                    f"node {self.name!r}: input 'truncated' has {cut.shape[0]} rows for "
                    f"{real.shape[0]} responses"
                )
            lengths = real.sum(1).float()  # (B,)
            ended = lengths[~cut]
            self._response_stats = {
                "truncated": float(cut.float().mean()),
                "ended_length": float(ended.mean()) if len(ended) else 0.0,
            }
            if self.mask_truncated and bool((real & ~cut[:, None]).any()):
                real = real & ~cut[:, None]  # (B, R) (all cut: trained on as they are, and said)
            elif self.mask_truncated:
                log.warning("node %r: every response was cut at max_new_tokens; they are "
                            "trained on this step (raise max_new_tokens)", self.name)  # fmt: skip
        read_mask(f"node {self.name!r}", t["response_mask"], t.get("context_mask"))  # checked
        sampled = t.pop("rollout_logprobs", None)
        if sampled is not None:
            gap = (t["logprobs"] - sampled).abs()[real]  # (n,) |log pi_old - log pi_rollout|
            self._response_stats["logprob_gap_mean"] = float(gap.mean()) if len(gap) else 0.0
            self._response_stats["logprob_gap_max"] = float(gap.max()) if len(gap) else 0.0
            if self.tis_cap > 0:
                t["tis_weights"] = _tis_weights(t["logprobs"], sampled, real, self.tis_cap)
                self._response_stats["tis_weight_mean"] = float(t["tis_weights"][real].mean())
        return View(t, real, image_embeds, images, group)

    def _slices(self, B: int, group: int) -> list[slice]:
        """Micro-batch row ranges; with per-prompt image rows they hold whole groups."""
        size = self.micro_batch_size or B
        size = -(-size // group) * group  # round up to a multiple of the group
        return [slice(i, min(i + size, B)) for i in range(0, B, max(size, 1))]

    def _cut(self, view: View) -> list[tuple[View, slice]]:
        """Micro-batches of ``view``: by ``micro_batch_tokens`` when set, else by rows."""
        if self.micro_batch_tokens:
            subs = token_micro_batches(
                view, self.micro_batch_tokens, self.micro_batch_size, self.pack_sequences
            )
            return [(sub, slice(0, sub.real.shape[0])) for sub in subs]
        return [(view, rows) for rows in self._slices(view.real.shape[0], view.group)]

    def _micro_batches(self, full: View) -> tuple[list[Micro], Micro | None]:
        """This rank's micro-batches (the whole batch's, alone) and the group's filler."""
        rank, world = (0, 1) if self._ranks is None else (self._ranks.rank, self._ranks.world)
        return plan_micro_batches(full, self._cut, rank, world)

    def _mini_batches(self, full: View, epoch: int) -> list[View]:
        """The epoch's ``mini_batches`` parts of the batch, whole units shuffled with the step's
        seed (the whole batch, in order, with one)."""
        if self.mini_batches == 1:
            return [full]
        units = full.real.shape[0] // full.group
        gen = torch.Generator().manual_seed(step_seed(self.seed, self.updates) + epoch)
        order = torch.randperm(units, generator=gen).tolist()
        m = min(self.mini_batches, units)
        return [full.take(sorted(order[i::m])) for i in range(m)]

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
    def _policy_terms(self, view: View, rows: slice) -> _PolicyTerms | None:
        """Rows ``rows`` of ``view`` through the policy, teacher-forced (None when they hold no
        token to train on); the forward reads the tokens of ``view.reads`` (observations too)."""
        real, ids = view.real[rows], view.t["response_ids"][rows]
        tokens = int(real.sum())
        if tokens == 0:
            return None
        batch = self._prompt_batch(self.policy, view, rows)
        reads = view.reads[rows]  # bool[b, R]: observations too, in a multi-turn trajectory
        with autocast(self.device, self.mixed_precision):
            logits = self._policy_logits(batch, ids, reads)  # (b, R, V)
        if self.mixed_precision != "no":
            logits = logits.float()  # the log-softmax in float32
        if self.temperature != 1.0:
            logits = logits / self.temperature  # (b, R, V)
        logprobs = logprobs_from_logits(logits, ids, real).float()  # (b, R)
        _require_finite("policy logprobs", logprobs, real)
        if self.entropy_coef > 0:
            entropy = token_entropy_from_logits(logits, real)  # (b, R)
        else:
            with torch.no_grad():
                entropy = token_entropy_from_logits(logits.detach(), real)  # (b, R)
        return _PolicyTerms(real, tokens, ids, reads, logprobs, entropy.float())
