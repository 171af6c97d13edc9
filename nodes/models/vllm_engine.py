"""The vLLM rollout engine: sampling with vLLM, weight updates into the running engine.

Only reached where vllm imports and CUDA exists (:func:`vllm_unavailable_reason` says why
not, and is the one error a CPU machine gives). The CPU tests check the rest without vllm:
the names an update carries (:mod:`nodes.models.vllm_names`), the payload's round trip
through msgpack, the receiver, and the engine's wiring against a stand-in ``vllm``.

**Weight updates** go through vLLM's supported interface, as public RL frameworks do: a
worker extension class named by its dotted path (``LLM(worker_extension_cls=...)``), whose
method is called by **name** with ``LLM.collective_rpc("load_hf_weights", args=(...,))``.
Nothing callable crosses the process boundary, so vLLM's V1 engine (the model in another
process) needs no ``VLLM_ALLOW_INSECURE_SERIALIZATION``. The engine core decodes a utility
call's arguments with an untyped msgpack decoder (``vllm/v1/engine/core.py``,
``generic_decoder``; ``vllm/v1/serial_utils.py``), which rebuilds no tensor: a tensor arrives
as ``[dtype, shape, buffer index]`` with the buffer gone. So each tensor travels as plain
msgpack values, ``[checkpoint name, dtype, shape, bytes]`` (:func:`pack_weights`), in calls
of at most ``bucket_mb`` MiB, and the worker rebuilds it on its device
(:func:`unpack_weights`) and hands it to ``model_runner.model.load_weights``, which maps
checkpoint names to vLLM's fused parameters itself (``hf_to_vllm_mapper``; each
tensor-parallel rank takes its shard).

Followed: vLLM ``examples/offline_inference/rlhf_utils.py`` (``WorkerExtension``, a method per
update called through ``collective_rpc``) and ``vllm/entrypoints/llm.py`` (``collective_rpc``,
``sleep(level)``, ``wake_up(tags)``); OpenRLHF ``openrlhf/trainer/ray/vllm_worker_wrap.py``
(``WorkerWrap.update_weight``: ``model_runner.model.load_weights(weights=[(name, w)])``) and
``openrlhf/trainer/ray/vllm_engine.py`` (``worker_extension_cls`` by dotted name,
``logprobs_mode``, ``enable_sleep_mode``); verl ``verl/workers/rollout/vllm_rollout/utils.py``
(``vLLMColocateWorkerExtension.update_weights_from_ipc``: buckets of tensors, then
``load_weights``). verl and OpenRLHF pass CUDA IPC handles when colocated, which needs pickle
(a rebuild function) on a side channel; bytes through the engine are slower (a host copy)
but need nothing beyond what vLLM serializes. Newer vLLM also has
``LLM.update_weights``/``init_weight_transfer_engine``; the extension works with both.

**Logprobs**: vLLM's own sampled-token logprobs (``logprobs=0``) by default:
``logprobs_mode="processed_logprobs"`` gives log softmax(logits / T), the Rollout's convention
(``raw_logprobs`` when greedy: T = 1). With top-p/top-k (which vLLM applies before it
reports them) or ``recompute_logprobs=True`` the Rollout recomputes them teacher-forced with
the HF policy.

**Sleep** (``enable_sleep_mode``, colocated placement): :meth:`VLLMEngine.sleep` frees the
engine's GPU memory (level 1: weights backed up on the CPU, KV cache dropped); a weight
update wakes the weights alone, a generation wakes the rest.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from nodes.models.policy_base import Generation
from nodes.models.vllm_names import checkpoint_items, hf_model_of

__all__ = [
    "OPTIONS",
    "VLLMEngine",
    "WeightReceiver",
    "check_vllm_options",
    "pack_weights",
    "unpack_weights",
    "vllm_unavailable_reason",
]

#: what ``Rollout(vllm_options=...)`` may hold, with the defaults
OPTIONS: dict[str, Any] = {
    "gpu_memory_utilization": 0.5,
    "tensor_parallel_size": 1,
    "dtype": "auto",
    "enable_sleep_mode": False,
    "bucket_mb": 256,
}
_DTYPES = ("auto", "float32", "bfloat16", "float16")
#: the name :class:`WeightReceiver`'s method is called by
RECEIVE = "load_hf_weights"


def vllm_unavailable_reason() -> str | None:
    """Why the vllm backend cannot run here, or None when it can."""
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        return (
            f"vllm is not installed ({err}); on a GPU machine run `make install-gpu` "
            "(pip install -e '.[vllm]')"
        )
    if not torch.cuda.is_available():
        return "vllm needs a CUDA device and torch.cuda.is_available() is False"
    return None


def check_vllm_options(options: Mapping[str, Any], who: str) -> dict[str, Any]:
    """The engine options with their defaults filled in, checked before anything starts."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"{who}: unknown vllm option(s) {unknown}; known: {sorted(OPTIONS)}")
    out = {**OPTIONS, **options}
    if not 0 < float(out["gpu_memory_utilization"]) <= 1:
        raise ValueError(
            f"{who}: gpu_memory_utilization={out['gpu_memory_utilization']}; it must be in (0, 1]"
        )
    if int(out["tensor_parallel_size"]) < 1:
        raise ValueError(f"{who}: tensor_parallel_size={out['tensor_parallel_size']}; need >= 1")
    if out["dtype"] not in _DTYPES:
        raise ValueError(f"{who}: dtype={out['dtype']!r}; choose one of {_DTYPES}")
    if float(out["bucket_mb"]) <= 0:
        raise ValueError(f"{who}: bucket_mb={out['bucket_mb']}; need > 0")
    return out


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

    def load_hf_weights(self, bucket: list[list[Any]]) -> int:
        """Load one :func:`pack_weights` bucket (checkpoint names) into this worker's model;
        returns how many tensors it loaded."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        device = next(model.parameters()).device
        weights = unpack_weights(bucket, device)
        model.load_weights(weights=weights)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return len(weights)


# --- the engine -------------------------------------------------------------------------------
class VLLMEngine:
    """A vLLM engine over the policy's HF checkpoint (a local directory, or the policy saved
    to a temporary one), with the Rollout's sampling options and :data:`OPTIONS`."""

    def __init__(
        self,
        policy: Any,
        path: str | None,
        *,
        seed: int,
        sampling: Mapping[str, Any],
        options: Mapping[str, Any] | None = None,
        who: str = "vLLM",
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
        self.sleep_mode = bool(opts["enable_sleep_mode"])
        self.bucket_bytes = int(float(opts["bucket_mb"]) * 2**20)
        self.asleep: set[str] = set()  # the memory tags sleep() freed: weights, kv_cache
        s = self.sampling
        self.own_logprobs = s["top_p"] == 1.0 and not s["top_k"]
        self.llm = LLM(
            model=self.path,
            seed=seed,
            enforce_eager=True,
            worker_extension_cls=f"{__name__}.{WeightReceiver.__name__}",
            logprobs_mode="processed_logprobs" if s["temperature"] > 0 else "raw_logprobs",
            enable_sleep_mode=self.sleep_mode,
            gpu_memory_utilization=float(opts["gpu_memory_utilization"]),
            tensor_parallel_size=int(opts["tensor_parallel_size"]),
            dtype=self._dtype(str(opts["dtype"])),
        )

    def _dtype(self, dtype: str) -> str:
        """``auto`` is the HF policy's own dtype (vLLM's ``auto`` would serve a float32
        checkpoint in half precision, and its logprobs would drift from the update's)."""
        if dtype != "auto":
            return dtype
        return str(next(self.policy.parameters()).dtype).removeprefix("torch.")

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

    # --- weights and memory -------------------------------------------------------------------
    def load_weights(self, weights: Mapping[str, Tensor]) -> int:
        """Send a (partial) state dict of the policy, in policy names, into every worker;
        returns how many tensors each loaded."""
        items = checkpoint_items(self.policy, weights, self.who)
        if "weights" in self.asleep:
            self._wake(["weights"])
        loaded = 0
        for bucket in pack_weights(items, self.bucket_bytes):
            counts = self.llm.collective_rpc(RECEIVE, args=(bucket,))
            loaded += int(counts[0]) if counts else 0
        return loaded

    def sleep(self) -> None:
        """Free the engine's GPU memory while another role uses the device (colocated
        placement; a no-op without ``enable_sleep_mode``)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        """Take back what :meth:`sleep` freed (generation calls it itself)."""
        if self.asleep:
            self._wake(sorted(self.asleep))

    def _wake(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)
        self.asleep -= set(tags)
