"""What the PPO and GRPO update nodes share (see :mod:`nodes.update`): ports and options, the
trained policy and its forward pass, and the weights they publish. Their training is a
:class:`~nodes.update.trainer.Trainer` each node owns, built with its models."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from nodes.models.offload import Offload
from nodes.models.policy import Policy, PromptBatch, build_policy, check_policy_spec
from nodes.models.precision import autocast
from nodes.models.ranked import join_group
from nodes.reference import _prompt_batch
from nodes.rl.losses import logprobs_from_logits, token_entropy_from_logits
from nodes.shared_models import Sharing, check_share_key, live_weights
from nodes.update.options import TRAIN_BACKENDS, UpdateHyper
from nodes.update.trainer import (
    MicroLoss,
    NonFiniteError,
    Trained,
    Trainer,
    View,
    _NonFinite,
    snapshot,
)
from yatt_graph import ANY, BatchPolicy, Node, Port, WeightUpdate
from yatt_graph import Tensor as TensorPort
from yatt_graph.node import Built
from yatt_graph.options import unknown_keywords

__all__ = ["MicroLoss", "NonFiniteError"]  # the updates themselves are public in nodes.update

_TOKENS = TensorPort("float32", "B", "R")

_INPUTS = {
    "prompt_ids": TensorPort("int64", "B", "P"),
    "prompt_mask": TensorPort("int64", "B", "P"),
    "response_ids": TensorPort("int64", "B", "R"),
    "response_mask": _TOKENS,
    "logprobs": Port(_TOKENS, doc="sampling-policy logprobs, from the rollout"),
    "advantages": _TOKENS,
    "ref_logprobs": Port(_TOKENS, required=False, doc="needed when kl_coef > 0"),
    "teacher_logprobs": Port(
        _TOKENS, required=False, doc="a teacher's logprobs of the responses: distill_coef > 0"
    ),
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


class _Update(Offload, Sharing, Node):
    """What PPO and GRPO updates share: their options (``hp``, a :class:`UpdateHyper`), the
    trained policy, the published weights and the node's side of the :class:`Trainer`."""

    kind = "update"
    Hyper: ClassVar[type[UpdateHyper]] = UpdateHyper
    """The node's hyper-parameters, filled from its keywords."""
    _metric_keys: tuple[str, ...] = ()
    _version_keys: tuple[str, ...] = ("version",)
    """The state keys of the published weights' version (the count of calls, ``updates``)."""
    # an update must see its whole batch: two halves on two devices would be two updates
    batch_policy = BatchPolicy(splittable=False)
    execution_options: tuple[str, ...] = (
        "ranks",
        "train_backend",
        "rank_timeout_s",
        "share",
        "critic_share",
    )
    """Options that choose how the node runs, not what it computes: its checkpoints are in
    one layout whatever they are, so a run may resume with other values of them."""
    policy = Built("the policy this node trains, built from the ``policy`` spec by setup()")
    optimizer = Built("the policy's AdamW")
    trainer = Built("the node's Trainer: its models, their optimizers and the rank group")

    def __init__(
        self,
        policy: str | Mapping[str, Any] = "tiny-prefix-vlm",
        own: Mapping[str, Any] | None = None,
        /,
        *,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        dual_clip: float | None = None,
        policy_loss: str = "ppo",
        kl_estimator: str = "k3",
        entropy_coef: float = 0.0,
        kl_coef: float = 0.0,
        distill_coef: float = 0.0,
        distill_mode: str = "loss",
        distill_estimator: str = "k2",
        reward_coef: float = 1.0,
        epochs: int = 1,
        micro_batch_size: int = 0,
        micro_batch_tokens: int = 0,
        mask_truncated: bool = False,
        tis_cap: float = 0.0,
        tis_level: str = "token",
        tis_mode: str = "truncate",
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
        weights_include: Sequence[str] | None = None,
        weights_dtype: str | None = None,
        placement: str | int | None = None,
        batch_policy: BatchPolicy | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:  # named for the node, not this base, with the nearest option
            raise unknown_keywords(type(self), unknown)
        shared = {k: v for k, v in locals().items() if k in UpdateHyper.__struct_fields__}
        super().__init__(name, placement=placement, batch_policy=batch_policy)
        where = f"node {self.name!r}"
        self.hp = self.Hyper.checked(where, **shared, **(own or {}))
        dtype = getattr(torch, weights_dtype, None) if isinstance(weights_dtype, str) else None
        checks = [
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
                weights_dtype is None
                or (isinstance(dtype, torch.dtype) and dtype.is_floating_point),
                f"weights_dtype={weights_dtype!r} is not a floating torch dtype",
            ),
        ]
        for ok, why in checks:
            if not ok:
                raise ValueError(f"{where}: {why}")
        try:
            self.weights_include = [re.compile(p) for p in weights_include or ()]
        except (re.error, TypeError) as err:
            raise ValueError(f"{where}: weights_include={weights_include!r}: {err}") from None
        self.weights_dtype = dtype
        self.device = torch.device(device)
        check_policy_spec(policy)
        self.policy_spec = policy
        self.share = check_share_key(share, where)
        self.ranks = int(ranks)
        self.train_backend = train_backend
        self.rank_timeout_s = float(rank_timeout_s)

    # --- the memory plan (nodes/memory.py) -----------------------------------------------------
    def memory(self, load: Any) -> dict[str, int]:
        """The trained policy's weights, gradients, AdamW state and snapshots, and the
        activations of the largest micro-batch (see :func:`nodes.memory.training_memory`)."""
        from nodes.memory import training_memory

        held = training_memory(self.policy_spec, load, **self._memory_options(self.share, load))
        if self.ranks > 1:  # the ranks' own sharded copy, not the rollout's module
            held["weights@"] = held.pop("weights")
        return held

    def _memory_options(self, share: str | None, load: Any) -> dict[str, Any]:
        shards = 1  # ddp: a whole copy a rank; hsdp: shards within each host of the group
        if self.ranks > 1 and self.train_backend != "ddp":
            hosts = load.hosts if self.train_backend == "hsdp" else 1
            shards = max(self.ranks // max(hosts, 1), 1)
        return {
            "budget": self.hp.micro_batch_tokens,
            "rows": self.hp.micro_batch_size,
            "mini_batches": self.hp.mini_batches,
            "mixed": self.hp.mixed_precision != "no",
            "live": share is not None and self.ranks == 1,  # a group gathers a snapshot
            "shards": shards,
        }

    # --- the device, when roles take turns on it (nodes/models/offload.py) -------------------
    def offload(self) -> int:
        """Off the device. A rank group (``ranks > 1``) moves every rank's shards
        (:meth:`Trainer.switch`)."""
        return self._switch(off=True) if self.ranks > 1 else super().offload()

    def reload(self) -> int:
        return self._switch(off=False) if self.ranks > 1 else super().reload()

    def _switch(self, off: bool) -> int:
        trainer = self.__dict__.get("trainer")  # (a node not built has nothing to move)
        return 0 if trainer is None else trainer.switch(off)

    def claim(self) -> None:
        if self.ranks == 1:
            super().claim()

    # --- building ----------------------------------------------------------------------------
    def setup(self) -> None:
        """Build the node (:meth:`yatt_graph.Node.setup`); a group whose build failed on
        rank 0 is ended, not left waiting for it."""
        try:
            super().setup()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """End the rank group (no-op alone); the node cannot train afterwards."""
        group = self.rank_group
        if group is not None and group.rank == 0:
            group.close()

    def build(self) -> None:
        group = None
        if self.ranks > 1:
            group = self.rank_group
            self.device = join_group(f"node {self.name!r}", group, self.ranks, self.device)
            policy = build_policy(self.policy_spec).to(self.device).eval()
            group.join()
            self.policy = policy
            self._policy_logits = group.shard(
                policy, self.train_backend, "forward_response", lambda out: out.logits
            )
        else:
            self.policy = self._shared_policy(self.share, self.policy_spec).eval()
            self._policy_logits = lambda *args: self.policy.forward_response(*args).logits
        if self.hp.pack_sequences:
            self._policy_logits = self._packed_logits()
        if any(p.dtype == torch.float16 for p in self.policy.parameters() if p.requires_grad):
            raise ValueError(
                f"node {self.name!r}: the policy to train has float16 weights; AdamW on float16 "
                "weights with no loss scaler overflows (its eps, 1e-8, is 0 in float16) and "
                "every step would be undone: train in bfloat16 or float32 (float16 serves "
                "inference: the rollout and the reference)"
            )
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=self.hp.lr, weight_decay=self.hp.weight_decay
        )
        self.trainer = Trainer(
            self.name, self.hp, self.device, self._metric_keys, group, self.train_backend
        )
        params = list(self.policy.parameters())
        self.trainer.trained.append(Trained("policy", "optimizer", "grad_norm", "policy",
                                            self.policy, params, self.optimizer))  # fmt: skip

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

    # --- the call ----------------------------------------------------------------------------
    def forward(self, **inputs: Any) -> dict[str, Any]:
        return self.trainer.call(inputs, self._step)

    def _step(self, full: View) -> dict[str, Any]:
        """Train on the batch ``full`` (:meth:`Trainer.train`) and publish: the outputs."""
        raise NotImplementedError

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

    def _policy_terms(self, view: View, rows: slice) -> _PolicyTerms | None:
        """Rows ``rows`` of ``view`` through the policy, teacher-forced (None when they hold no
        token to train on); the forward reads the tokens of ``view.reads`` (observations too)."""
        real, ids = view.real[rows], view.t["response_ids"][rows]
        tokens = int(real.sum())
        if tokens == 0:
            return None
        hp = self.hp
        batch = self._prompt_batch(self.policy, view, rows)
        reads = view.reads[rows]  # bool[b, R]: observations too, in a multi-turn trajectory
        with autocast(self.device, hp.mixed_precision):
            logits = self._policy_logits(batch, ids, reads)  # (b, R, V)
        if hp.mixed_precision != "no":
            logits = logits.float()  # the log-softmax in float32
        if hp.temperature != 1.0:
            logits = logits / hp.temperature  # (b, R, V)
        logprobs = logprobs_from_logits(logits, ids, real).float()  # (b, R)
        _require_finite("policy logprobs", logprobs, real)
        if hp.entropy_coef > 0:
            entropy = token_entropy_from_logits(logits, real)  # (b, R)
        else:
            with torch.no_grad():
                entropy = token_entropy_from_logits(logits.detach(), real)  # (b, R)
        return _PolicyTerms(real, tokens, ids, reads, logprobs, entropy.float())

    # --- the published weights -----------------------------------------------------------------
    def _publish(
        self, module: nn.Module, share: str | None, metrics: dict[str, float], *, filtered: bool
    ) -> WeightUpdate:
        """``module``'s weights as version ``updates`` (the count of calls): a snapshot, or the
        live tensors when the module is shared with its consumers in this process (they skip
        loading their own storage); in a group, the full state gathered on rank 0
        (``metrics["time/weight_gather"]`` sums its seconds). ``filtered``: only the keys
        matching ``weights_include`` are sent (a partial update), cast to ``weights_dtype``, except
        to consumers that share the live tensors."""
        trainer = self.trainer
        if trainer.group is None and self._is_shared(share):  # its consumers here read these
            # very tensors: nothing is sent, so nothing is filtered (a cast would round them)
            weights, filtered = live_weights(module), False
        elif trainer.group is None:
            weights = snapshot(module)
        else:
            start = time.perf_counter()
            weights = trainer.group.full_weights(module)
            key = "time/weight_gather"
            metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start
        if not filtered or not (self.weights_include or self.weights_dtype):
            return WeightUpdate(weights, trainer.updates)
        out = {
            k: t
            for k, t in weights.items()
            if not self.weights_include or any(p.search(k) for p in self.weights_include)
        }
        if self.weights_dtype is not None:
            cast = self.weights_dtype
            out = {k: t.to(cast) if t.is_floating_point() else t for k, t in out.items()}
        return WeightUpdate(out, trainer.updates, complete=len(out) == len(weights))

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

    # --- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Each model and optimizer (unsharded, in the 1-rank layout: any K loads it), the
        published versions and ``updates``."""
        self.setup()  # a group exists only once built; its state calls are group operations
        state = self.trainer.state()
        updates = state.pop("updates")
        return {**state, **dict.fromkeys(self._version_keys, updates), "updates": updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.setup()
        trained = self.trainer.trained
        keys = {k for m in trained for k in (m.key, m.optim_key)}
        keys |= {*self._version_keys, "updates"}
        if set(state) != keys:
            raise ValueError(
                f"node {self.name!r}: expected state keys {sorted(keys)}, got {sorted(state)}"
            )
        self.trainer.load(state)
