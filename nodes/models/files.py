"""Checks on model directories before they load, so that a missing, truncated or corrupt
file is one ``ValueError`` line naming the file (not a deserializer's traceback)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__: list[str] = []  # private helpers of the policy families


def _local_dir(fn: str, path: str | Path) -> Path:
    """``path`` as a local directory, or a ValueError: models load only from local paths."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"{fn}: {str(path)!r} is not a local directory; models load only from local paths "
            "(nothing is downloaded). Save one with policy.save_pretrained(dir)."
        )
    return path


def _read_json(fn: str, path: Path, what: str) -> dict[str, Any]:
    """A JSON object file, or a ValueError naming the file and what is wrong with it."""
    if not path.is_file():
        raise ValueError(f"{fn}: {str(path)!r} is missing; a {what} needs it")
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{fn}: {str(path)!r} is not valid JSON ({exc}); rewrite it") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{fn}: {str(path)!r} holds a {type(value).__name__}, not a JSON object")
    return value


def _check_checkpoint_dir(fn: str, path: Path) -> None:
    """Check what a transformers checkpoint directory needs before loading it: a readable
    ``config.json`` and readable ``*.safetensors`` headers (each error names its file)."""
    from safetensors import safe_open

    if not (path / "config.json").is_file():
        found = sorted(p.name for p in path.iterdir())[:6]
        raise ValueError(
            f"{fn}: {str(path)!r} has no config.json (it holds {found or 'nothing'}); give a "
            "directory written by save_pretrained"
        )
    _read_json(fn, path / "config.json", "model checkpoint")
    for weights in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(weights), "pt"):
                pass
        except Exception as exc:  # safetensors raises its own error class
            raise ValueError(
                f"{fn}: {str(weights)!r} cannot be read ({exc}); the file is truncated or "
                "corrupt: save the model again"
            ) from exc


@contextlib.contextmanager
def _loading(fn: str, path: Path) -> Iterator[None]:
    """Turn a loader's error (transformers, safetensors, torch) into one ValueError line
    naming ``path``."""
    try:
        yield
    except ValueError:
        raise
    except Exception as exc:
        why = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(
            f"{fn}: the model in {str(path)!r} could not be loaded ({type(exc).__name__}: {why})"
        ) from exc


def config_positions(config: Any) -> int | None:
    """Positions one sequence may take under a transformers config (its text part's
    ``max_position_embeddings`` or ``n_positions``); None if it names none."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 0)
    return int(n) if n else None


def _load_pretrained(
    fn: str, path: str | Path, auto_class: str, dtype: str, companion: Callable[[Path], Any]
) -> tuple[Any, Any]:
    """A local checkpoint directory's model (``transformers.<auto_class>`` in ``dtype``) and
    its tokenizer or processor (``companion(path)``): checked first, local files only, and an
    error is one ValueError line naming the path."""
    import torch
    import transformers

    path = _local_dir(fn, path)
    _check_checkpoint_dir(fn, path)
    with _loading(fn, path):
        model, info = getattr(transformers, auto_class).from_pretrained(
            path, dtype=getattr(torch, dtype), local_files_only=True, output_loading_info=True
        )
        _check_loaded(fn, path, model, info)
        reader = companion(path)
    _check_vocabulary(fn, path, model, getattr(reader, "tokenizer", reader))
    return model, reader


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def _check_vocabulary(fn: str, path: Path, model: Any, tokenizer: Any) -> None:
    """Refuse a folder with no tokenizer of its own (transformers then builds an empty one
    from the model type) or one whose ids run past the model's embedding rows."""
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"{fn}: {str(path)!r} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
            "save the model's tokenizer there too (tokenizer.save_pretrained(path))"
        )
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ValueError(
            f"{fn}: {str(path)!r}: the tokenizer has {len(tokenizer)} tokens and the model's "
            f"embedding {rows} rows, so ids from {rows} on would index past it; the tokenizer is "
            "of another model"
        )


def _check_loaded(fn: str, path: Path, model: Any, info: dict[str, Any]) -> None:
    """Refuse a model whose weight files and ``config.json`` describe different models:
    transformers loads what fits, leaves the rest at random values and only warns."""
    missing, unexpected = (
        sorted(info.get("missing_keys", ())),
        sorted(info.get("unexpected_keys", ())),
    )
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} weight(s) its config needs are not in the files ({missing[0]}, ...)"
        )
    if unexpected:
        parts.append(f"{len(unexpected)} in the files fit no layer of it ({unexpected[0]}, ...)")
    kind = getattr(model.config, "model_type", "?")
    raise ValueError(
        f"{fn}: {str(path)!r}: the weights do not fit its config.json (model_type {kind!r}): "
        f"{'; '.join(parts)}; the config and the weight files are of different models (a "
        "config edited or copied from another model?)"
    )


#: tokenizer classes that ``tokenizer.json`` describes completely
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _load_tokenizer(path: Path) -> Any:
    """The tokenizer saved in ``path``, local files only.

    A directory whose ``tokenizer_config.json`` declares a generic fast tokenizer (what
    ``save_pretrained`` writes for one built in code) loads exactly its ``tokenizer.json``:
    ``AutoTokenizer`` would swap in the model type's own class for some types (Qwen2's
    tokenizer rebuilds its pre-tokenizer and drops a word-level tokenizer's spaces)."""
    from transformers import AutoTokenizer

    config_file = path / "tokenizer_config.json"
    declared = None
    if config_file.is_file() and (path / "tokenizer.json").is_file():
        with contextlib.suppress(OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            declared = json.loads(config_file.read_text()).get("tokenizer_class")
    if declared in _GENERIC_TOKENIZERS:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
