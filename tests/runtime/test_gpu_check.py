"""The prepared GPU check (bench/gpu_check.py) where it cannot check anything: asked for CUDA
on a machine without it, it fails and says why, rather than passing with every row skipped."""

import re

import pytest
import torch


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="this is the answer of a machine without CUDA"
)
def test_the_gpu_check_fails_where_it_checked_nothing(capsys):
    from bench.gpu_check import main

    assert main(["--skip-cli"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"\| device +\| FAILED \(no CUDA: torch \S+ built for CUDA", out), out
    assert "driver:" in out
