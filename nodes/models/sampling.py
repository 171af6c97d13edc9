"""Sampling with HF ``generate`` for every policy family: the whole batch, or streamed.

:func:`generate` returns all responses at once. :func:`generate_stream` runs the very same
``generate`` call (same config, same random stream, so the same tokens and logprobs) on a
worker thread and hands out the rows that finished as it goes: a row is done at its first
stop token (EOS or ``stop_token_ids``), at the token that completes a stop string, or at
``max_new_tokens``; every ``every`` decode steps the rows done since the last piece go out as
one piece. Joined in row order (:func:`yatt_graph.stream.join_pieces`), the pieces equal what
:func:`generate` returns, except that ``response_ids`` past a row's end hold 0 where a piece
was narrower than the batch, rather than the pad id (both sit under ``response_mask`` == 0).

Logprobs are ``log softmax(logits / temperature)`` at the sampled token, i.e. under the
temperature-scaled policy *before* top-k/top-p truncation (T = 1 for greedy). That is the
distribution a PPO/GRPO update recomputes with ``Policy.response_logprobs(..., temperature)``,
so the two agree up to float error; the truncated sampling distribution is not used because
its support changes with top-p and the update could not reproduce it.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import StoppingCriteria, StoppingCriteriaList

from nodes.models.policy_types import Generation, PromptBatch
from nodes.models.precision import autocast, check_precision

__all__ = [
    "MIN_TEMPERATURE",
    "NotFiniteError",
    "generate",
    "generate_stream",
    "sampling_problem",
    "temperature_problem",
]

MIN_TEMPERATURE = 0.01
"""The lowest sampling temperature above 0 (as vLLM's floor): below it ``logits / T`` leaves
float32's useful range (the logprobs the update trains on overflow or lose their precision)."""


def sampling_problem(temperature: float, top_p: float, top_k: int) -> str | None:
    """Why these sampling settings cannot be used (:func:`temperature_problem`, a top-p
    outside (0, 1], a negative top-k), or None."""
    if why := temperature_problem(temperature):
        return why
    if not 0 < top_p <= 1 or top_k < 0:
        return f"top_p={top_p}, top_k={top_k}; need 0 < top_p <= 1, top_k >= 0"
    return None


def temperature_problem(temperature: float, greedy: bool = True) -> str | None:
    """Why ``temperature`` cannot be used, or None: it must be finite and 0 (greedy, where
    ``greedy``) or at least :data:`MIN_TEMPERATURE`."""
    t = float(temperature)
    if t == 0 and greedy:
        return None
    if not (math.isfinite(t) and t >= MIN_TEMPERATURE):
        zero = "0 (greedy) or " if greedy else ""
        return (
            f"temperature={temperature}; it must be {zero}a finite number >= {MIN_TEMPERATURE} "
            "(below it logits / temperature overflow the float32 logprobs)"
        )
    return None


_in_generate = threading.local()


class _DroppedMaskWarning(logging.Filter):
    """Drops transformers' "passing in an `attention_mask`" warning raised inside our own
    ``generate`` calls, where it is false: every policy passes the prompt mask, transformers
    leaves an all-ones mask out of the model call, and then sees the pad id that it fills
    finished rows with. Outside those calls the filter lets it through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            getattr(_in_generate, "on", False)
            and "passing in an `attention_mask`" in record.getMessage()
        )


logging.getLogger("transformers.modeling_utils").addFilter(_DroppedMaskWarning())


@functools.cache
def _cpu_decode_attention_in_float32() -> None:
    """Make transformers' ``sdpa`` attention take a CPU decode step (one query token) in
    bfloat16, under autocast or on bf16 weights, in float32: the bf16 kernel took 2.4x the
    float32 one's time there, a fifth of a small model's bf16 rollout. The query, keys and
    values are cast up and the output back down; every other call is transformers' own.
    Registered by the first generation (:class:`_Setup`), the only caller of a decode step,
    so that importing this module does not import transformers' models (seconds)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def sdpa(module: Any, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kw: Any) -> Any:
        bf16 = query.dtype == torch.bfloat16 or torch.is_autocast_enabled("cpu")
        if query.device.type != "cpu" or query.shape[2] != 1 or not bf16:
            return sdpa_attention_forward(module, query, key, value, *args, **kw)
        with torch.autocast("cpu", enabled=False):
            out, weights = sdpa_attention_forward(
                module, query.float(), key.float(), value.float(), *args, **kw
            )
        return out.to(query.dtype), weights

    AttentionInterface.register("sdpa", sdpa)


class _StepLogprobRecorder:
    """A logits processor that records log-probs of the sampled tokens during ``generate``.

    ``generate`` runs user processors before its temperature/top-k/top-p warpers, so the scores
    seen here are the model's raw logits. At step s it keeps ``log_softmax(logits_s / T)`` and,
    at step s+1, reads off the log-prob of the token sampled at step s. Only one (B, V) tensor
    is held, unlike ``output_logits=True`` which keeps all R of them.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.last: Tensor | None = None  # (B, V) log-probs of the latest step
        self.steps: list[Tensor] = []  # R x (B,)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.last is not None:
            self.steps.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))  # (B,)
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # (B, V)
        return scores

    def finish(self, new_tokens: Tensor) -> Tensor:
        """``new_tokens``: int64[B, R] as returned by generate; returns float32[B, R]."""
        if self.last is not None:
            self.steps.append(self.last.gather(-1, new_tokens[:, -1:]).squeeze(-1))  # (B,)
        self.last = None
        return torch.stack(self.steps, dim=1)  # (B, R)


class NotFiniteError(RuntimeError):
    """Sampling met next-token probabilities that are not finite (the weights diverged)."""


class _Sampler:
    """The last logits processor of a sampling ``generate``: it draws each row's next token from
    ``softmax(logits / temperature)`` truncated to the ``top_k`` likeliest tokens and the
    ``top_p`` nucleus (transformers' own warpers, in their order), and leaves only that token
    standing for the greedy step to pick. The draw inverts the CDF with one uniform number a
    row, where ``torch.multinomial`` draws one exponential number a vocabulary entry (on a CPU
    that was an eighth of a small model's rollout); the distribution is the same."""

    def __init__(self, temperature: float, top_p: float, top_k: int) -> None:
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.warpers: list[Any] = [TemperatureLogitsWarper(temperature)]
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        cdf = torch.softmax(scores.float(), dim=-1).cumsum(-1)  # (B, V)
        if not bool(torch.isfinite(cdf[:, -1]).all()):
            raise NotFiniteError("the next-token probabilities are not finite")
        # the first token whose CDF is above a uniform share of the total, which is below the
        # total (rounding could make it equal): a token of probability 0 is never drawn
        total = cdf[:, -1:]  # (B, 1)
        draw = torch.rand(cdf.shape[0], 1, device=cdf.device) * total  # (B, 1)
        draw = torch.minimum(draw, total.nextafter(torch.zeros_like(total)))  # (B, 1)
        tokens = torch.searchsorted(cdf, draw, right=True)  # (B, 1)
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens, 0.0)  # (B, V)


def _stop_string_end(tokenizer: Any, ids: list[int], stop_strings: list[str]) -> int | None:
    """Index of the token that completes the first stop string in ``ids``, or None."""
    if not stop_strings or not any(s in tokenizer.decode(ids) for s in stop_strings):
        return None
    lo, hi = 0, len(ids) - 1  # containment is monotone in the prefix length: binary search
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in tokenizer.decode(ids[: mid + 1]) for s in stop_strings):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _finish_responses(
    new_tokens: Tensor,
    step_logprobs: Tensor,
    stop_ids: set[int],
    stop_strings: list[str],
    tokenizer: Any,
    pad_id: int,
) -> Generation:
    """Cut each row after its first stop token/string; pad, mask and decode.

    ``generate`` keeps sampling rows that already finished (filling them with the pad id), so
    each row's end is found here from its tokens, the same rule ``generate`` stopped on.
    """
    B, R = new_tokens.shape
    lengths, cut = [], []
    rows = new_tokens.tolist()
    for row in rows:
        end = next((t for t, tok in enumerate(row) if tok in stop_ids), None)
        by_string = _stop_string_end(tokenizer, row[: R if end is None else end + 1], stop_strings)
        cut.append(end is None and by_string is None)
        end = R - 1 if end is None else end
        lengths.append((end if by_string is None else by_string) + 1)
    lengths_t = torch.tensor(lengths, dtype=torch.int64)  # (B,)
    R_out = int(lengths_t.max()) if B else 0
    positions = torch.arange(R_out)[None, :]  # (1, R')
    real = positions < lengths_t[:, None]  # (B, R')
    ids = torch.where(real, new_tokens[:, :R_out].cpu(), pad_id)  # (B, R')
    logprobs = torch.where(real, step_logprobs[:, :R_out].cpu().float(), 0.0)  # (B, R')
    texts = [tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(rows, lengths)]
    return Generation(
        ids, real.float(), logprobs, lengths_t, texts, torch.tensor(cut, dtype=torch.bool)
    )


class _Setup:
    """A complete ``GenerationConfig`` and the rule that ends a row, from sampling options.

    ``temperature == 0`` is greedy decoding. A response ends at the EOS token, at any of
    ``stop_token_ids`` or at the token that completes any of ``stop_strings`` (that token is
    kept and counted in the mask), or after ``max_new_tokens``. ``top_p``/``top_k``: nucleus
    and top-k truncation (1.0 / 0 = off). ``precision``: ``"bf16"`` samples under bf16
    autocast (:mod:`nodes.models.precision`), as a mixed-precision update computes.
    """

    def __init__(
        self,
        policy: Any,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        precision: str = "no",
    ) -> None:
        from transformers import GenerationConfig

        _cpu_decode_attention_in_float32()
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens is {max_new_tokens}; it must be >= 1")
        if why := sampling_problem(temperature, top_p, top_k):
            raise ValueError(f"generate: {why}")
        self.precision = check_precision(precision, "generate")
        greedy = temperature == 0
        eos = [policy.eos_token_id]
        eos += [int(t) for t in stop_token_ids if int(t) != policy.eos_token_id]
        self.stop_ids = set(eos)
        self.stop_strings = list(stop_strings)
        self.logprob_temperature = 1.0 if greedy else float(temperature)
        # Sampling is our last logits processor (:class:`_Sampler`), and generate decodes the
        # one token it leaves greedily. A complete config, so that a checkpoint's own
        # generation_config.json (penalties, top_k) never changes what we sample from.
        self.sampler = None if greedy else _Sampler(float(temperature), float(top_p), int(top_k))
        self.config = GenerationConfig(
            do_sample=False,
            top_k=None,  # (greedy reads none; a value warns)
            max_new_tokens=int(max_new_tokens),
            eos_token_id=eos,
            pad_token_id=policy.pad_token_id,
            bos_token_id=policy.tokenizer.bos_token_id,
            suppress_tokens=list(policy.suppressed_token_ids) or None,
            return_dict_in_generate=True,
            use_cache=True,
        )

    def finish(self, policy: Any, new_tokens: Tensor, step_logprobs: Tensor) -> Generation:
        return _finish_responses(
            new_tokens,
            step_logprobs,
            self.stop_ids,
            self.stop_strings,
            policy.tokenizer,
            policy.pad_token_id,
        )

    def run(self, policy: Any, batch: PromptBatch, recorder: Any, **kwargs: Any) -> Tensor:
        """``generate`` in eval mode (restored after); the new tokens, int64[B, R]."""
        was_training = policy.training
        policy.eval()
        _in_generate.on = True
        if self.stop_strings:  # ours, not HF's: its vocabulary scan fails on some tokenizers
            ends = _StopStrings(policy.tokenizer, self.stop_strings)
            kwargs["stopping_criteria"] = [*kwargs.get("stopping_criteria", []), ends]
        processors = [recorder] if self.sampler is None else [recorder, self.sampler]
        try:
            with autocast(policy.device, self.precision):
                return policy._generate_raw(
                    batch, self.config, logits_processor=processors, **kwargs
                )  # (B, R)
        finally:
            _in_generate.on = False
            policy.train(was_training)


def generate(policy: Any, batch: PromptBatch, **sampling: Any) -> Generation:
    """Sample responses of ``policy`` (a ``Policy``) with HF ``generate`` (KV cache);
    ``sampling``: the options of :class:`_Setup` (see the module docstring)."""
    setup = _Setup(policy, **sampling)
    recorder = _StepLogprobRecorder(setup.logprob_temperature)
    new_tokens = setup.run(policy, batch, recorder)  # (B, R)
    return setup.finish(policy, new_tokens, recorder.finish(new_tokens))


class _StopStrings(StoppingCriteria):
    """Ends each row whose new tokens' tail decodes to text holding a stop string (works with
    any tokenizer; the exact end is found afterwards by :func:`_stop_string_end`)."""

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str]) -> None:
        self.tokenizer, self.stop_strings = tokenizer, list(stop_strings)
        self.tail = max(map(len, self.stop_strings)) + 16  # tokens: at least a character each
        self.start = -1  # where the new tokens begin in input_ids

    def __call__(self, input_ids: Tensor, scores: Any, **kwargs: Any) -> Tensor:
        if self.start < 0:
            self.start = input_ids.shape[1] - 1
        first = max(self.start, input_ids.shape[1] - self.tail)
        texts = self.tokenizer.batch_decode(input_ids[:, first:].tolist())
        done = [any(s in text for s in self.stop_strings) for text in texts]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)  # (B,)


class _FinishWatch(StoppingCriteria):
    """A stopping criterion that stops nothing (unless cancelled): after each decode step it
    finds the rows that just ended, and every ``every`` steps queues those found since the last
    piece with their tokens and logprobs so far."""

    def __init__(
        self,
        setup: _Setup,
        tokenizer: Any,
        recorder: _StepLogprobRecorder,
        every: int,
        out: queue.Queue[Any],
        cancel: threading.Event,
    ) -> None:
        self.setup, self.tokenizer, self.recorder = setup, tokenizer, recorder
        self.every, self.out, self.cancel = every, out, cancel
        self.start = -1  # where the new tokens begin in input_ids
        self.logprobs: list[Tensor] = []  # R x (B,)
        self.open: list[int] = []  # rows still generating
        self.ended: list[int] = []  # rows ended since the last piece

    def __call__(self, input_ids: Tensor, scores: Any, **kwargs: Any) -> Tensor:
        if self.start < 0:
            self.start = input_ids.shape[1] - 1
            self.open = list(range(input_ids.shape[0]))
        last = input_ids[:, -1:]  # (B, 1): the token sampled at this step
        assert self.recorder.last is not None  # the processor ran before sampling
        self.logprobs.append(self.recorder.last.gather(-1, last).squeeze(-1))  # (B,)
        tokens = last.squeeze(-1).tolist()
        stop_ids, stop_strings = self.setup.stop_ids, self.setup.stop_strings
        still = []
        for b in self.open:
            ended = tokens[b] in stop_ids or (
                stop_strings
                and _stop_string_end(
                    self.tokenizer, input_ids[b, self.start :].tolist(), stop_strings
                )
                is not None
            )
            (self.ended if ended else still).append(b)
        self.open = still
        step = input_ids.shape[1] - self.start  # tokens so far
        if step >= self.setup.config.max_new_tokens:  # the last step: every row ends here
            self.ended += self.open
            self.open = []
        if self.ended and (step % self.every == 0 or not self.open):
            self.flush(input_ids[:, self.start :])
        return torch.full(
            (input_ids.shape[0],), self.cancel.is_set(), dtype=torch.bool, device=input_ids.device
        )

    def flush(self, new_tokens: Tensor) -> None:
        """Queue the rows ended since the last piece (with ``new_tokens``: int64[B, t])."""
        rows, self.ended = self.ended, []
        index = torch.tensor(rows, device=new_tokens.device)  # (r,)
        steps = torch.stack(self.logprobs, dim=1)  # (B, t)
        self.out.put(("piece", rows, new_tokens[index].cpu(), steps[index].cpu()))


def generate_stream(
    policy: Any, batch: PromptBatch, *, every: int = 1, **sampling: Any
) -> Iterator[tuple[list[int], Generation]]:
    """:func:`generate` (the same ``sampling`` options), handed out as ``(rows, Generation of
    those rows)`` while it runs, a piece every ``every`` decode steps that ended rows.

    ``generate`` runs on a worker thread, seeded by the caller's random state as
    :func:`generate` would be (torch's generator is process-wide); keep other draws off it
    until the iterator is exhausted. Closing the iterator early stops the generation at the
    next decode step.
    """
    if every < 1:
        raise ValueError(f"generate_stream: every={every}; it must be >= 1 (decode steps)")
    setup = _Setup(policy, **sampling)
    recorder = _StepLogprobRecorder(setup.logprob_temperature)
    out: queue.Queue[Any] = queue.Queue()
    cancel = threading.Event()
    watch = _FinishWatch(setup, policy.tokenizer, recorder, every, out, cancel)

    def work() -> None:
        try:
            criteria = StoppingCriteriaList([watch])
            new_tokens = setup.run(policy, batch, recorder, stopping_criteria=criteria)
            watch.ended += watch.open  # rows still open if generate stopped for another reason
            watch.open = []
            if watch.ended:
                watch.flush(new_tokens)
            out.put(("done",))
        except BaseException as exc:  # handed to the caller, raised there
            out.put(("error", exc))

    worker = threading.Thread(target=work, name="yatt-generate", daemon=True)
    worker.start()
    try:
        while True:
            item = out.get()
            if item[0] == "done":
                return
            if item[0] == "error":
                raise item[1]
            _, rows, tokens, logprobs = item
            yield rows, setup.finish(policy, tokens, logprobs)
    finally:
        cancel.set()
        worker.join()
