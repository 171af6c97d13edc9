#!/usr/bin/env bash
# Bench-only install of TRL into .bench/trl (never into .venv, never run by `make test`),
# for bench/trl_grpo.py. --no-deps: TRL's dependencies (transformers, accelerate, datasets)
# are the project's own, at the versions of .venv. Remove with `rm -rf .bench/trl`.
set -euo pipefail
cd "$(dirname "$0")/.."
TRL_VERSION="${TRL_VERSION:-1.16.0}"
test -x .venv/bin/pip || { echo "no .venv: run 'make install' first" >&2; exit 1; }
mkdir -p .bench
rm -rf .bench/trl
.venv/bin/pip install --quiet --no-deps --target .bench/trl "trl==${TRL_VERSION}"
echo "trl ${TRL_VERSION} installed in .bench/trl"
