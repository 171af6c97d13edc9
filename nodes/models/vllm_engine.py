"""The vLLM rollout engine: sampling with vLLM, weight updates into the running engine.

Only reached where vllm imports and CUDA exists (:func:`vllm_unavailable_reason` says why
not); the CPU test suite checks what it can without vllm: the names a weight update
carries (:mod:`nodes.models.vllm_names`) and the refusals.

Weight updates go through vLLM's supported interface, as public RL frameworks do: a worker
extension class named by its dotted path (``worker_extension_cls``), whose method is called by
**name** with ``LLM.collective_rpc("load_hf_weights", args=...)``. Nothing callable crosses the
process boundary, so vLLM's V1 engine (the model in another process) needs no insecure
serialization. The arguments are ``(checkpoint name, CPU tensor)`` pairs, which vLLM's
msgpack serializer carries; the worker hands them to its model's ``load_weights``, which
maps checkpoint names to vLLM's fused parameters itself (``hf_to_vllm_mapper``). Followed:
vLLM's ``examples/offline_inference/rlhf_utils.py`` (``WorkerExtension``: a method per
update, called through ``collective_rpc``), OpenRLHF's ``openrlhf/trainer/ray/vllm_worker_wrap.py``
(``WorkerWrap.update_weight`` calling ``model_runner.model.load_weights``) and NeMo-RL's
``VllmInternalWorkerExtension`` (the same by name, with CUDA IPC handles when colocated; the
CPU tensors here are the simpler, slower form of that).

Logprobs: vLLM's own sampled-token logprobs of the temperature-scaled distribution
(``logprobs_mode="processed_logprobs"``, ``logprobs=0``) by default; with top-p/top-k, which
vLLM applies before it reports them, or ``recompute_logprobs=True``, the Rollout recomputes
them teacher-forced with the HF policy (the convention of nodes/rollout.py).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from nodes.models.policy_base import Generation
from nodes.models.vllm_names import checkpoint_items, hf_model_of

__all__ = ["VLLMEngine", "WeightReceiver", "vllm_unavailable_reason"]

#: what Rollout(vllm_options=...) may hold
OPTIONS = ("gpu_memory_utilization", "tensor_parallel_size", "dtype", "enable_sleep_mode")


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


class WeightReceiver:
    """Mixed into each vLLM worker (``worker_extension_cls``); its methods run there."""

    def load_hf_weights(self, items: list[tuple[str, Tensor]]) -> int:
        """Load ``(checkpoint name, tensor)`` pairs into this worker's model; returns how many."""
        device = next(self.model_runner.model.parameters()).device  # type: ignore[attr-defined]
        weights = [(name, t.to(device, non_blocking=True)) for name, t in items]
        self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]
        torch.cuda.synchronize(device)
        return len(weights)


def check_vllm_options(options: Mapping[str, Any], who: str) -> dict[str, Any]:
    """The engine options, checked (names and ranges) before anything starts."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"{who}: unknown vllm option(s) {unknown}; known: {list(OPTIONS)}")
    out = dict(options)
    share = out.get("gpu_memory_utilization", 0.5)
    if not 0 < float(share) <= 1:
        raise ValueError(f"{who}: gpu_memory_utilization={share}; it must be in (0, 1]")
    if int(out.get("tensor_parallel_size", 1)) < 1:
        raise ValueError(f"{who}: tensor_parallel_size must be >= 1")
    return out


class VLLMEngine:
    """A vLLM engine over the policy's HF checkpoint (a local directory, or the policy saved
    to a temporary one), with the Rollout's sampling options."""

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
        options = check_vllm_options(options or {}, who)
        self._tmp = None
        if path is None:  # a policy built in code: serve what it would save
            self._tmp = tempfile.TemporaryDirectory(prefix="yatt-vllm-")
            policy.save_pretrained(self._tmp.name)
            path = self._tmp.name
        self.sleep_mode = bool(options.pop("enable_sleep_mode", False))
        self.llm = LLM(
            model=str(path),
            seed=seed,
            enforce_eager=True,
            worker_extension_cls=f"{__name__}.WeightReceiver",
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=self.sleep_mode,
            gpu_memory_utilization=float(options.pop("gpu_memory_utilization", 0.5)),
            tensor_parallel_size=int(options.pop("tensor_parallel_size", 1)),
            dtype=str(options.pop("dtype", "auto")),
        )
        s = self.sampling
        self.own_logprobs = s.get("top_p", 1.0) == 1.0 and not s.get("top_k", 0)

    # --- sampling -----------------------------------------------------------------------------
    def generate(self, prompts: list[str], images: list[Any] | None, seed: int) -> Generation:
        """Sample one response per prompt; logprobs are vLLM's when :attr:`own_logprobs`,
        else zeros for the caller to recompute."""
        from vllm import SamplingParams

        s, policy = self.sampling, self.policy
        requests = []
        for i, prompt in enumerate(prompts):
            req: dict[str, Any] = {"prompt": policy._format(prompt, images is not None)}
            if images is not None:
                req["multi_modal_data"] = {"image": images[i]}
            requests.append(req)
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
        outputs = self.llm.generate(requests, params, use_tqdm=False)
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
        return Generation(ids, real.float(), logprobs * real, lengths, texts)

    # --- weights and memory -------------------------------------------------------------------
    def load_weights(self, weights: Mapping[str, Tensor]) -> int:
        """Send a (partial) state dict of the policy into every worker; returns the count."""
        items = [
            (name, t.detach().cpu()) for name, t in checkpoint_items(self.policy, weights, self.who)
        ]
        counts = self.llm.collective_rpc("load_hf_weights", args=(items,))
        return int(counts[0]) if counts else 0

    def sleep(self) -> None:
        """Free the engine's GPU memory while another role uses the device (colocated)."""
        if self.sleep_mode:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.sleep_mode:
            self.llm.wake_up()
