"""The vLLM rollout engine: sampling with vLLM, weight updates into the running engine.

Only reached where vllm imports and CUDA exists (``vllm_unavailable_reason`` in
:mod:`nodes.models.vllm_options` says why not, and is the one error a CPU machine gives). The
CPU tests check the rest without vllm: the names an update carries
(:mod:`nodes.models.vllm_names`), the payload's round trip through msgpack, the receiver, and
the engine's wiring against a stand-in ``vllm`` (the CUDA IPC path with its CUDA calls faked:
tests/nodes/test_vllm_ipc.py; bench/gpu_check.py runs them).

**Weight updates** go through vLLM's supported interface, as public RL frameworks do: a
worker extension class named by its dotted path (``LLM(worker_extension_cls=...)``), whose
methods are called by **name** with ``LLM.collective_rpc(name, args=(...,))``. Nothing
callable crosses the process boundary, so vLLM's V1 engine (the model in another process)
needs no ``VLLM_ALLOW_INSECURE_SERIALIZATION``: the engine core decodes a utility call's
arguments with an untyped msgpack decoder (``vllm/v1/engine/core.py``, ``generic_decoder``;
``vllm/v1/serial_utils.py``), which rebuilds no tensor, so every argument is a plain msgpack
value. Each tensor goes under its checkpoint name, and the worker hands it to
``model_runner.model.load_weights``, which maps checkpoint names to vLLM's fused parameters
itself (``hf_to_vllm_mapper``; each tensor-parallel rank takes its shard). Two paths:

* **CUDA IPC** (:mod:`nodes.models.vllm_ipc`; the engine on CUDA, ``tensor_parallel_size`` 1,
  its worker in another process): the tensors are copied on the GPU into one staging bucket
  that the worker opened once (its IPC fields as plain values, the GPU named by its UUID),
  ``bucket_mb`` MiB a call (``load_ipc_weights``: per tensor ``[name, dtype, shape,
  offset]``), and the worker loads views of it. No host copy.
* **bytes** (otherwise, or after the worker could not open the bucket: then for the engine's
  life, said in one line on stderr): ``[name, dtype, shape, bytes]`` (:func:`pack_weights`)
  in calls of at most ``bucket_mb`` MiB (``load_hf_weights``), rebuilt on the worker's device
  (:func:`unpack_weights`); each tensor is copied to the host and through msgpack.

:attr:`VLLMEngine.update_path` says which; :meth:`VLLMEngine.take_loaded` the seconds and
bytes of the updates since it was last asked (the Rollout's ``weight_sync`` output).

Followed: vLLM ``examples/offline_inference/rlhf_utils.py`` (``WorkerExtension``, a method per
update called through ``collective_rpc``; ``ColocateWorkerExtension``, one IPC buffer with
per-tensor offsets) and ``vllm/entrypoints/llm.py`` (``collective_rpc``, ``sleep(level)``,
``wake_up(tags)``); OpenRLHF ``openrlhf/trainer/ray/vllm_worker_wrap.py``
(``WorkerWrap.update_weight``: ``model_runner.model.load_weights(weights=[(name, w)])``) and
``openrlhf/trainer/ray/vllm_engine.py`` (``worker_extension_cls`` by dotted name,
``logprobs_mode``, ``enable_sleep_mode``); verl ``verl/workers/rollout/vllm_rollout/utils.py``
(``vLLMColocateWorkerExtension.update_weights_from_ipc``: a bucket of tensors, then
``load_weights``). verl and OpenRLHF pass the IPC handle as a pickled rebuild function on a
side channel; here its fields travel as plain values through ``collective_rpc`` itself.

**Logprobs**: vLLM's own sampled-token logprobs (``logprobs=0``) by default:
``logprobs_mode="processed_logprobs"`` gives log softmax(logits / T), the Rollout's convention
(``raw_logprobs`` when greedy: T = 1). With top-p/top-k (which vLLM applies before it
reports them) or ``recompute_logprobs=True`` the Rollout recomputes them teacher-forced with
the HF policy.

After the last bucket of an update the engine's prefix, multimodal and encoder caches are
reset (vLLM resets them only on sleep): their entries were computed with the old weights, and
a repeated prompt or image would otherwise decode against them. What vLLM reports loaded is
checked (a complete update reaches every parameter), and a quantized checkpoint is refused.

**Sleep** (``enable_sleep_mode``, colocated placement): :meth:`VLLMEngine.sleep` frees the
engine's GPU memory at level 2 (weights and KV cache dropped, nothing copied to the host: the
next update overwrites the weights); a weight update wakes the weights alone, a generation
wakes the rest, and one with no update since the sleep first sends the policy's weights.

Every generation compares vLLM's prompt token ids with the policy's for each row, and stops
on a difference (two processors expanding image placeholders differently).

The engine's options, its GPU and its share of it are checked and derived before it starts
(:mod:`nodes.models.vllm_options`).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from nodes.models import vllm_ipc
from nodes.models.flat import nbytes
from nodes.models.policy_base import Generation
from nodes.models.vllm_names import checkpoint_items, hf_model_of
from nodes.models.vllm_options import (
    _cuda_index,
    _visible_gpus,
    check_vllm_options,
    gpu_share,
    refuse_quantized,
)

__all__ = ["VLLMEngine", "WeightReceiver", "pack_weights", "unpack_weights"]

#: the names :class:`WeightReceiver`'s methods are called by: the bytes path, the CUDA IPC path
RECEIVE = "load_hf_weights"
RECEIVE_IPC = "load_ipc_weights"


# --- the payload ------------------------------------------------------------------------------
def pack_weights(
    items: Sequence[tuple[str, Tensor]], bucket_bytes: int
) -> Iterator[list[list[Any]]]:
    """Buckets of ``[name, dtype, shape, bytes]``, plain msgpack values, each bucket at most
    ``bucket_bytes`` of tensor data (a larger tensor goes alone)."""
    bucket: list[list[Any]] = []
    size = 0
    for name, tensor in items:
        t = tensor.detach().to("cpu").contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        if bucket and size + len(data) > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), data])
        size += len(data)
    if bucket:
        yield bucket


def unpack_weights(bucket: Sequence[Sequence[Any]], device: Any) -> list[tuple[str, Tensor]]:
    """The tensors of one :func:`pack_weights` bucket, on ``device``."""
    out = []
    for name, dtype, shape, data in bucket:
        dt = getattr(torch, dtype)
        if len(data) == 0:
            tensor = torch.empty(tuple(shape), dtype=dt)
        else:
            tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(shape)
        out.append((str(name), tensor.to(device)))
    return out


class WeightReceiver:
    """Mixed into each vLLM worker (``worker_extension_cls``); its methods run there, where
    ``self.model_runner`` is the worker's."""

    def load_hf_weights(self, bucket: list[list[Any]]) -> list[Any]:
        """Load one :func:`pack_weights` bucket (checkpoint names) into this worker's model;
        returns how many tensors it was given and the names of the model's parameters that
        vLLM's ``load_weights`` says it loaded (None where it says nothing)."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        device = next(model.parameters()).device
        return self._load(unpack_weights(bucket, device), device)

    def load_ipc_weights(self, bucket: list[Any], rows: list[list[Any]]) -> list[Any]:
        """Load one chunk of the staging bucket (:mod:`nodes.models.vllm_ipc`): ``bucket`` is
        ``[key, IPC fields or None]`` (the fields when the bucket is new: it is opened and
        kept), ``rows`` a ``[name, dtype, shape, offset]`` per tensor. Returns what
        :meth:`load_hf_weights` returns, or ``[None, why]`` when the bucket cannot be opened
        here (nothing was loaded: the sender sends the chunk as bytes)."""
        key, fields = bucket
        held = getattr(self, "_ipc_bucket", None)
        if held is None or held[0] != key:
            self._ipc_bucket = None  # a new bucket: let go of the old one first
            if fields is None:
                return [None, f"the staging bucket {key} is not open in this worker"]
            try:
                self._ipc_bucket = (key, vllm_ipc.open_storage(fields))
            except Exception as exc:  # any failure to open: the sender falls back to bytes
                return [None, vllm_ipc.first_line(exc)]
        data = self._ipc_bucket[1]  # (the sender's to overwrite once this returns)
        return self._load(vllm_ipc.views(data, rows), data.device)

    def _load(self, weights: list[tuple[str, Tensor]], device: torch.device) -> list[Any]:
        """Hand ``weights`` to the model's ``load_weights`` and wait for its copies: how many
        tensors, and the names it says it loaded (None where it says nothing)."""
        loaded = self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return [len(weights), sorted(loaded) if loaded is not None else None]

    def weight_names(self) -> list[str]:
        """The names of this worker's model parameters (what a complete update must load)."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return sorted(name for name, _ in model.named_parameters())


class _Tally:
    """What the worker said it loaded over the calls of one update."""

    def __init__(self) -> None:
        self.sent, self.loaded, self.reported = 0, set[str](), True

    def add(self, count: int, names: list[str] | None) -> None:
        self.sent += int(count)
        self.reported = self.reported and names is not None
        self.loaded.update(names or ())


# --- the engine -------------------------------------------------------------------------------
class VLLMEngine:
    """A vLLM engine over the policy's HF checkpoint (a local directory, or the policy saved
    to a temporary one), with the Rollout's sampling options and the engine options
    (``OPTIONS`` in :mod:`nodes.models.vllm_options`, which says how it takes ``device``, the
    node's GPU)."""

    def __init__(
        self,
        policy: Any,
        path: str | None,
        *,
        seed: int,
        sampling: Mapping[str, Any],
        options: Mapping[str, Any] | None = None,
        who: str = "vLLM",
        device: torch.device | str = "cuda",
    ) -> None:
        from vllm import LLM

        self.who, self.policy, self.sampling = who, policy, dict(sampling)
        hf_model_of(policy, who)  # refuses a prefix-VLM or a LoRA policy, clearly
        opts = check_vllm_options(options or {}, who)
        self._tmp = None
        if path is None:  # a policy built in code: serve what it would save
            self._tmp = tempfile.TemporaryDirectory(prefix="yatt-vllm-")
            policy.save_pretrained(self._tmp.name)
            path = self._tmp.name
        self.path = str(path)
        refuse_quantized(self.path, who)
        self.sleep_mode = bool(opts["enable_sleep_mode"])
        self.stale = False  # the engine dropped its weights (sleep level 2) and has no new ones
        self._names: set[str] | None = None  # the served model's parameters, asked once
        self.bucket_bytes = int(float(opts["bucket_mb"]) * 2**20)
        self._loaded = [0.0, 0]  # seconds and bytes of the updates since take_loaded()
        self.asleep: set[str] = set()  # the memory tags sleep() freed: weights, kv_cache
        s = self.sampling
        self.own_logprobs = s["top_p"] == 1.0 and not s["top_k"]
        device = torch.device(device)  # vLLM runs on CUDA whatever device the HF policy is on
        self.device = device if device.type == "cuda" else torch.device("cuda")
        index = _cuda_index(self.device)
        self.share = opts["gpu_memory_utilization"]
        if self.share is None:
            free, total = torch.cuda.mem_get_info(index)
            self.share = gpu_share(free, total, sleeps=self.sleep_mode, who=who)
        tp = int(opts["tensor_parallel_size"])
        self.ipc = vllm_ipc.IpcSender(self.device, tp, who)
        with _visible_gpus(index, tp, who):
            self.llm = self._start(LLM, seed, opts)
        self.sleep()  # (with sleep mode) a trainer built after it finds the device free

    def _start(self, LLM: Any, seed: int, opts: Mapping[str, Any]) -> Any:
        s = self.sampling
        return LLM(
            model=self.path,
            seed=seed,
            enforce_eager=bool(opts["enforce_eager"]),
            worker_extension_cls=f"{__name__}.{WeightReceiver.__name__}",
            logprobs_mode="processed_logprobs" if s["temperature"] > 0 else "raw_logprobs",
            enable_sleep_mode=self.sleep_mode,
            gpu_memory_utilization=float(self.share),
            tensor_parallel_size=int(opts["tensor_parallel_size"]),
            dtype=self._dtype(str(opts["dtype"])),
        )

    def _dtype(self, dtype: str) -> str:
        """``auto``: bfloat16, or float16 for a float16 policy: half precision is what
        FlashAttention and CUDA graphs run in. Its logprobs differ from the trainer's by about
        1e-2 nats a token; the ready graphs recompute them with the trainer and correct the
        gap (``recompute_logprobs``, ``tis_cap``). ``float32`` serves the policy's precision."""
        if dtype != "auto":
            return dtype
        own = next(self.policy.parameters()).dtype
        return "float16" if own == torch.float16 else "bfloat16"

    # --- sampling -----------------------------------------------------------------------------
    def _requests(self, prompts: list[str], images: list[Any] | None, batch: Any) -> list[dict]:
        """Text-only: the policy's own prompt ids (so vLLM samples after exactly the tokens
        the update sees). With images: the formatted text and the image, which vLLM's
        processor expands into its placeholder tokens, as the HF processor does."""
        if images is None:
            ids, mask = batch.prompt_ids.cpu(), batch.prompt_mask.cpu().bool()
            return [{"prompt_token_ids": ids[b][mask[b]].tolist()} for b in range(len(prompts))]
        fmt = self.policy._format
        return [
            {"prompt": fmt(p, True), "multi_modal_data": {"image": im}}
            for p, im in zip(prompts, images)
        ]

    def generate(
        self, prompts: list[str], images: list[Any] | None, seed: int, batch: Any
    ) -> Generation:
        """Sample one response per prompt (``batch``: the policy's encoding of ``prompts``);
        logprobs are vLLM's when :attr:`own_logprobs`, else zeros for the caller to recompute."""
        from vllm import SamplingParams

        if self.stale:  # asleep at level 2 and no update since: serve the policy's weights
            self.load_weights(self.policy.state_dict(), complete=True)
        self.wake_up()
        s, policy = self.sampling, self.policy
        params = [
            SamplingParams(
                temperature=s["temperature"],
                top_p=s["top_p"],
                top_k=s["top_k"] or -1,
                max_tokens=s["max_new_tokens"],
                stop=s["stop_strings"] or None,
                stop_token_ids=s["stop_token_ids"] or None,
                include_stop_str_in_output=True,
                logprobs=0 if self.own_logprobs else None,
                seed=(seed + i) % (2**31 - 1),
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(self._requests(prompts, images, batch), params, use_tqdm=False)
        self._check_prompts(outputs, batch)
        rows = [list(out.outputs[0].token_ids) or [policy.eos_token_id] for out in outputs]
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)  # (B,)
        R = int(lengths.max())
        ids = torch.full((len(rows), R), policy.pad_token_id, dtype=torch.int64)  # (B, R)
        logprobs = torch.zeros(len(rows), R)  # (B, R)
        for b, (row, out) in enumerate(zip(rows, outputs)):
            ids[b, : len(row)] = torch.tensor(row)
            if self.own_logprobs and out.outputs[0].logprobs:
                for t, (tok, entry) in enumerate(zip(row, out.outputs[0].logprobs)):
                    logprobs[b, t] = float(entry[tok].logprob)
        real = torch.arange(R)[None, :] < lengths[:, None]  # (B, R)
        texts = [policy.tokenizer.decode(r, skip_special_tokens=True) for r in rows]
        cut = torch.tensor([out.outputs[0].finish_reason == "length" for out in outputs])  # (B,)
        return Generation(ids, real.float(), logprobs * real, lengths, texts, cut)

    def _check_prompts(self, outputs: Sequence[Any], batch: Any) -> None:
        """vLLM's prompt tokens must be the ones the update trains on: with images two
        processors expand the placeholders, and a difference would train every token of the
        row against a context the rollout did not sample from."""
        ids, mask = batch.prompt_ids.cpu(), batch.prompt_mask.cpu().bool()
        for b, out in enumerate(outputs):
            got = getattr(out, "prompt_token_ids", None)
            if got is None:
                continue
            want = ids[b][mask[b]].tolist()
            if list(got) != want:
                first = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y),
                             min(len(got), len(want)))  # fmt: skip
                raise ValueError(
                    f"{self.who}: row {b}: vLLM's prompt is {len(got)} tokens and the policy's "
                    f"{len(want)}, first differing at token {first}; the update would train on "
                    "a prompt the rollout did not sample from (the two processors expand the "
                    "image placeholders differently: serve a checkpoint whose processor config "
                    "both read alike)"
                )

    # --- weights and memory -------------------------------------------------------------------
    def load_weights(self, weights: Mapping[str, Tensor], complete: bool = False) -> int:
        """Send a state dict of the policy (``complete``: all of it), in policy names, into
        every worker, then reset the engine's prefix, multimodal and encoder caches (their
        entries were computed with the old weights). Returns how many tensors were sent.
        vLLM's report of what it loaded is checked: a complete update must reach every
        parameter of the served model, a partial one at least one."""
        if self.stale and not complete:  # the engine has no weights: send the whole policy
            weights, complete = self.policy.state_dict(), True
        items = checkpoint_items(self.policy, weights, self.who)
        if "weights" in self.asleep:
            self._wake(["weights"])
        start = time.perf_counter()
        tally = _Tally()
        rest = items
        if self.ipc.on:

            def call(bucket: list[Any], rows: list[list[Any]]) -> list[Any]:
                return self.llm.collective_rpc(RECEIVE_IPC, args=(bucket, rows))

            rest = self.ipc.send(items, self.bucket_bytes, call, tally.add)
        for bucket in pack_weights(rest, self.bucket_bytes):
            replies = self.llm.collective_rpc(RECEIVE, args=(bucket,))
            tally.add(*(replies[0] if replies else (0, None)))
        if tally.reported:
            self._check_loaded(tally.loaded, tally.sent, complete)
        self.stale = False
        self._reset_caches()
        self._loaded[0] += time.perf_counter() - start
        self._loaded[1] += sum(nbytes(t) for _, t in items)
        return tally.sent

    @property
    def update_path(self) -> str:
        """How weight updates reach the worker: ``"ipc"`` (the staging bucket) or ``"bytes"``."""
        return "ipc" if self.ipc.on else "bytes"

    def take_loaded(self) -> tuple[float, int]:
        """Seconds and bytes of the weight updates since the last call (each update's tensors,
        as sent; the seconds from the first call to the worker to the caches' reset)."""
        seconds, nbytes = self._loaded
        self._loaded = [0.0, 0]
        return seconds, nbytes

    def _check_loaded(self, loaded: set[str], sent: int, complete: bool) -> None:
        if sent and not loaded:
            raise ValueError(
                f"{self.who}: vLLM loaded none of the {sent} tensors of a weight update; the "
                "checkpoint names do not map onto the served model"
            )
        if not complete:
            return
        if self._names is None:
            self._names = set(self.llm.collective_rpc("weight_names")[0])
        missing = sorted(self._names - loaded)
        if missing:
            raise ValueError(
                f"{self.who}: a complete weight update left {len(missing)} of the served "
                f"model's {len(self._names)} parameters as they were (e.g. {missing[:3]}); "
                "the rollout would sample from weights the update did not train"
            )

    def _reset_caches(self) -> None:
        """Drop what the engine computed with earlier weights: the prefix cache's KV blocks,
        the multimodal processor's cache and the vision encoder's outputs (vLLM resets them
        itself only on sleep)."""
        engine = getattr(self.llm, "llm_engine", None)
        for reset in (
            getattr(self.llm, "reset_prefix_cache", None),
            getattr(self.llm, "reset_mm_cache", None),
            getattr(engine, "reset_encoder_cache", None),
        ):
            if reset is not None:
                reset()

    def sleep(self) -> None:
        """Free the engine's GPU memory while another role uses the device (colocated
        placement; a no-op without ``enable_sleep_mode``). Level 2: the weights are dropped,
        not copied to the host, since the next update overwrites them; a generation before
        one sends the policy's own (:attr:`stale`)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = {"weights", "kv_cache"}
            self.stale = True

    def wake_up(self) -> None:
        """Take back what :meth:`sleep` freed (generation calls it itself)."""
        if self.asleep:
            self._wake(sorted(self.asleep))

    def _wake(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)
        self.asleep -= set(tags)
