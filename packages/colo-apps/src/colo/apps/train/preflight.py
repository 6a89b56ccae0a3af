"""Checks of a validated `RunConfig` against the world outside it, run before any process trains.

The pydantic model checks the fields among themselves; these look at the files and the model's shape: data paths
that do not exist, data files that are not text or hold nothing, a prepared corpus that is damaged or was made
with another tokenizer than ``data.tokenizer``, a ``model.init_from`` without weights, a
tensor-parallel size that does not divide the heads, a ``checkpoint.resume`` directory that is not a checkpoint, a
``logging.report_to`` tracker that is not installed.
``colo launch`` runs them before torchrun starts and ``colo train`` before it builds anything, so the error is
printed once, as one line naming the field, instead of a traceback from inside every rank.
"""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING

from .loading import ConfigError
from .task import task_spec

if TYPE_CHECKING:
    from .config import RunConfig


def check_before_start(config: RunConfig) -> None:
    """Raise `ConfigError` (``invalid run config: FIELD: what is wrong; what to do``) for the first problem found.

    Args:
        config: the validated run config.
    """
    for check in (_data_paths, _data_files, _prepared_corpora, _init_from, _tensor_parallel, _resume, _trackers):
        problem = check(config)
        if problem is not None:
            raise ConfigError(f"invalid run config: {problem}")


def _data_paths(config: RunConfig) -> str | None:
    for index, path in enumerate(config.data.paths):
        if os.path.exists(path) or (glob.has_magic(path) and glob.glob(path, recursive=True)):
            continue
        what = "the pattern matches no files" if glob.has_magic(path) else "it does not exist"
        return f"data.paths[{index}]={path!r}: {what}; point it at text / JSONL files, a directory or a glob"
    for index, entry in enumerate(config.data.blend):
        if not os.path.isdir(entry.path):
            return f"data.blend[{index}].path={entry.path!r}: no such directory; prepare it with colo data prepare"
    return None


def _data_files(config: RunConfig) -> str | None:
    if not config.data.paths or not task_spec(config.data.task).reads_data_files:  # e.g. diffusion's image folders
        return None
    if config.data.prepared_corpora():  # token shards: _prepared_corpora checks them
        return None
    from ..data.sources import data_files_problem

    try:
        problem = data_files_problem(config.data.paths, format=config.data.format)
    except (OSError, ValueError) as error:
        return f"data.paths: {error}"
    return None if problem is None else f"data.paths: {problem}"


def _prepared_corpora(config: RunConfig) -> str | None:
    if not config.data.prepared_corpora():
        return None
    from ..data import load_tokenizer
    from .data_setup import open_prepared

    try:
        open_prepared(config.data, load_tokenizer(config.data.tokenizer))
    except ValueError as error:
        return str(error)
    return None


def _init_from(config: RunConfig) -> str | None:
    path = config.model.init_from
    if path is None:
        return None
    field = f"model.init_from={path!r}"
    if not os.path.isdir(path):
        return f"{field}: not a directory; give a Hugging Face Llama directory or a checkpoint written by colo train"
    if os.path.isfile(os.path.join(path, "config.json")):
        from ..hf.llama_io import INDEX_FILE, WEIGHTS_FILE

        if not any(os.path.isfile(os.path.join(path, name)) for name in (WEIGHTS_FILE, INDEX_FILE)):
            return (
                f"{field} has config.json but no weights ({WEIGHTS_FILE} or {INDEX_FILE}); download the "
                "safetensors weights into it"
            )
        return None
    if not os.path.isfile(os.path.join(path, "index.json")):
        return (
            f"{field} holds no weights: neither a Hugging Face Llama (config.json + model.safetensors) nor a "
            "colo checkpoint (index.json)"
        )
    from ..runs import pretrained_llama_config

    try:
        pretrained_llama_config(path)
    except ValueError as error:
        return str(error)
    return None


def _tensor_parallel(config: RunConfig) -> str | None:
    plugin = config.plugin
    if plugin.name != "hybrid" or plugin.tp == 1 or not task_spec(config.data.task).trains_llama:
        return None
    from ..data import load_tokenizer
    from ..models.llama import check_tp_size
    from ..runs import pretrained_llama_config

    if config.model.init_from is not None:
        llama = pretrained_llama_config(config.model.init_from)
    else:
        vocab = load_tokenizer(config.data.tokenizer).vocab_size
        multiple = config.model.pad_vocab_to_multiple_of
        llama = config.model.llama_config(vocab_size=-(-vocab // multiple) * multiple)
    try:
        check_tp_size(llama, plugin.tp)
    except ValueError as error:
        text = str(error)
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
            text = text.replace(f"{name}=", f"model.{name}=")
        return f"plugin.tp={plugin.tp}: {text}"
    return None


def _resume(config: RunConfig) -> str | None:
    if not config.checkpoint.enabled or config.checkpoint.resume in ("auto", "none"):
        return None
    from .state import resolve_resume

    try:
        resolve_resume(config.checkpoint.resume, config.checkpoint_dir)
    except ValueError as error:
        return str(error)
    return None


def _trackers(config: RunConfig) -> str | None:
    from .trackers import missing_tracker

    return missing_tracker(config.logging.report_to)
