"""A stand-in for the ``vllm`` module, as far as nodes/models/vllm_engine.py uses it: the
served weights are the checkpoint's tensors by name, the worker method runs by name after a
msgpack round trip (as the V1 engine does), and sleep and wake-up are recorded. Used by
tests/nodes/test_vllm.py and tests/runtime/test_gpu_check.py."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import torch
from safetensors.torch import load_file

GiB = 2**30


def through_the_engine_core(value: Any) -> Any:
    """What a collective_rpc argument becomes in vLLM's V1 engine: msgpack, decoded untyped
    (msgspec refuses a function, as vLLM does without insecure serialization)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(value))


class FakeLLM:
    """vllm.LLM as far as the engine uses it. The served weights are the checkpoint's tensors
    by name; the worker method runs by name on a WeightReceiver after a msgpack round trip."""

    prompt_shift = 0
    """Tokens the stand-in's "processor" adds to each prompt (0: the ids it was given)."""

    def __init__(self, model: str, **kwargs):
        self.path, self.kwargs, self.calls = Path(model), kwargs, []
        self.visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # what the engine core inherits
        self.served = {}
        for file in self.path.glob("*.safetensors"):
            self.served.update(load_file(str(file)))
        module_name, _, cls = kwargs["worker_extension_cls"].rpartition(".")
        self.worker = getattr(sys.modules[module_name], cls)()
        self.worker.model_runner = SimpleNamespace(model=self)
        self.llm_engine = SimpleNamespace(reset_encoder_cache=lambda: self.calls.append("reset encoder"))  # fmt: skip

    def parameters(self):
        yield torch.zeros(1)

    def named_parameters(self):  # the served model's parameters: the checkpoint's names here
        return ((name, tensor) for name, tensor in self.served.items())

    def load_weights(self, weights):  # copies, as vLLM's loaders copy into its parameters
        for name, tensor in weights:
            assert name in self.served and tensor.shape == self.served[name].shape, name
            self.served[name] = tensor.clone()
        return {name for name, _ in weights}

    def reset_prefix_cache(self):
        self.calls.append("reset prefix")

    def reset_mm_cache(self):
        self.calls.append("reset mm")

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert isinstance(method, str), "only a method name crosses the process boundary"
        self.calls.append(method)
        args = through_the_engine_core(list(args))
        return [getattr(self.worker, method)(*args)]

    def generate(self, requests, params, use_tqdm=True):
        self.calls.append("generate")
        self.requests, self.params = requests, params
        out = SimpleNamespace(token_ids=[5, 6, 7], finish_reason="stop", logprobs=[{t: SimpleNamespace(logprob=-t / 10)} for t in (5, 6, 7)])  # fmt: skip
        return [
            SimpleNamespace(
                outputs=[out], prompt_token_ids=[*r["prompt_token_ids"], *[9] * self.prompt_shift]
            )  # fmt: skip
            for r in requests
        ]

    def sleep(self, level):
        self.calls.append(f"sleep {level}")

    def wake_up(self, tags=None):
        self.calls.append(f"wake {','.join(tags)}")


def install(monkeypatch: Any) -> types.ModuleType:
    """Put the stand-in in sys.modules as ``vllm`` (with a fake ``torch.cuda.mem_get_info``:
    80 GiB, all free unless ``vllm.free[ordinal]`` says otherwise) for one test."""
    vllm = types.ModuleType("vllm")
    vllm.LLM = FakeLLM
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    vllm.free = {}  # GPU ordinal -> free bytes (of 80 GiB; all free when not set)
    vllm.asked = []  # the ordinals whose free memory the engine asked for
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setattr("nodes.rollout.vllm_unavailable_reason", lambda: None)

    def mem_get_info(device=None):
        vllm.asked.append(device)
        return vllm.free.get(device, 80 * GiB), 80 * GiB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return vllm
