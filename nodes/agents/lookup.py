"""The ready agent task: the shapes task's question, answered only by using a tool.

The prompt asks for the shape's colour (``what color is the shape ?``) and says nothing of it;
the ``look`` tool returns the shape described in words (``it is one red square .``). An
answer counts only after a look, as a grader that takes no unseen claim: a policy that answers
at once scores 0, and one that looks first, then names the colour it was shown, scores 1.

Where a guess scores as an answer (chance, 0.25) the tiny policy does not find the tool: at
first a look followed by a random word scores less than naming a random colour, so the policy
learns to guess and seldom looks (2-7 % of its trajectories after 400 steps, in two runs; the
reward near chance, 0.2).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nodes.agents.env import Observation, ToolEnv
from nodes.data import COUNTS, answer_reward
from yatt_graph import UsageError

__all__ = ["LookEnv", "LookImageEnv"]


class LookEnv(ToolEnv):
    """One ``look`` tool; the final answer, after a look, is scored by
    :func:`nodes.data.answer_reward` (1 for the colour, 0 otherwise)."""

    max_turns = 2
    words = ("look",)

    @property
    def tools(self) -> Mapping[str, Any]:  # type: ignore[override]
        return {"look": self.look}

    def reset(self, row: Mapping[str, Any]) -> Observation:
        for key in ("color", "shape", "count", "answer"):
            if key not in row:  # the data, not one trajectory: the run stops
                raise UsageError(
                    f"LookEnv: the data row has no {key!r} column; it runs on the shapes task "
                    "(no --data), whose rows have color, shape, count and answer"
                )
        return super().reset(row)

    def look(self, *words: str) -> str:
        """The shape, described in words (what it is asked to look at is ignored)."""
        row = self.row
        return f"it is {COUNTS[int(row['count']) - 1]} {row['color']} {row['shape']} ."

    def score(self, answer: str) -> float:
        if not self.calls:  # the shape was never seen: a guess
            return 0.0
        return answer_reward(answer, self.row, format_bonus=0.0)


class LookImageEnv(LookEnv):
    """The look task with images: the prompt comes with a dark picture (a plain grey card of
    the image's size: the colour and the shape are hidden), and ``look`` returns the row's
    own image, which shows them. The answer is scored as :class:`LookEnv`'s."""

    def reset(self, row: Mapping[str, Any]) -> Observation:
        if "image" not in row:  # the data, not one trajectory: the run stops
            raise UsageError(
                "LookImageEnv: the data row has no image; it runs on the shapes task with "
                "images (mm_agent, no --data)"
            )
        first = super().reset(row)
        from PIL import Image

        dark = Image.new("RGB", row["image"].size, (96, 96, 96))
        return Observation(first.text, [dark])

    def look(self, *words: str) -> Observation:  # type: ignore[override]
        """The row's image (what it is asked to look at is ignored)."""
        return Observation("", [self.row["image"]])
