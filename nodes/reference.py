"""Reference logprobs and critic values over the rollout's responses.

* :class:`ReferenceLogprobs` (kind ``"reference"``): a frozen copy of the initial policy; it
  recomputes ``ref_logprobs`` for the KL term.
* :class:`Critic` (kind ``"critic"``): ``values`` from a :class:`nodes.models.value.ValueModel`,
  a linear value head on a policy trunk's last hidden states; the trunk is either shared with a live policy
  (``model=``, e.g. the one the update node trains) or a separate model built from a spec.

Both read the rollout's ports (``prompt_ids, prompt_mask, response_ids, response_mask``) plus
the image input of the policy family: ``image_embeds`` (PrefixVLM) or ``images`` (HF VLMs).
Those may have one row per prompt (N) while the responses have N * n rows (n samples per
prompt, grouped as the rollout groups them): rows are then repeated n times to match.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

import nodes.models.offload as offload_module
from nodes.batches import View, read_mask, token_budget_parts
from nodes.models.offload import Offload
from nodes.models.policy import Policy, PromptBatch, build_policy, check_policy_spec
from nodes.models.precision import autocast, check_precision
from nodes.models.ranked import join_group, score_over_ranks
from nodes.models.sampling import temperature_problem
from nodes.models.value import ValueModel, build_value_model
from nodes.rl.logits import logprobs_from_logits
from nodes.shared_models import Sharing, check_share_key, fingerprint, same_storage
from nodes.sync import WeightInput, apply_weights
from yatt_graph import ANY, BatchPolicy, Node, Port
from yatt_graph import Tensor as TensorPort
from yatt_graph.node import Built
from yatt_graph.options import unknown_keywords

__all__ = ["Critic", "ReferenceLogprobs", "value_model_fingerprint"]

_INPUTS = {
    "prompt_ids": TensorPort("int64", "B", "P"),
    "prompt_mask": TensorPort("int64", "B", "P"),
    "response_ids": TensorPort("int64", "B", "R"),
    "response_mask": TensorPort("float32", "B", "R"),
    "context_mask": Port(
        TensorPort("float32", "B", "R"),
        required=False,
        doc="a multi-turn trajectory's tokens read: the policy's turns and the observations",
    ),
    "image_embeds": Port(TensorPort("float32", "N", "D"), required=False, doc="PrefixVLM"),
    "images": Port(ANY, required=False, doc="list[PIL.Image] (HF VLMs)"),
}


def _responses_per_row(where: str, port: str, value: Any, B: int) -> int:
    """``B // N`` for the N rows of image input ``port``: one per response or one per prompt."""
    N = len(value)
    if N == 0 or B % N != 0:
        raise ValueError(
            f"{where}: input {port!r} has {N} rows for {B} responses; give one per response or "
            "one per prompt (B must be a multiple of it)"
        )
    return B // N


def _prompt_batch(
    node: Node, policy: Policy, prompt_ids: Tensor, prompt_mask: Tensor,
    image_embeds: Tensor | None, images: Sequence[Any] | None,
) -> PromptBatch:  # fmt: skip
    """The policy's batch for B rows, repeating per-prompt image inputs (N rows) B // N times."""
    B = prompt_ids.shape[0]
    for port, value in (("image_embeds", image_embeds), ("images", images)):
        if value is not None:
            _responses_per_row(f"node {node.name!r}", port, value, B)
    if image_embeds is not None and image_embeds.shape[0] != B:
        image_embeds = image_embeds.repeat_interleave(B // image_embeds.shape[0], 0)  # (B, D)
    if images is not None and len(images) != B:
        images = [im for im in images for _ in range(B // len(images))]
    try:
        return policy.prepare(prompt_ids, prompt_mask, images=images, image_embeds=image_embeds)
    except ValueError as err:
        raise ValueError(f"node {node.name!r}: {err}") from err


def _budget(tokens: Any, name: str) -> int:
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise ValueError(
            f"node {name!r}: micro_batch_tokens={tokens!r}; give a whole number >= 0 (0: the "
            "whole batch in one forward)"
        )
    return tokens


def _in_parts(
    fn: Any, budget: int, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
    response_mask: Tensor, image_embeds: Tensor | None, images: Sequence[Any] | None,
) -> Tensor:  # fmt: skip
    """``fn(prompt_ids, prompt_mask, response_ids, response_mask, image_embeds, images)``
    -> float[b, R'] over the whole batch, or, with a ``budget`` of padded tokens, over its parts
    (:mod:`nodes.batches`), put back in the batch's order: float32[B, R] where ``fn`` computes."""
    B, R = response_ids.shape
    image_rows = next((len(v) for v in (image_embeds, images) if v is not None), B)
    if not budget or not image_rows or B % image_rows:  # (a mismatch is _prompt_batch's to name)
        return fn(prompt_ids, prompt_mask, response_ids, response_mask, image_embeds, images).float()  # fmt: skip
    group = B // image_rows
    tensors = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}
    tensors |= {"response_ids": response_ids, "response_mask": response_mask}
    view = View(tensors, response_mask > 0, image_embeds, images, group)
    out: Tensor | None = None
    for units in token_budget_parts(view, budget):
        part = view.take(units).trimmed()
        t = part.t
        got = fn(t["prompt_ids"], t["prompt_mask"], t["response_ids"], t["response_mask"],
                 part.image_embeds, part.images)  # fmt: skip
        if out is None:
            out = got.new_zeros(B, R, dtype=torch.float32)  # (B, R)
        rows = torch.tensor([u * group + j for u in units for j in range(group)], device=out.device)
        out[rows, : got.shape[1]] = got.float()  # (b, R') into (B, R)
    return out if out is not None else torch.zeros(B, R)


def _over_ranks(
    node: Any, fn: Any, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
    reads: Tensor, image_embeds: Tensor | None, images: Sequence[Any] | None,
) -> Tensor:  # fmt: skip
    """:func:`_in_parts`'s result, each rank of ``node``'s group scoring its share."""
    B, R = response_ids.shape
    for port, value in (("image_embeds", image_embeds), ("images", images)):
        if value is not None:
            _responses_per_row(f"node {node.name!r}", port, value, B)
    image_rows = next((len(v) for v in (image_embeds, images) if v is not None), B)
    tensors = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}
    tensors |= {"response_ids": response_ids, "response_mask": reads}
    view = View(tensors, reads > 0, image_embeds, images, B // image_rows if image_rows else 1)
    return score_over_ranks(fn, node.rank_group, node.micro_batch_tokens, view, B, R)


def _init_scorer(
    node: Node, /, *, device: str = "cpu", name: str | None = None, share: str | None = None,
    micro_batch_tokens: int = 0, precision: str = "no", placement: str | int | None = None,
    batch_policy: BatchPolicy | None = None, **unknown: Any,
) -> None:  # fmt: skip
    """``Node.__init__`` and the options the reference and the critic share (keywords, the
    same on both): ``device`` (where the model runs and its output is), ``share`` (a share
    key), ``micro_batch_tokens`` (0: the whole batch in one forward), ``precision``
    (``"bf16"``: the forwards under bf16 autocast, as a mixed-precision update computes;
    :mod:`nodes.models.precision`), ``name``, ``placement``, ``batch_policy``."""
    if unknown:
        raise unknown_keywords(type(node), unknown, shared=(_init_scorer,))
    Node.__init__(node, name, placement=placement, batch_policy=batch_policy)
    node.share = check_share_key(share, f"node {node.name!r}")
    node.micro_batch_tokens = _budget(micro_batch_tokens, node.name)
    node.precision = check_precision(precision, f"node {node.name!r}")
    node.device = torch.device(device)


def _scores(
    node: Any, scoring: contextlib.AbstractContextManager[tuple[Policy, Callable[..., Tensor]]],
    prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
    image_embeds: Tensor | None, images: Sequence[Any] | None, context_mask: Tensor | None = None,
) -> dict[str, Tensor]:  # fmt: skip
    """What the reference and the critic share: a model run teacher-forced over the rollout's
    responses, in parts of at most ``node.micro_batch_tokens`` padded tokens, gives the node's
    one output, float32[B, R] (0 off the policy's turns). ``scoring`` gives, for the call, the
    policy that prepares the batches and ``score(batch, response_ids, response_mask) ->
    float[b, R']``. In a rank group (``node.ranks > 1``) each rank scores its share of the
    batch (:func:`nodes.models.ranked.score_over_ranks`)."""
    reads = read_mask(f"node {node.name!r}", response_mask, context_mask)
    with scoring as (policy, score), autocast(node.device, node.precision):

        def part(prompt_ids, prompt_mask, response_ids, response_mask, embeds, imgs):
            batch = _prompt_batch(node, policy, prompt_ids, prompt_mask, embeds, imgs)
            return score(batch, response_ids, response_mask)  # (b, R')

        args = (prompt_ids, prompt_mask, response_ids, reads, image_embeds, images)
        if node.ranks > 1:
            out = _over_ranks(node, part, *args)
        else:
            out = _in_parts(part, node.micro_batch_tokens, *args)
    (port,) = node.outputs
    return {port: torch.where(response_mask.to(out.device) > 0, out, 0.0)}  # 0 off the turns


class ReferenceLogprobs(Offload, Sharing, Node):
    """``ref_logprobs: float32[B, R]`` from a frozen copy of the policy (0 at padding).

    Args:
        policy: a :func:`nodes.models.policy.build_policy` spec; build it as the rollout's policy was
            built (same spec, same seed) so that the reference equals the policy at step 0.
        temperature: the temperature the rollout sampled at (logprobs of ``logits / T``).
        model: a live Policy to copy (deep copy: later training of it leaves the reference as is).
        share: the policy's share key (e.g. ``"policy"``): when the shared policy of an
            on-policy executor (:mod:`nodes.shared_models`) has LoRA adapters
            (``policy.has_lora`` and ``policy.adapter_disabled()``), the reference reads its
            frozen base instead of holding a copy; otherwise it keeps a frozen copy of its own.
        ranks, rank_with, train_backend: score as an SPMD group of ``ranks`` processes
            (``runtime.ranks``), the model sharded over them by FSDP2 (``"hsdp"``: within each
            host) so that no device holds a whole copy, each rank scoring a share of the batch;
            ``rank_with`` names the node whose group it joins (an update with as many ranks:
            its ranks then hold one shard of each model). A group builds its own copy, so
            ``share`` and ``model`` are not read then.
        options: ``device``, ``share``, ``micro_batch_tokens``, ... (:func:`_init_scorer`).
    """

    kind = "reference"
    inputs = _INPUTS
    outputs = {"ref_logprobs": TensorPort("float32", "B", "R")}  # noqa: RUF012
    batch_policy = BatchPolicy(max_batch_size=64)
    execution_options = ("ranks", "rank_with", "train_backend")
    policy = Built("the frozen reference policy, built by setup()")

    def __init__(
        self,
        policy: str | Mapping[str, Any] = "tiny-prefix-vlm",
        temperature: float = 1.0,
        *,
        model: Policy | None = None,
        ranks: int = 1,
        rank_with: str | None = None,
        train_backend: str = "fsdp",
        **options: Any,
    ) -> None:
        _init_scorer(self, **options)
        if not (isinstance(ranks, int) and not isinstance(ranks, bool) and ranks >= 1):
            raise ValueError(
                f"node {self.name!r}: ranks={ranks!r}; give an int >= 1 (the processes that "
                "score together)"
            )
        if train_backend not in ("fsdp", "hsdp"):
            raise ValueError(
                f"node {self.name!r}: train_backend={train_backend!r}; a reference is sharded "
                "by fsdp or hsdp (ddp would hold a whole copy on every rank)"
            )
        if rank_with is not None and ranks == 1:
            raise ValueError(
                f"node {self.name!r}: rank_with={rank_with!r} joins that node's rank group, "
                "which needs ranks > 1 (as many as it has)"
            )
        self.ranks, self.rank_with, self.train_backend = ranks, rank_with, train_backend
        self.base_shared = False
        self._base_lock = threading.Lock()
        if why := temperature_problem(temperature, greedy=False):
            raise ValueError(f"node {self.name!r}: {why}")
        if model is None:
            check_policy_spec(policy)
        self.temperature = float(temperature)
        self.policy_spec = policy
        # copied now: later training of the live model must not reach the reference
        self._model = copy.deepcopy(model) if model is not None else None

    def build(self) -> None:
        if self.ranks > 1:
            self._build_sharded()
            return
        if self._model is None and self.share is not None and self._share_scope is not None:
            live = self._shared_policy(self.share, self.policy_spec)
            # the base is the initial policy only when nothing but the adapters trains (a
            # prefix-VLM's projector trains beside its LoRA adapters: keep a frozen copy then)
            only_adapters = all(
                "lora_" in name for name, p in live.named_parameters() if p.requires_grad
            )
            if (
                getattr(live, "has_lora", False)
                and callable(getattr(live, "adapter_disabled", None))
                and only_adapters
            ):
                self.policy, self.base_shared = live, True  # its frozen base is the reference
                return
            self._release(self.share)  # no adapters: the base trains, keep a frozen copy
        reference = self._model if self._model is not None else build_policy(self.policy_spec)
        self.policy = reference.to(self.device).eval().requires_grad_(False)

    def _build_sharded(self) -> None:
        """Its own copy, sharded over the rank group (every rank builds the same one)."""
        group = self.rank_group
        self.device = join_group(f"node {self.name!r}", group, self.ranks, self.device)
        built = self._model if self._model is not None else build_policy(self.policy_spec)
        reference = built.to(self.device).eval().requires_grad_(False)
        group.join()
        self.policy = reference
        self._sharded_logits = group.shard(
            reference, self.train_backend, "forward_response", lambda out: out.logits
        )

    @torch.no_grad()
    def forward(self, **inputs: Any) -> dict[str, Tensor]:
        return _scores(self, self._scoring(), **inputs)

    def offload(self) -> int:
        """Off the device; a rank group moves each rank's own shards (FSDP2 DTensors, which
        a move of ``.data`` would break)."""
        return super().offload() if self.ranks == 1 else self._move_shards(off=True)

    def reload(self) -> int:
        return super().reload() if self.ranks == 1 else self._move_shards(off=False)

    def _move_shards(self, off: bool) -> int:
        if not self.is_set_up or self.__dict__.get("_shards_off", False) == off:
            return 0  # (idempotent, as the update's switch)
        moved = self.rank_group.move(self.policy, None, off, offload_module.ALWAYS_COPY)
        self._shards_off = off
        return moved

    def claim(self) -> None:
        if self.ranks == 1:
            super().claim()

    @contextlib.contextmanager
    def _scoring(self) -> Iterator[tuple[Policy, Callable[..., Tensor]]]:
        """The reference function: the own copy, or the shared policy with its adapters off
        (one call at a time: the adapters are switched on the shared module)."""

        def logprobs(batch: PromptBatch, response_ids: Tensor, response_mask: Tensor) -> Tensor:
            return self.policy.response_logprobs(
                batch, response_ids, response_mask, temperature=self.temperature
            )  # (b, R')

        def sharded(batch: PromptBatch, response_ids: Tensor, response_mask: Tensor) -> Tensor:
            logits = self._sharded_logits(batch, response_ids, response_mask)  # (b, R', V)
            if self.temperature != 1.0:
                logits = logits / self.temperature
            return logprobs_from_logits(logits, response_ids, response_mask).float()  # (b, R')

        if self.ranks > 1:
            yield self.policy, sharded
            return
        if not self.base_shared:
            yield self.policy, logprobs
            return
        with self._base_lock, self.policy.adapter_disabled():
            yield self.policy, logprobs

    def memory(self, load: Any) -> dict[str, int]:
        """A frozen copy of the policy (none when it reads a shared LoRA policy's base) and
        its largest forward within ``micro_batch_tokens``."""
        if self._model is not None and self.ranks == 1:
            return {}
        from nodes.memory import _lora, scoring_memory

        held = scoring_memory(self.policy_spec, load, self.micro_batch_tokens)
        weights = held.pop("weights")
        if self.ranks > 1:  # its own copy, 1/ranks of it on each rank (hsdp: of a host's)
            hosts = load.hosts if self.train_backend == "hsdp" else 1
            return {**held, "weights@": -(-weights // max(self.ranks // max(hosts, 1), 1))}
        shared_base = self.share is not None and _lora(self.policy_spec)
        return {**held, f"weights@{self.share if shared_base else ''}": weights}


def value_model_fingerprint(critic: Any, device: Any, detach_trunk: bool, head_seed: int) -> str:
    """What a Critic and a PPOUpdate sharing one value model must agree on."""
    return fingerprint(
        "value_model", critic, device, detach_trunk=bool(detach_trunk), head_seed=int(head_seed)
    )


def _value_model(
    node: Any, key: str | None, spec: Any, detach_trunk: bool, head_seed: int, trunk: Any = None
) -> ValueModel:
    """The value model as the Critic builds it (and PPOUpdate its copy, so both start
    identical), on ``node.device``: one module for the nodes of share key ``key``."""

    def build() -> ValueModel:
        return build_value_model(
            spec, detach_trunk=detach_trunk, head_seed=head_seed, device=node.device, trunk=trunk
        )

    fp = value_model_fingerprint(spec, node.device, detach_trunk, head_seed)
    return node._acquire(key, fp, build)


class Critic(Offload, Sharing, Node):
    """``values: float32[B, R]`` from a value head on a policy trunk (0 at padding).

    Args:
        critic: a :func:`nodes.models.policy.build_policy` spec for a separate critic trunk (used
            when ``model`` is None), e.g. ``{"name": "tiny-prefix-vlm", "seed": 1}``.
        model: a live Policy whose trunk is shared (not copied): the value head reads the
            hidden states of the very model the update trains.
        detach_trunk: train only the head through ``value_model`` (see :class:`ValueModel`).
        head_seed: seeds the value head's initialization.
        share: a share key (e.g. ``"critic"``, as ``PPOUpdate(critic_share=...)``): on an
            on-policy executor the nodes of that key use one value model
            (:mod:`nodes.shared_models`); ignored with ``model``.
        ranks, rank_with: score beside the update named ``rank_with``, in its rank group of
            ``ranks`` processes (``runtime.ranks``): each rank reads the update's own sharded
            value model, the one it trains, so the critic holds no copy, and scores a share
            of the batch. Its ``weights`` input then carries only versions.
        options: ``device``, ``share``, ``micro_batch_tokens``, ... (:func:`_init_scorer`).

    The node's ``forward`` runs without grad (values for advantage estimation); an update
    node trains ``critic.value_model`` directly, which is differentiable, or trains its own
    copy (:class:`nodes.update.PPOUpdate`, built from the same ``critic`` spec and
    ``head_seed``) and sends it to the optional ``weights`` input: a versioned
    :class:`nodes.sync.WeightUpdate` of the value model's state dict (``trunk.*``, ``head.*``),
    loaded before the values are computed; versions not newer than the loaded one are skipped.
    """

    kind = "critic"
    inputs = {  # noqa: RUF012
        **_INPUTS,
        "weights": Port(
            ANY, required=False, doc="value-model weights from an update node, loaded first"
        ),
    }
    outputs = {"values": TensorPort("float32", "B", "R")}  # noqa: RUF012
    batch_policy = BatchPolicy(max_batch_size=64)
    execution_options = ("ranks", "rank_with")
    value_model = Built("the ValueModel (trunk and head), built by setup()")

    def __init__(
        self,
        critic: str | Mapping[str, Any] = "tiny-prefix-vlm",
        model: Policy | None = None,
        detach_trunk: bool = False,
        head_seed: int = 0,
        *,
        ranks: int = 1,
        rank_with: str | None = None,
        **options: Any,
    ) -> None:
        _init_scorer(self, **options)
        if not (isinstance(ranks, int) and not isinstance(ranks, bool) and ranks >= 1):
            raise ValueError(f"node {self.name!r}: ranks={ranks!r}; give an int >= 1")
        if (ranks > 1) != (rank_with is not None):
            raise ValueError(
                f"node {self.name!r}: ranks={ranks}, rank_with={rank_with!r}: a critic runs "
                "as ranks only beside the update that trains its value model; give both (the "
                "update's name and its ranks) or neither"
            )
        self.ranks, self.rank_with = ranks, rank_with
        if model is None:
            check_policy_spec(critic)
        self.shared = model is not None
        self.critic_spec, self._model = critic, model
        self.detach_trunk, self.head_seed = bool(detach_trunk), int(head_seed)
        self.weights_in = WeightInput()

    @property
    def weights_version(self) -> int:
        """The newest value-model weights version loaded (0: as built)."""
        return self.weights_in.version

    def renamed(self, name: str) -> Critic:
        """A copy under another name, with loaded weights of its own."""
        other = super().renamed(name)
        other.weights_in = copy.copy(self.weights_in)
        return other

    def build(self) -> None:
        if self.ranks > 1:  # the update's value model, found at the first call
            self.device = join_group(
                f"node {self.name!r}", self.rank_group, self.ranks, self.device
            )
            self.rank_group.join()
            return
        key = self.share if self._model is None else None  # a live trunk is this node's own
        self.value_model = _value_model(
            self, key, self.critic_spec, self.detach_trunk, self.head_seed, self._model
        )

    def _trainer(self) -> Any:
        """Beside its update (``rank_with``): that node, set up in this process."""
        leader = self.rank_group.members.get(self.rank_with)
        if leader is None or not hasattr(leader, "critic_spec"):
            raise ValueError(
                f"node {self.name!r}: rank_with={self.rank_with!r} names no PPO update of this "
                f"rank group (it holds {sorted(self.rank_group.members)})"
            )
        return leader

    def _load(self, weights: Any) -> None:
        """Load a weight-sync payload into the value model (``PPOUpdate``'s ``critic_weights``),
        as the rollout loads its ``weights`` (:class:`nodes.sync.WeightInput`); beside the
        update, only its version (the model is the update's own)."""
        update = self.weights_in.newer(weights, self.name)
        if update is None:
            return
        if self.ranks > 1:
            self.weights_in.loaded(weights, update)
            return
        if not (self.share is not None and same_storage(self.value_model, update.weights)):
            try:  # (a shared model's own tensors: nothing to copy)
                apply_weights(self.value_model, update)
            except (TypeError, ValueError, RuntimeError) as err:
                raise ValueError(f"node {self.name!r}: input 'weights': {err}") from err
        self.weights_in.loaded(weights, update)

    def memory(self, load: Any) -> dict[str, int]:
        """The value model's trunk and its largest forward within ``micro_batch_tokens``
        (beside its update: the forward only, the model being the update's)."""
        if self._model is not None:
            return {}
        from nodes.memory import scoring_memory

        held = scoring_memory(self.critic_spec, load, self.micro_batch_tokens, logits=False)
        return {"activations": held["activations"]} if self.ranks > 1 else held

    @torch.no_grad()
    def forward(self, weights=None, **inputs: Any) -> dict[str, Tensor]:
        self._load(weights)
        return _scores(self, self._scoring(), **inputs)

    def offload(self) -> int:
        """The value model off the device; the last unversioned weights payload let go.
        Beside its update nothing moves: the model is the update's, which moves it."""
        self.weights_in.release()
        return super().offload() if self.ranks == 1 else 0

    def reload(self) -> int:
        return super().reload() if self.ranks == 1 else 0

    def claim(self) -> None:
        if self.ranks == 1:
            super().claim()

    @contextlib.contextmanager
    def _scoring(self) -> Iterator[tuple[Policy, Callable[..., Tensor]]]:
        """The value model, its trunk in eval mode for the call (an update may train it);
        beside its update, the update's sharded one."""
        if self.ranks > 1:
            leader = self._trainer()
            moded, score = leader.value_model, leader.sharded_values
            trunk = moded.trunk
        else:
            moded = trunk = self.value_model.trunk
            score = self.value_model
        was_training = moded.training
        moded.eval()
        try:
            yield trunk, score
        finally:
            moded.train(was_training)

    def state_dict(self) -> dict[str, Any]:
        """The value head, plus the trunk when it is this node's own (not shared); beside
        its update, none: the update's checkpoint holds the value model."""
        if self.ranks > 1:
            return {}
        state: dict[str, Any] = {
            "head": {k: v.detach().cpu() for k, v in self.value_model.head.state_dict().items()}
        }
        if not self.shared:
            state["trunk"] = {
                k: v.detach().cpu() for k, v in self.value_model.trunk.state_dict().items()
            }
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.ranks > 1:  # the update restores the value model it trains
            self.weights_in.forget()
            return
        expected = {"head"} if self.shared else {"head", "trunk"}
        if set(state) != expected:
            raise ValueError(
                f"node {self.name!r}: expected state keys {sorted(expected)}, got {sorted(state)}"
            )
        self.value_model.head.load_state_dict(state["head"])
        if "trunk" in state:
            self.value_model.trunk.load_state_dict(state["trunk"])
        # the restored weights replace whatever version was loaded: accept the next one
        self.weights_in.forget()
