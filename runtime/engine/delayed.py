"""The values of delayed edges in one process, and which of them a step reads.

A delayed edge (``g.connect(..., delay=1)``, weight sync from the update back to the rollout)
carries a producer's value into later steps. With ``max_staleness`` K, step k may read the
values produced at steps ``[k-1-K, k-1]``; how it picks one is the ``staleness`` mode:

* ``"fixed"``: always the value of step k-1-K (None while k-1-K < 0), waiting for it. Every
  process reads the same value whatever the timing, so a run is bitwise reproducible and a
  ZeroMQ run equals the in-process one.
* ``"bound"``: the newest value there is from ``[k-1-K, k-1]``, waiting only while none of
  them has arrived; while k-1-K < 0 the newest one produced so far, or None before the first.
  One process running one step at a time reads the value of step k-1 (on-policy); a consumer
  never reads a value older than k-1-K, nor one from step k or later.

The values are kept by producer port and producing step; :meth:`DelayedValues.prune` forgets
those below the oldest window a reader can still read from, so memory stays flat however long
the run.
"""

from __future__ import annotations

from typing import Any

__all__ = ["STALENESS_MODES", "DelayedValues", "check_staleness_mode"]

STALENESS_MODES = ("fixed", "bound")


def check_staleness_mode(staleness: Any, who: str) -> str:
    """``staleness`` if it is one of :data:`STALENESS_MODES`, else a ValueError saying both."""
    if staleness not in STALENESS_MODES:
        raise ValueError(
            f"{who}: staleness must be 'fixed' (a delayed edge reads the value from exactly "
            f"max_staleness+1 steps back: reproducible) or 'bound' (the newest value at most "
            f"max_staleness versions old), got {staleness!r}"
        )
    return staleness


class DelayedValues:
    """Delayed-edge values by ``(src, port)`` and producing step, and the rule that reads them.

    Args:
        max_staleness: K, the most versions a read value may lag the step before.
        mode: ``"fixed"`` or ``"bound"`` (see the module docstring).
    """

    def __init__(self, max_staleness: int = 0, mode: str = "fixed"):
        self.max_staleness, self.mode = max_staleness, check_staleness_mode(mode, "DelayedValues")
        self.lag = 1 + max_staleness
        self._values: dict[tuple[str, str], dict[int, Any]] = {}

    def window(self, step: int) -> range:
        """The producing steps that step ``step`` may read (those of a checkpoint at ``step``)."""
        return range(max(0, step - self.lag), step)

    def has(self, src: str, port: str, produced: int) -> bool:
        return produced in self._values.get((src, port), {})

    def put(self, src: str, port: str, produced: int, value: Any) -> bool:
        """Keep ``src.port`` of step ``produced``; False (nothing kept) if it is already here."""
        got = self._values.setdefault((src, port), {})
        if produced in got:
            return False
        got[produced] = value
        return True

    def get(self, src: str, port: str, produced: int) -> Any:
        return self._values[(src, port)][produced]

    def pick(self, src: str, port: str, step: int) -> tuple[bool, int | None]:
        """``(ready, produced)``: whether step ``step`` can read ``src.port`` now, and from which
        producing step (None: it reads None, nothing in its window having been produced)."""
        low = step - self.lag
        if self.mode == "fixed":
            if low < 0:
                return True, None
            return self.has(src, port, low), low
        got = self._values.get((src, port), {})
        newest = max((p for p in got if low <= p < step), default=None)
        if newest is not None:
            return True, newest
        return low < 0, None  # before the first full window: None rather than waiting

    def prune(self, src: str, port: str, floor: int) -> None:
        """Forget the values of ``src.port`` produced before step ``floor``."""
        got = self._values.get((src, port))
        if got:
            for produced in [p for p in got if p < floor]:
                del got[produced]

    def count(self) -> int:
        """How many values are kept (all ports), for tests of the memory bound."""
        return sum(len(v) for v in self._values.values())
