"""Prompts fitted to a policy's context before it samples (the rollout, the validation pass):
a prompt that leaves no room for the response is one error naming it, or, with
``max_prompt_tokens``, keeps its last tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nodes.chat import chat_messages
from nodes.models.policy_base import Policy, PromptBatch
from yatt_graph import UsageError

__all__ = ["fit_prompts"]


def fit_prompts(
    policy: Policy,
    batch: PromptBatch,
    prompts: Sequence[str | list[dict[str, Any]]],
    *,
    max_new_tokens: int,
    max_prompt_tokens: int | None,
    who: str,
) -> PromptBatch:
    """``batch`` with every prompt leaving room for ``max_new_tokens`` in ``policy``'s context.

    With ``max_prompt_tokens`` a longer prompt keeps its last ``max_prompt_tokens``
    tokens (the question and the chat template's assistant turn are at its end), as TRL
    truncates; a prompt whose image tokens would be cut is refused. Without it, a prompt
    that does not fit is one error naming it, its length, the context and the fixes.
    ``prompts`` are the rows' prompts, text or chat messages (for the message).
    """
    if max_prompt_tokens is not None:
        batch = _cut_prompts(policy, batch, prompts, max_prompt_tokens, who)
    limit = policy.context_length
    if limit is None:
        return batch
    needed = policy.prompt_positions(batch) + max_new_tokens  # (B,)
    over = (needed > limit).nonzero().flatten().tolist()
    if over:
        i = over[0]
        n = int(needed[i]) - max_new_tokens
        other = n - int(batch.prompt_mask[i].sum())  # positions that are not the text's
        room = limit - max_new_tokens - other
        fix = (
            f"or keep each prompt's last N tokens with --set max_prompt_tokens=N (N <= {room})"
            if room >= 1
            else "(no prompt fits beside this many new tokens)"
        )
        raise UsageError(
            f"{who}: the prompt {_preview(prompts[i])} takes {n} positions and "
            f"max_new_tokens={max_new_tokens} more, {n + max_new_tokens} in all, but the "
            f"model takes {limit} ({len(over)} of {len(prompts)} rows are too long); "
            f"shorten the prompts, lower max_new_tokens, {fix}"
        )
    return batch


def _cut_prompts(
    policy: Policy,
    batch: PromptBatch,
    prompts: Sequence[str | list[dict[str, Any]]],
    keep: int,
    who: str,
) -> PromptBatch:
    """Left-padded rows cut to their last ``keep`` tokens (the prompt's end)."""
    if batch.prompt_ids.shape[1] <= keep:
        return batch
    lengths = batch.prompt_mask.sum(1)  # (B,)
    image_token = getattr(policy, "image_token_id", None)
    if image_token is not None:
        cut = batch.prompt_ids[:, :-keep]  # (B, P - keep): the tokens that would go
        hit = ((cut == image_token) & (batch.prompt_mask[:, :-keep] > 0)).any(1)
        if hit.any():
            i = int(hit.nonzero()[0])
            raise UsageError(
                f"{who}: the prompt {_preview(prompts[i])} takes {int(lengths[i])} tokens, "
                f"over max_prompt_tokens={keep}, and cutting it would cut its "
                "image's tokens; raise max_prompt_tokens or shorten the prompt's text"
            )
    return PromptBatch(
        batch.prompt_ids[:, -keep:],
        batch.prompt_mask[:, -keep:],
        {
            k: (v[:, -keep:] if v.dim() == 2 and v.shape == batch.prompt_ids.shape else v)
            for k, v in batch.model_inputs.items()
        },
    )


def _preview(prompt: str | list[dict[str, Any]], n: int = 40) -> str:
    """The start of a prompt, for messages: ``'What colour is the sh...'``; chat messages as
    their last one's ``role: content``, the turn that asks."""
    messages = chat_messages(prompt)
    text = prompt if messages is None else f"{messages[-1]['role']}: {messages[-1]['content']}"
    return repr(text[:n] + ("..." if len(text) > n else ""))
