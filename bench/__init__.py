"""Benchmarks: run with `python -m bench.NAME`; figures go to docs/PERFORMANCE.md."""
