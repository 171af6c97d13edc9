"""What a vLLM engine is given before it starts: its options, checked; whether vllm can run
here; a checkpoint its weight updates can reach; its GPU and its share of it. Nothing here
imports vllm, so a Rollout checks all of it at construction, on any machine
(:mod:`nodes.models.vllm_engine` is the engine itself).

**Its GPU and its share of it.** vLLM's worker takes the first GPU its process sees
(``cuda:{local_rank}``, ``vllm/v1/worker/gpu_worker.py`` ``init_device``), and the engine
core is a process of its own that inherits ``CUDA_VISIBLE_DEVICES``; so a node placed on
``cuda:1`` builds its engine with ``CUDA_VISIBLE_DEVICES`` narrowed to that GPU (and the next
``tensor_parallel_size - 1``), as Ray does for verl's and OpenRLHF's engines, and restored
after. ``gpu_memory_utilization`` left None is derived when the engine starts
(:func:`gpu_share`): vLLM refuses to start when less than ``utilization * total`` is free
(``init_device``), so the share is at most what the device has free then, and at most
:data:`OWN_GPU`; an engine that sleeps (it hands its GPU to a trainer, colocated placement)
leaves :data:`TRAINER_RESERVE` of the GPU besides, for what the trainer keeps on it while
vLLM generates (its CUDA context, the allocator's cache, state it does not offload), and
sleeps as soon as it is built, so that a trainer built after it finds the device free.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "OPTIONS",
    "OWN_GPU",
    "TRAINER_RESERVE",
    "check_vllm_options",
    "checkpoint_dir",
    "gpu_share",
    "refuse_quantized",
    "vllm_unavailable_reason",
]

#: what ``Rollout(vllm_options=...)`` may hold, with the defaults
OPTIONS: dict[str, Any] = {
    "gpu_memory_utilization": None,
    "tensor_parallel_size": 1,
    "dtype": "auto",
    "enable_sleep_mode": False,
    "enforce_eager": False,
    "bucket_mb": 256,
}
_DTYPES = ("auto", "float32", "bfloat16", "float16")
OWN_GPU = 0.9
"""The share of a GPU an engine takes at most (vLLM's own default): the rest is the CUDA
context's, the sampler's and the allocator's slack."""
TRAINER_RESERVE = 0.1
"""The share an engine that sleeps leaves to the trainer beside it while it generates: the
trainer's CUDA context and allocator cache, and what it does not offload."""
MIN_SHARE = 0.05


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
    if (
        out["gpu_memory_utilization"] is not None
        and not 0 < float(out["gpu_memory_utilization"]) <= 1
    ):
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


def checkpoint_dir(spec: Any, model: Any) -> str | None:
    """The local directory a vLLM engine can start from: a path spec's, else None (a tiny
    builder, a builder reference or a live ``model``: the engine serves the policy saved)."""
    if model is not None:
        return None
    if isinstance(spec, Mapping):
        spec = spec.get("path")
    return spec if isinstance(spec, str) and Path(spec).is_dir() else None


def refuse_quantized(path: str, who: str) -> None:
    """Refuse a quantized checkpoint: its layers take no full-precision weight update."""
    config = Path(path) / "config.json"
    try:
        method = json.loads(config.read_text()).get("quantization_config")
    except (OSError, ValueError):
        return
    if method:
        kind = method.get("quant_method", "?") if isinstance(method, dict) else method
        raise ValueError(
            f"{who}: the checkpoint in {path!r} is quantized ({kind}); weight updates are "
            "full-precision tensors, which vLLM's quantized layers do not load: serve an "
            "unquantized checkpoint"
        )


# --- the GPU ----------------------------------------------------------------------------------
def gpu_share(free: int, total: int, *, sleeps: bool, who: str = "vLLM") -> float:
    """``gpu_memory_utilization`` for an engine starting on a device with ``free`` of ``total``
    bytes free: :data:`OWN_GPU` at most, and no more than is free (vLLM refuses to start
    otherwise); an engine that ``sleeps`` shares its GPU with a trainer and leaves it
    :data:`TRAINER_RESERVE` besides. Too little left is an error saying what holds the GPU."""
    share = min(OWN_GPU, free / total) - (TRAINER_RESERVE if sleeps else 0.0)
    share = round(share, 3)
    if share < MIN_SHARE:
        raise ValueError(
            f"{who}: {free / 2**30:.1f} of the GPU's {total / 2**30:.1f} GiB are free when the "
            f"engine starts, which leaves it a share of {share} (less than {MIN_SHARE}"
            f"{f', after {TRAINER_RESERVE} for the trainer beside it' if sleeps else ''}); "
            "free the GPU (offload the roles beside it, or place the rollout on a GPU of its "
            "own) or give vllm_gpu_memory explicitly"
        )
    return share


def _cuda_index(device: torch.device) -> int:
    """The ordinal ``device`` names (``cuda``: the current device)."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


@contextlib.contextmanager
def _visible_gpus(index: int, count: int, who: str) -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES`` narrowed to GPUs ``index .. index + count - 1`` of this
    process's while the engine starts: its worker takes the first GPU its process sees."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in parent.split(",")] if parent else None
    if entries is not None and index + count > len(entries):
        raise ValueError(
            f"{who}: GPUs {index}..{index + count - 1} are not all among the {len(entries)} "
            f"of CUDA_VISIBLE_DEVICES={parent!r}"
        )
    if index and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        raise ValueError(
            f"{who}: placed on cuda:{index}, but VLLM_ENABLE_V1_MULTIPROCESSING=0 runs vLLM's "
            "worker in this process, where it takes cuda:0; unset it, or start the process "
            f"with CUDA_VISIBLE_DEVICES naming that GPU first"
        )
    wanted = range(index, index + count)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(
        entries[i] if entries is not None else str(i) for i in wanted
    )
    try:
        yield
    finally:
        if parent is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = parent
