"""Prompts as chat messages: a list of ``{"role", "content"}`` (as TRL and the chat datasets
hold them), which a policy formats with its chat template."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["chat_messages"]


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
