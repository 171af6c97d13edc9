"""Checks on model directories before they load, so that a missing, truncated or corrupt
file is one :class:`~yatt_graph.UsageError` line naming the folder, what is wrong and the fix
(not a deserializer's traceback, and never a step later)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from yatt_graph import UsageError

__all__ = ["save_tokenizer"]  # the rest: private helpers of the policy families

Reader = Literal["tokenizer", "processor"]
"""What reads a model's inputs: a tokenizer (text models), or a processor (a VLM: its
tokenizer and image processor)."""


def _local_dir(fn: str, path: str | Path) -> Path:
    """``path`` as a local directory, or a UsageError: models load only from local paths."""
    path = Path(path)
    if not path.is_dir():
        raise UsageError(
            f"{fn}: {str(path)!r} is not a local directory; models load only from local paths "
            "(nothing is downloaded). Save one with policy.save_pretrained(dir)."
        )
    return path


def _read_json(fn: str, path: Path, what: str) -> dict[str, Any]:
    """A JSON object file, or a UsageError naming the file and what is wrong with it."""
    if not path.is_file():
        raise UsageError(f"{fn}: {str(path)!r} is missing; a {what} needs it")
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise UsageError(
            f"{fn}: {str(path)!r} cannot be read ({why}); make it a readable JSON file (copy it "
            "again from the model)"
        ) from exc
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{fn}: {str(path)!r} is not valid JSON ({exc}); rewrite it") from exc
    if not isinstance(value, dict):
        raise UsageError(f"{fn}: {str(path)!r} holds a {type(value).__name__}, not a JSON object")
    return value


def _found(path: Path) -> str:
    """A few of the names in a folder, for messages."""
    try:
        names = sorted(p.name for p in path.iterdir())
    except OSError:
        return "nothing readable"
    if not names:
        return "nothing"
    return str(names[:6])[:-1] + (", ...]" if len(names) > 6 else "]")


#: the weight files ``from_pretrained`` reads, in its order of preference
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _check_checkpoint_dir(fn: str, path: Path, reader: Reader | None = "tokenizer") -> None:
    """Check what a transformers checkpoint directory needs before anything loads it, reading
    only its JSON files and the safetensors headers: a readable ``config.json``, weight files
    (whole shards included), and, with ``reader``, the files of its tokenizer (and of its
    image processor for a ``"processor"``). Each failure is one UsageError naming the folder
    or file, what is missing and how to fix it."""
    path = _local_dir(fn, path)
    if not (path / "config.json").is_file():
        raise UsageError(
            f"{fn}: {str(path)!r} has no config.json (it holds {_found(path)}); give a "
            "directory written by save_pretrained"
        )
    _check_model_type(fn, path, _read_json(fn, path / "config.json", "model checkpoint"))
    _check_weights(fn, path)
    if reader is not None:
        _check_reader_files(fn, path, reader)


def _check_reader_files(fn: str, path: Path, reader: Reader) -> None:
    """The files of a checkpoint's tokenizer (and, for a ``"processor"``, its image
    processor's), and the package that reads them."""
    _check_tokenizer_files(fn, path)
    if reader == "processor":
        _check_processor_files(fn, path)


def _check_model_type(fn: str, path: Path, config: dict[str, Any]) -> None:
    """A ``model_type`` this transformers knows (its config class builds the model)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UsageError(
            f"{fn}: the model in {str(path)!r} could not be loaded: its config.json names no "
            "model_type, so it is not a transformers config; give a directory written by "
            "save_pretrained"
        )
    if model_type not in CONFIG_MAPPING_NAMES:
        raise UsageError(
            f"{fn}: the model in {str(path)!r} could not be loaded: its config.json names "
            f"model_type {model_type!r}, which transformers {transformers.__version__} does not "
            "know; upgrade transformers (pip install -U transformers), or give a model of a "
            "type it knows"
        )


def _check_weights(fn: str, path: Path) -> None:
    """Weight files ``from_pretrained`` reads, every shard an index names, and safetensors
    headers that read."""

    present = [name for name in WEIGHT_FILES if (path / name).is_file()]
    if not present:
        if (path / "adapter_config.json").is_file():
            raise UsageError(
                f"{fn}: {str(path)!r} holds a LoRA adapter (adapter_config.json) and no model "
                "weights; merge it into its base model and save that (PeftModel.from_pretrained"
                "(base, path).merge_and_unload().save_pretrained(dir)), or give the base model"
            )
        raise UsageError(
            f"{fn}: {str(path)!r} holds no weights (none of {', '.join(WEIGHT_FILES)}; it "
            f"holds {_found(path)}); copy the model's weight files there too "
            "(model.save_pretrained(path) writes them)"
        )
    for index in (name for name in present if name.endswith(".index.json")):
        weight_map = _read_json(fn, path / index, "sharded checkpoint").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UsageError(
                f"{fn}: {str(path / index)!r} has no weight_map; it is not a checkpoint index "
                "(copy it again from the model)"
            )
        shards = sorted({str(v) for v in weight_map.values()})
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            raise UsageError(
                f"{fn}: {str(path / index)!r} names {len(missing)} of {len(shards)} weight "
                f"files that are not in the folder ({missing[0]}{', ...' * (len(missing) > 1)}); "
                "copy every file it lists (a download or copy stopped part way?)"
            )
    for weights in sorted(path.glob("*.safetensors")):
        _check_safetensors(fn, weights, "model")


def _check_safetensors(fn: str, file: Path, what: str) -> None:
    """A safetensors file whose header reads; else one UsageError saying to save ``what``
    again."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt"):
            pass
    except Exception as exc:  # safetensors raises its own error class
        raise UsageError(
            f"{fn}: {str(file)!r} cannot be read ({exc}); the file is truncated or "
            f"corrupt: save the {what} again"
        ) from exc


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model")


def _check_tokenizer_files(fn: str, path: Path) -> None:
    """The files a tokenizer loads from, and the package that reads them. Without one,
    transformers builds an empty tokenizer from the model type, or fails deep inside."""
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise UsageError(
            f"{fn}: {str(path)!r} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
            "save the model's tokenizer there too (tokenizer.save_pretrained(path))"
        )
    if (path / "tokenizer_config.json").is_file():
        _read_json(fn, path / "tokenizer_config.json", "tokenizer")
    if (path / "tokenizer.json").is_file():
        return
    others = ("merges.txt", "vocab.txt", *_SENTENCEPIECE_FILES)
    if (path / "vocab.json").is_file() and not any((path / name).is_file() for name in others):
        raise UsageError(
            f"{fn}: {str(path)!r} has the tokenizer's vocab.json but not its merges.txt "
            "(and no tokenizer.json); copy merges.txt too (tokenizer.save_pretrained(path) "
            "writes every file)"
        )
    sentencepiece = [name for name in _SENTENCEPIECE_FILES if (path / name).is_file()]
    others = [name for name in ("vocab.json", "vocab.txt") if (path / name).is_file()]
    if sentencepiece and not others and importlib.util.find_spec("sentencepiece") is None:
        raise UsageError(
            f"{fn}: {str(path)!r} has its tokenizer only as {sentencepiece[0]} (SentencePiece) "
            "and no tokenizer.json; install sentencepiece (pip install sentencepiece), or save "
            "a tokenizer.json there (AutoTokenizer.from_pretrained(original).save_pretrained"
            "(path) where sentencepiece is installed)"
        )


def _check_processor_files(fn: str, path: Path) -> None:
    """An image-text-to-text model's image processor: ``preprocessor_config.json``, or a
    ``processor_config.json`` that holds one (what transformers 5 writes)."""
    if (path / "preprocessor_config.json").is_file():
        _read_json(fn, path / "preprocessor_config.json", "image processor")
        return
    if (path / "processor_config.json").is_file():
        config = _read_json(fn, path / "processor_config.json", "processor")
        if isinstance(config.get("image_processor"), dict):
            return
    raise UsageError(
        f"{fn}: {str(path)!r} holds an image-text-to-text model but no image processor (no "
        "preprocessor_config.json, nor a processor_config.json holding one); save the model's "
        "processor there too (AutoProcessor.from_pretrained(original).save_pretrained(path))"
    )


@contextlib.contextmanager
def _loading(fn: str, path: Path, what: str = "") -> Iterator[None]:
    """Turn a loader's error (transformers, safetensors, torch) into one UsageError line
    naming ``path`` (and ``what`` it was to be loaded as); no progress bar meanwhile
    (:func:`_no_bars`)."""
    try:
        with _no_bars():
            yield
    except UsageError:
        raise
    except Exception as exc:
        why = (str(exc).strip().splitlines() or [""])[0]
        raise UsageError(
            f"{fn}: the model in {str(path)!r} could not be loaded{' as ' + what if what else ''}"
            f" ({type(exc).__name__}: {why})"
        ) from exc


@contextlib.contextmanager
def _no_bars() -> Iterator[None]:
    """transformers' own progress bars ("Loading weights", "Writing model shards") off while
    a model loads or saves: the run's progress bar is the one to read, and ``--quiet`` means
    quiet; the caller's setting is back after, for a notebook's other loads."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def config_positions(config: Any) -> int | None:
    """Positions one sequence may take under a transformers config, or a ``config.json``
    read as a dict (its text part's ``max_position_embeddings`` or ``n_positions``); None if
    it names none."""
    if isinstance(config, dict):
        text = config.get("text_config")
        parts = [text, config] if isinstance(text, dict) else [config]
        found = [p.get("max_position_embeddings") or p.get("n_positions") for p in parts]
        n = next((x for x in found if isinstance(x, int) and not isinstance(x, bool)), 0)
    else:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        n = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 0)
    return int(n) if n and n > 0 else None


def _load_pretrained(
    fn: str,
    path: str | Path,
    auto_class: str,
    dtype: str,
    companion: Callable[[Path], Any],
    reader: Reader = "tokenizer",
) -> tuple[Any, Any]:
    """A local checkpoint directory's model (``transformers.<auto_class>`` in ``dtype``) and
    its tokenizer or processor (``companion(path)``, a ``reader``): checked first, local files
    only, and an error is one UsageError line naming the path."""
    import torch
    import transformers

    path = _local_dir(fn, path)
    _check_checkpoint_dir(fn, path, reader)
    with _loading(fn, path):
        model, info = getattr(transformers, auto_class).from_pretrained(
            path, dtype=getattr(torch, dtype), local_files_only=True, output_loading_info=True
        )
        _check_loaded(fn, path, model, info)
        loaded = companion(path)
    _check_vocabulary(fn, path, model, getattr(loaded, "tokenizer", loaded))
    return model, loaded


def _check_vocabulary(fn: str, path: Path, model: Any, tokenizer: Any) -> None:
    """Refuse a tokenizer whose ids run past the model's embedding rows."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise UsageError(
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
    raise UsageError(
        f"{fn}: {str(path)!r}: the weights do not fit its config.json (model_type {kind!r}): "
        f"{'; '.join(parts)}; the config and the weight files are of different models (a "
        "config edited or copied from another model?)"
    )


#: tokenizer classes that ``tokenizer.json`` describes completely
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


_TOKENIZER_MODULE = "tokenization_yatt"
_TOKENIZER_MODULE_TEXT = '''"""The tokenizer of a model exported by yatt-graph: its tokenizer.json, as it is.

AutoTokenizer gives some model types (qwen2) their own tokenizer class, which rebuilds the
pre-tokenizer from the type and would lose this tokenizer's words. tokenizer_config.json names
this class in its auto_map: with trust_remote_code=True AutoTokenizer loads it from here, and
without, it reads tokenizer.json with the generic class tokenizer_config.json names.
"""

try:
    from transformers import TokenizersBackend as _Base
except ImportError:  # transformers 4
    from transformers import PreTrainedTokenizerFast as _Base


class TokenizerJson(_Base):
    """tokenizer.json as it is (no class of a model type rebuilding it)."""
'''


def save_tokenizer(tokenizer: Any, path: str | Path, *, built_in_code: bool) -> None:
    """``tokenizer.save_pretrained(path)``; one ``built_in_code`` (a tiny policy's) so that
    ``AutoTokenizer.from_pretrained(path)`` gives it as it is (:func:`_pin_tokenizer_json`)."""
    tokenizer.save_pretrained(path)
    if built_in_code:
        _pin_tokenizer_json(Path(path))


def _pin_tokenizer_json(path: Path) -> None:
    """Make a tokenizer built in code (a generic fast tokenizer, which its ``tokenizer.json``
    describes completely), saved in ``path``, load as it is with ``AutoTokenizer``, whatever
    the folder's model type: for some types (qwen2) transformers swaps in the type's own
    class, which rebuilds the pre-tokenizer and drops every word of a word-level vocabulary.
    Its ``tokenizer_config.json`` gets an ``auto_map`` to a class beside it that loads
    ``tokenizer.json`` unchanged, which AutoTokenizer follows (with ``trust_remote_code``) or
    answers with the generic class the config names (without). Only for tokenizers made
    here: a pretrained model's is left as its makers saved it."""
    config_file = path / "tokenizer_config.json"
    if not (config_file.is_file() and (path / "tokenizer.json").is_file()):
        return
    config = json.loads(config_file.read_text())
    if config.get("tokenizer_class") not in _GENERIC_TOKENIZERS:
        return
    config["auto_map"] = {"AutoTokenizer": [None, f"{_TOKENIZER_MODULE}.TokenizerJson"]}
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (path / f"{_TOKENIZER_MODULE}.py").write_text(_TOKENIZER_MODULE_TEXT)


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
