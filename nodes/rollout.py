"""The rollout node: sample responses from a policy, with the logprobs an RL update needs.

Backends:

* ``"hf"`` (default): :meth:`nodes.models.policy.Policy.generate`, i.e. transformers ``generate``
  with a KV cache, on any device.
* ``"vllm"``: a vLLM engine (:mod:`nodes.models.vllm_engine`) on the policy's local checkpoint
  directory (a tiny policy built in code is saved to a temporary one), only when vllm is
  installed and CUDA is available (constructing it otherwise raises a ValueError saying which
  is missing). A weight update on the ``weights`` port goes into the HF policy and into the
  running engine (checkpoint names, through a worker method called by name; one whose version
  is not newer is skipped); its logprobs are vLLM's own unless top-p/top-k is on or
  ``recompute_logprobs=True`` (then teacher-forced with the HF policy). The engine runs on the
  node's GPU (``device="cuda:1"``: that one). ``vllm_options``: gpu_memory_utilization (None:
  derived from what the GPU has free and whether the engine sleeps, ``vllm_options.gpu_share``),
  tensor_parallel_size, dtype, enable_sleep_mode (the engine sleeps after each call, for
  colocated placement), bucket_mb (see ``vllm_options.OPTIONS``).

``weight_sync`` (a dict of numbers a call, the same in every streamed piece) says what loading
weights took in the call: ``seconds`` (in all), ``bytes`` (the tensors of the update the call
loaded; 0 without a new one), ``hf_seconds`` (into the HF policy, synchronized on a GPU; about
0 where it shares the update's module), and with vLLM ``engine_seconds`` and ``engine_bytes``
(into the engine: the update's tensors under their checkpoint names, or the policy's own when
a sleeping engine generates with no update since) and ``ipc`` (1 when the engine takes its
updates by CUDA IPC, 0 by bytes: :mod:`nodes.models.vllm_engine`).

Logprobs (``logprobs`` port) are ``log softmax(logits / temperature)`` of each sampled token:
the temperature-scaled policy *before* top-k/top-p truncation (T = 1 when greedy). Computed
from the scores of the cached generation pass by default; ``recompute_logprobs=True`` recomputes
them with a teacher-forced forward (``Policy.response_logprobs``), exactly what an update sees.
The two agree within float error (about 1e-6 on CPU in float32; see tests/nodes/test_rollout.py).
``rollout_logprobs`` are the sampler's own (vLLM's, or the generation pass's), whichever the
``logprobs`` port holds: with recomputed ``logprobs`` an update measures the gap between the
two and may correct for it (its ``tis_cap``). Where the sampler reports none (vLLM with
top-p/top-k) they are the recomputed ones.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from nodes.chat import chat_messages
from nodes.models.flat import nbytes
from nodes.models.offload import Offload
from nodes.models.policy import (
    Generation,
    HFVisionLanguagePolicy,
    Policy,
    PrefixVLM,
    check_policy_spec,
)
from nodes.models.precision import autocast, check_precision
from nodes.models.prompts import fit_prompts
from nodes.models.sampling import NotFiniteError, sampling_problem
from nodes.models.vllm_engine import VLLMEngine
from nodes.models.vllm_options import (
    check_vllm_options,
    checkpoint_dir,
    gpu_share,
    refuse_quantized,
    vllm_unavailable_reason,
)
from nodes.seeding import seeded, step_seed
from nodes.shared_models import Sharing, check_share_key, same_storage
from nodes.sync import WeightInput
from yatt_graph import ANY, BatchPolicy, Node, Port, UsageError
from yatt_graph import Tensor as TensorPort
from yatt_graph.node import Built

__all__ = ["Rollout", "vllm_unavailable_reason"]

_BACKENDS = ("hf", "vllm")


class _Call(NamedTuple):
    """One call's prepared inputs."""

    N: int
    prompts: list[str]  # B = N * n
    images: list[Any] | None  # B or None
    batch: Any  # the policy's PromptBatch
    seed: int


class _StepCounter:
    """A rollout's calls in order: the seed each samples with, the group labels it gives, and
    the pieces of a step that replicas sample (:mod:`runtime.sched.fanout`).

    A call draws from one random stream seeded by the rollout's ``seed`` and its call count
    (``step``), and labels its prompts' groups from ``next_group`` on. A replica's piece of a
    step is seeded from the step and its first row instead, so that it samples the same tokens
    on whichever replica runs it, and its groups keep the step's labels.
    """

    def __init__(self, seed: int, n: int) -> None:
        self.seed, self.n = seed, n
        self.step = 0
        """Calls so far (the pieces of a step count once): the next call's seed."""
        self.next_group = 0
        """The group label of the next call's first prompt."""
        self.piece: tuple[dict[str, int], list[int]] | None = None
        """While a replica samples a piece: the step's context and the piece's prompt rows."""

    def seed_of(self, prompts: int, who: str) -> int:
        """The seed of this call of ``prompts`` prompts: the step's, or its piece's."""
        if self.piece is None:
            return step_seed(self.seed, self.step)
        ctx, rows = self.piece  # a replica's piece: its own seed, from its first row
        if len(rows) != prompts:
            raise ValueError(f"{who}: begin_piece was given {len(rows)} rows for {prompts} prompts")
        return step_seed(step_seed(self.seed, ctx["step"]), 1 + rows[0])

    def group_ids(self, rows: Tensor) -> Tensor:
        prompt = rows // self.n  # the prompt of each response row, in this call
        if self.piece is None:
            return self.next_group + prompt
        ctx, piece_rows = self.piece  # prompt i of the piece is prompt piece_rows[i] of the step
        return ctx["next_group"] + torch.tensor(piece_rows, dtype=torch.int64)[prompt]

    def done(self, prompts: int) -> None:
        if self.piece is None:  # a piece leaves the counters to end_pieces
            self.step += 1
            self.next_group += prompts


class Rollout(Offload, Sharing, Node):
    """Prompts (+ images or image embeddings) -> sampled responses and their logprobs.

    With ``n`` samples per prompt, outputs have B = N * n rows, the n samples of a prompt in
    consecutive rows, and ``group_ids`` label each prompt's group (unique across calls of this
    node, so batches of different steps never share a label).

    Sampling is deterministic given ``seed`` and the node's step counter (the number of calls
    so far, saved in ``state_dict``): call k of two nodes with the same seed draws the same
    samples, and the global torch RNG is left untouched.

    With ``stream=True`` (HF backend) the node streams (:mod:`yatt_graph.stream`): executors
    run :meth:`forward_stream`, which hands out the rows that finished every ``stream_every``
    decode steps while the rest are still generating, so that a consumer on another
    controller starts on short responses before the longest is done. Joined, the pieces are
    what :meth:`forward` returns for the same call (the same samples; see
    :mod:`nodes.models.sampling`). ``node.run()`` still returns the whole batch.

    Args:
        policy: a spec for :func:`nodes.models.policy.build_policy` (``"tiny-prefix-vlm"``, a local
            checkpoint directory, ...).
        backend: ``"hf"`` or ``"vllm"``.
        n: samples per prompt.
        temperature: 0 means greedy decoding.
        top_p, top_k: nucleus and top-k truncation (1.0 / 0 = off).
        max_new_tokens: the longest response.
        max_prompt_tokens: a longer prompt keeps its last this many tokens (None: a prompt
            that leaves no room for ``max_new_tokens`` in the model's context is an error
            naming it); see :func:`nodes.models.prompts.fit_prompts`.
        stop: stop strings; a response ends with the token that completes one (kept).
        stop_token_ids: token ids that end a response (kept), besides the EOS token.
        seed: base of the per-step seeds.
        recompute_logprobs: recompute logprobs teacher-forced after sampling (exact).
        device: where the policy runs; the outputs are on it.
        model: a live Policy to use instead of building one from ``policy`` (tests, notebooks).
        stream: hand out finished rows as they end (HF backend; not with ``recompute_logprobs``).
        stream_every: with ``stream``, how many decode steps a piece gathers finished rows.
        vllm_options: with ``backend="vllm"``, engine options (:mod:`nodes.models.vllm_options`).
        precision: ``"bf16"``: the HF backend samples (and recomputes logprobs) under bf16
            autocast, as a ``mixed_precision="bf16"`` update computes; ``"no"``: in the weights'
            dtype (:mod:`nodes.models.precision`).
        share: a share key (e.g. ``"policy"``): on an on-policy executor, nodes with the same
            key use one module (:mod:`nodes.shared_models`); HF backend only, ignored with
            ``model``.
    """

    kind = "rollout"
    inputs = {  # noqa: RUF012
        "prompts": ANY,
        "images": Port(ANY, required=False, doc="list[PIL.Image], one per prompt (HF VLMs)"),
        "image_embeds": Port(TensorPort("float32", "N", "D"), required=False, doc="PrefixVLM"),
        "weights": Port(ANY, required=False, doc="a state dict loaded before sampling"),
    }
    outputs = {  # noqa: RUF012
        "prompt_ids": TensorPort("int64", "B", "P"),
        "prompt_mask": TensorPort("int64", "B", "P"),
        "response_ids": TensorPort("int64", "B", "R"),
        "response_mask": TensorPort("float32", "B", "R"),
        "logprobs": TensorPort("float32", "B", "R"),
        "rollout_logprobs": Port(
            TensorPort("float32", "B", "R"), doc="the sampler's own logprobs (see the module doc)"
        ),
        "response_lengths": TensorPort("int64", "B"),
        "texts": ANY,
        "group_ids": TensorPort("int64", "B"),
        "truncated": Port(
            TensorPort("float32", "B"), doc="1.0 where the response was cut at max_new_tokens"
        ),
        "weight_sync": Port(ANY, doc="dict: the call's weight loads, seconds and bytes"),
    }
    batch_policy = BatchPolicy(max_batch_size=64, splittable=False)
    """Not splittable by the in-process splitter: a call draws from one random stream seeded by
    the call count, so two halves of a batch would not sample what the whole batch samples.
    Replicas (``BatchPolicy(replicas=R)``, :mod:`runtime.sched.fanout`) cut a step into
    pieces another way: each piece is sampled with a seed of its own (:meth:`begin_piece`)."""
    left_padded = ("prompt_ids", "prompt_mask")
    """Outputs padded on the left, for joining pieces of different widths."""
    policy = Built("the policy that samples, built from the ``policy`` spec by setup()")

    def __init__(
        self,
        policy: str | Mapping[str, Any] = "tiny-prefix-vlm",
        backend: str = "hf",
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int = 32,
        max_prompt_tokens: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        seed: int = 0,
        recompute_logprobs: bool = False,
        device: str = "cpu",
        model: Policy | None = None,
        name: str | None = None,
        stream: bool = False,
        stream_every: int = 1,
        vllm_options: Mapping[str, Any] | None = None,
        share: str | None = None,
        *,
        precision: str = "no",
        placement: str | int | None = None,
        batch_policy: BatchPolicy | None = None,
    ) -> None:
        super().__init__(name, placement=placement, batch_policy=batch_policy)
        where = f"node {self.name!r}"
        self.precision = check_precision(precision, where)
        if backend not in _BACKENDS:
            raise ValueError(f"{where}: backend={backend!r}; choose one of {_BACKENDS}")
        if n < 1 or max_new_tokens < 1 or (max_prompt_tokens is not None and max_prompt_tokens < 1):
            raise ValueError(
                f"{where}: n={n}, max_new_tokens={max_new_tokens}, max_prompt_tokens="
                f"{max_prompt_tokens}; each must be >= 1"
            )
        if why := sampling_problem(temperature, top_p, top_k):
            raise ValueError(f"{where}: {why}")
        if isinstance(stop, str):
            raise ValueError(f"{where}: stop must be a list of strings, got the string {stop!r}")
        if stream and (backend != "hf" or recompute_logprobs or stream_every < 1):
            raise ValueError(
                f"{where}: stream=True needs backend='hf', recompute_logprobs=False and "
                f"stream_every >= 1 (got backend={backend!r}, recompute_logprobs="
                f"{recompute_logprobs}, stream_every={stream_every}): a recomputed or vLLM "
                "batch is only known whole"
            )
        if model is None:
            check_policy_spec(policy)
        if backend == "vllm" and (why := vllm_unavailable_reason()):
            raise ValueError(f"{where}: backend='vllm' is unavailable: {why}; use backend='hf'")
        if backend == "vllm" and (path := checkpoint_dir(policy, model)) is not None:
            refuse_quantized(path, where)
        self.backend = backend
        self.n = int(n)
        self.rows_per_input = self.n  # (Node: for the executor's cost estimates)
        self.sampling = {
            "max_new_tokens": int(max_new_tokens),
            "temperature": float(temperature),
            "top_p": float(top_p),
            "top_k": int(top_k),
            "stop_token_ids": [int(t) for t in stop_token_ids],
            "stop_strings": [str(s) for s in stop],
        }
        self.max_prompt_tokens = None if max_prompt_tokens is None else int(max_prompt_tokens)
        self.seed = int(seed)
        self.stream, self.stream_every = bool(stream), int(stream_every)
        self.recompute_logprobs = bool(recompute_logprobs)
        self.vllm_options = check_vllm_options(vllm_options or {}, where)
        self.device = torch.device(device)
        self.policy_spec = policy
        self._model = model
        self.share = check_share_key(share, where)
        self.counter = _StepCounter(self.seed, self.n)
        self.weights_in = WeightInput()
        self._vllm: VLLMEngine | None = None
        self._sync: dict[str, float] = {"seconds": 0.0, "bytes": 0, "hf_seconds": 0.0}

    @property
    def step(self) -> int:
        """Calls so far, the next call's seed (:class:`_StepCounter`; ``Node.begin_step`` sets it)."""
        return self.counter.step

    @step.setter
    def step(self, step: int) -> None:
        self.counter.step = step

    @property
    def next_group(self) -> int:
        """The group label of the next call's first prompt."""
        return self.counter.next_group

    @property
    def weights_version(self) -> int:
        """The newest weights version loaded (0: the built weights, or a plain state dict)."""
        return self.weights_in.version

    def renamed(self, name: str) -> Rollout:
        """A copy under another name, with counters and loaded weights of its own."""
        other = super().renamed(name)
        other.counter, other.weights_in = copy.copy(self.counter), copy.copy(self.weights_in)
        return other

    def build(self) -> None:
        if self._model is not None:
            model = self._model
        else:
            key = self.share if self.backend == "hf" else None  # vLLM holds its own weights
            model = self._shared_policy(key, self.policy_spec)
        self.policy = model.to(self.device).eval()
        if self.backend == "vllm":
            self._vllm = VLLMEngine(
                self.policy, checkpoint_dir(self.policy_spec, self._model), seed=self.seed,
                sampling=self.sampling, options=self.vllm_options, who=f"node {self.name!r}",
                device=self.device,
            )  # fmt: skip

    # --- inputs ------------------------------------------------------------------------------
    def _check(self, prompts: Any, images: Any, image_embeds: Tensor | None) -> int:
        where = f"node {self.name!r}"
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError(
                f"{where}: input 'prompts' must be a non-empty list of prompts (text, or "
                "chat messages)"
            )
        for i, p in enumerate(prompts):
            try:
                chat_messages(p)
            except ValueError as exc:
                raise ValueError(f"{where}: prompts[{i}]: {exc}") from None
        N = len(prompts)
        if images is not None and (not isinstance(images, Sequence) or len(images) != N):
            got = len(images) if isinstance(images, Sequence) else type(images).__name__
            raise ValueError(
                f"{where}: input 'images' must be a list of {N} images (one per prompt), got {got}"
            )
        if image_embeds is not None and image_embeds.shape[0] != N:
            raise ValueError(
                f"{where}: input 'image_embeds' has {image_embeds.shape[0]} rows for {N} prompts"
            )
        if isinstance(self.policy, PrefixVLM) and images is not None:
            raise ValueError(
                f"{where}: this PrefixVLM policy reads 'image_embeds' (from a VisionEncoder), "
                "not 'images'; connect the encoder's output instead"
            )
        if isinstance(self.policy, HFVisionLanguagePolicy) and image_embeds is not None:
            raise ValueError(
                f"{where}: this HF VLM policy has its own vision tower and reads 'images', "
                "not 'image_embeds'"
            )
        return N

    def _load(self, weights: Any) -> None:
        """Load a weight-sync payload (:class:`nodes.sync.WeightInput`: once, only when newer),
        timed for the ``weight_sync`` output."""
        self._sync = {"seconds": 0.0, "bytes": 0, "hf_seconds": 0.0}
        update = self.weights_in.newer(weights, self.name)
        if update is None:
            return
        who = f"node {self.name!r}: input 'weights'"
        start = time.perf_counter()
        if not (self.share is not None and same_storage(self.policy, update.weights)):
            # (a shared module's own tensors: nothing to copy)
            self.policy.load_weights(update.weights, strict=update.complete, who=who)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self._sync["hf_seconds"] = time.perf_counter() - start
        self._sync["bytes"] = sum(map(nbytes, update.weights.values()))
        if self._vllm is not None:
            self._vllm.load_weights(update.weights, complete=update.complete)
        self.weights_in.loaded(weights, update)

    def _weight_sync(self) -> dict[str, float]:
        """The call's ``weight_sync`` output (made once a call: every piece holds the same)."""
        sync = self._sync
        if "engine_seconds" not in sync and self._vllm is not None:
            seconds, nbytes = self._vllm.take_loaded()
            sync.update(engine_seconds=seconds, engine_bytes=nbytes)
            sync["ipc"] = float(self._vllm.update_path == "ipc")
        sync["seconds"] = sync["hf_seconds"] + sync.get("engine_seconds", 0.0)
        return sync

    # --- the work ----------------------------------------------------------------------------
    @property
    def streaming(self) -> bool:
        """Whether executors run :meth:`forward_stream` (``stream=True``)."""
        return self.stream

    def _prepare(self, prompts, images, image_embeds, weights) -> _Call:
        """Check the inputs and load synced weights; the call's B = N * n batch and seed."""
        N = self._check(prompts, images, image_embeds)
        self._load(weights)
        n = self.n
        prompts_b = [p for p in prompts for _ in range(n)]  # B = N * n, grouped
        images_b = None if images is None else [im for im in images for _ in range(n)]
        embeds_b = None if image_embeds is None else image_embeds.repeat_interleave(n, 0)  # (B, D)
        batch = self.policy.encode_prompts(prompts_b, images=images_b, image_embeds=embeds_b)
        batch = fit_prompts(
            self.policy, batch, prompts_b, max_new_tokens=self.sampling["max_new_tokens"],
            max_prompt_tokens=self.max_prompt_tokens, who=f"node {self.name!r}",
        )  # fmt: skip
        seed = self.counter.seed_of(N, f"node {self.name!r}")
        return _Call(N, prompts_b, images_b, batch.to(self.device), seed)

    def _outputs(
        self, batch: Any, gen: Generation, logprobs: Tensor, rows: Tensor, sampled: Tensor
    ) -> dict[str, Any]:
        """The ports for ``rows`` (int64[r]) of the batch, given their generation, the
        logprobs the update takes and the sampler's own: tensors on the node's device."""
        out = {
            "prompt_ids": batch.prompt_ids[rows.to(batch.prompt_ids.device)],
            "prompt_mask": batch.prompt_mask[rows.to(batch.prompt_mask.device)],
            "response_ids": gen.response_ids,
            "response_mask": gen.response_mask,
            "logprobs": logprobs.float(),
            "rollout_logprobs": sampled.float(),
            "response_lengths": gen.response_lengths,
            "texts": gen.texts,
            "group_ids": self.counter.group_ids(rows),
            "truncated": gen.truncated.float(),
            "weight_sync": self._weight_sync(),
        }
        return self._on_device(out)

    def memory(self, load: Any) -> dict[str, int]:
        """The policy, the KV cache of every response at full length and the prefill (a
        vLLM engine's cache is the share of the GPU it is given)."""
        if self._model is not None:
            return {}
        from nodes.memory import sampling_memory

        held = sampling_memory(self.policy_spec, load)
        if self.backend == "vllm" and self.device.type == "cuda" and torch.cuda.is_available():
            total = torch.cuda.get_device_properties(self.device.index or 0).total_memory
            share = self.vllm_options["gpu_memory_utilization"]
            if share is None:  # as the engine will derive it, on a device free when it starts
                sleeps = bool(self.vllm_options["enable_sleep_mode"])
                share = gpu_share(total, total, sleeps=sleeps)
            held["kv_cache"] = max(int(total * share) - held["weights"], 0)
        return held

    def pad_values(self) -> dict[str, int]:
        """Pad values of the ragged outputs, for joining pieces (ids: the tokenizer's pad id)."""
        pad = self.policy.pad_token_id
        return {"prompt_ids": pad, "response_ids": pad}

    def forward(self, prompts, images, image_embeds, weights) -> dict[str, Any]:
        call = self._prepare(prompts, images, image_embeds, weights)
        batch = call.batch
        if self._vllm is not None:
            gen = self._vllm.generate(call.prompts, call.images, call.seed, batch)
            self._vllm.sleep()  # with enable_sleep_mode: the device is free until the next call
        else:
            with self._seeded(call.seed):
                gen = self.policy.generate(batch, **self.sampling, precision=self.precision)
        logprobs = sampled = gen.logprobs
        own = self._vllm is None or self._vllm.own_logprobs  # the sampler reported its logprobs
        if self.recompute_logprobs or not own:
            logprobs = self._teacher_logprobs(batch, gen.response_ids, gen.response_mask)
            sampled = sampled if own else logprobs
        out = self._outputs(batch, gen, logprobs, torch.arange(len(batch)), sampled)
        self.counter.done(call.N)
        return out

    @contextlib.contextmanager
    def _seeded(self, seed: int) -> Iterator[None]:
        """Draw from the global generator seeded with ``seed``; its state is restored after.
        A sampler that meets non-finite probabilities says whose weights are to blame."""
        try:
            with seeded(seed, self.device):
                yield
        except NotFiniteError as exc:
            cause = (
                f"its weights (version {self.weights_version}, the newest the update sent) have "
                "diverged: lower the learning rate or set max_grad_norm, and resume from a "
                "checkpoint written before that version"
                if self.weights_version
                else "its weights as built are not finite: check the model folder"
            )
            raise UsageError(
                f"node {self.name!r}: the policy's next-token probabilities are not finite, so "
                f"it cannot sample; {cause}"
            ) from exc

    def _on_device(self, outputs: dict[str, Any]) -> dict[str, Any]:
        """A call's ``outputs`` with their tensors on the node's device (its readers off that
        device get host copies: ``runtime/engine/calls.py``)."""
        return {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in outputs.items()}

    @torch.no_grad()
    def _teacher_logprobs(self, batch: Any, response_ids: Tensor, reads: Tensor) -> Tensor:
        """The responses' logprobs recomputed teacher-forced, reading the tokens of ``reads``
        (exactly what an update sees): float[B, R]."""
        temperature = self.sampling["temperature"] or 1.0
        with autocast(self.device, self.precision):
            return self.policy.response_logprobs(
                batch, response_ids, reads, temperature=temperature
            )

    def forward_stream(self, prompts, images, image_embeds, weights) -> Iterator[Any]:
        """Yield ``(rows, outputs)`` as responses end (see the class docstring)."""
        call = self._prepare(prompts, images, image_embeds, weights)
        with self._seeded(call.seed):
            every = self.stream_every
            stream = self.policy.generate_stream(
                call.batch, every=every, **self.sampling, precision=self.precision
            )
            for rows, gen in stream:
                rows_t = torch.tensor(rows)
                outputs = self._outputs(call.batch, gen, gen.logprobs, rows_t, gen.logprobs)
                yield rows, outputs, len(call.batch)  # B: consumers may take per-sample inputs
        self.counter.done(call.N)

    # --- replicas (runtime.sched.fanout) ---------------------------------------------------
    def piece_context(self) -> dict[str, int]:
        """What every replica needs to sample its piece of this step as the step's own: the
        call count (for the seed) and the first group label."""
        return {"step": self.counter.step, "next_group": self.counter.next_group}

    def begin_piece(self, context: Mapping[str, int], rows: Sequence[int]) -> None:
        """The next call is the piece of a step holding prompts ``rows`` (their positions in
        the step's batch): it is seeded from ``context["step"]`` and ``rows[0]``, so a piece
        samples the same tokens on whichever replica runs it, and its ``group_ids`` are the
        step's. :meth:`end_piece` ends the piece."""
        self.counter.piece = ({k: int(v) for k, v in context.items()}, [int(r) for r in rows])

    def end_piece(self) -> None:
        self.counter.piece = None

    def end_pieces(self, context: Mapping[str, int], prompts: int) -> None:
        """All pieces of the step that ``context`` began are in: count it as one call."""
        self.counter.step = int(context["step"]) + 1
        self.counter.next_group = int(context["next_group"]) + int(prompts)

    # --- the device, when roles take turns on it ----------------------------------------------
    def offload(self) -> int:
        """The HF policy off the device (:mod:`nodes.models.offload`) and a vLLM engine asleep
        (with ``enable_sleep_mode``; its memory is not counted in the bytes)."""
        moved = super().offload()
        self.weights_in.release()
        if self._vllm is not None:
            self._vllm.sleep()
        return moved

    def reload(self) -> int:
        moved = super().reload()
        if self._vllm is not None:
            self._vllm.wake_up()
        return moved

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The step and group counters and the loaded weights' version. Weights are not
        included: they come from ``policy`` (rebuilt from the config) and the ``weights`` port."""
        c = self.counter
        return {"step": c.step, "next_group": c.next_group, "weights_version": self.weights_version}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        keys = {"step", "next_group", "weights_version"}
        if not {"step", "next_group"} <= set(state) <= keys:
            raise ValueError(
                f"node {self.name!r}: expected state keys {sorted(keys)}, got {sorted(state)}"
            )
        self.counter.step, self.counter.next_group = int(state["step"]), int(state["next_group"])
        self.weights_in.forget(int(state.get("weights_version", 0)))
