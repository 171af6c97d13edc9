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
