"""What two runs of the same settings must agree on in their metrics rows."""

TIMING = ("time/", "util/", "sched/")
"""Prefixes of the figures that wall-clock timing and scheduling decide."""


def learning_values(row: dict) -> dict:
    """A metrics row without what timing decides: times, throughput, cores, utilization and
    every ``.../seconds``-like figure (the rollout's ``weight_sync/seconds``, ...)."""
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(TIMING) and k != "samples_per_s" and not k.endswith("seconds")
    }
