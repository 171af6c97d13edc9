"""Prompts as chat messages: a list of ``{"role", "content"}`` (as TRL and the chat datasets
hold them), which a policy formats with its chat template."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from yatt_graph import UsageError

__all__ = ["chat_messages", "needs_template"]


def chat_messages(prompt: Any) -> list[dict[str, Any]] | None:
    """A prompt given as chat messages (a list of ``{"role", "content"}``, as TRL and the chat
    datasets hold them), or None for a plain text prompt; ValueError for anything else."""
    if isinstance(prompt, str):
        return None
    if (
        isinstance(prompt, list | tuple)
        and prompt
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m
            for m in prompt
        )
    ):
        return [dict(m) for m in prompt]
    raise ValueError(
        f"a prompt is text or a list of chat messages ({{'role': ..., 'content': ...}}), "
        f"got {prompt!r:.80}"
    )


def needs_template(why: str) -> UsageError:
    """The error for chat-message prompts given to a policy that cannot format them; ``why``
    says why it cannot (``"its tokenizer has none"``)."""
    return UsageError(
        f"a prompt of chat messages needs the policy's chat template, and {why}; give the "
        "prompt column as text, or --policy a model with a chat template"
    )
