#!/usr/bin/env bash
# Bench-only install of Ray into .bench/ray (never into .venv, never run by `make test`).
#
#     bash bench/install_ray.sh            # then: .venv/bin/python -m bench.dispatch
#
# bench/_util.py appends .bench/ray to sys.path *after* site-packages, so the project's own
# packages (numpy, msgspec, ...) always win over any copies pip puts here as Ray's
# dependencies. Remove with `rm -rf .bench/ray`.
set -euo pipefail
cd "$(dirname "$0")/.."
RAY_VERSION="${RAY_VERSION:-2.60.0}"
test -x .venv/bin/pip || { echo "no .venv: run 'make install' first" >&2; exit 1; }
mkdir -p .bench
rm -rf .bench/ray  # a clean install each time (pip --target does not replace folders)
.venv/bin/pip install --quiet --target .bench/ray "ray==${RAY_VERSION}"
echo "ray ${RAY_VERSION} installed in .bench/ray"
