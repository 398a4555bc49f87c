"""Tokenizers built from GGUF metadata, kept on disk so that later loads of the same file skip the build.

Building the `tokenizers` pipeline from a GGUF file's vocabulary (kvflow/loader/gguf_tokenizer.py) takes
about a second for a 128K-262K vocabulary (reading the token arrays, building the BPE model, transformers'
copy of it), every time a model starts. The result depends only on the file and the builder, so the first
load saves it as tokenizer.json (the `tokenizers` library's own format) with the few settings around it,
and later loads read that (about 0.3 s for 262K tokens).

The key names the file (resolved path, size, modification time), the builder's source and the versions of
`tokenizers` and `transformers`: a rebuilt file, a new kvflow or a new library misses and rebuilds. An
entry that cannot be read is deleted with a warning and rebuilt. At most MAX_ENTRIES tokenizers are kept,
least recently used first out. $KVFLOW_TOKENIZER_CACHE: "off", or a folder (default: kvflow's cache folder's
tokenizers/).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers
import transformers
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

MAX_ENTRIES = 16


def cache_folder() -> Path | None:
    """Where built tokenizers go, or None when the cache is off."""
    setting = os.environ.get("KVFLOW_TOKENIZER_CACHE", "auto")
    if setting == "off":
        return None
    if setting == "auto":
        from kvflow.kernels.build import cache_root

        return cache_root() / "tokenizers"
    return Path(setting)


def entry_key(path: Path) -> str:
    """The file (path, size, modification time), the builder's source and the libraries' versions."""
    stat = path.stat()
    builder = Path(__file__).with_name("gguf_tokenizer.py").read_bytes()
    digest = hashlib.sha256()
    for part in (str(path.resolve()), str(stat.st_size), str(stat.st_mtime_ns), tokenizers.__version__,
                 transformers.__version__):
        digest.update(part.encode() + b"\0")
    digest.update(builder)
    return digest.hexdigest()[:32]


def cached_tokenizer(path: Path, build: Callable[[], tuple[Tokenizer, dict[str, Any]]]) -> PreTrainedTokenizerFast:
    """The tokenizer of the GGUF file at `path`: read from the cache, or built by `build` (the backend
    tokenizer and PreTrainedTokenizerFast's keyword arguments, JSON values) and saved there."""
    folder = cache_folder()
    if folder is None:
        backend, kwargs = build()
        return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    key = entry_key(path)
    backend_file, settings_file = folder / f"{key}.tokenizer.json", folder / f"{key}.settings.json"
    if settings_file.exists() and backend_file.exists():
        try:
            kwargs = json.loads(settings_file.read_text())
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(backend_file), **kwargs)
            os.utime(settings_file)  # recently used
            return tokenizer
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is rebuilt, whatever broke it
            logger.warning("cached tokenizer %s cannot be read (%s): building it again", backend_file, exc)
            for stale in (backend_file, settings_file):
                stale.unlink(missing_ok=True)
    backend, kwargs = build()
    try:
        _save(folder, backend_file, settings_file, backend, kwargs)
    except OSError as exc:
        logger.warning("cannot keep the built tokenizer in %s: %s", folder, exc)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)


def _save(folder: Path, backend_file: Path, settings_file: Path, backend: Tokenizer, kwargs: dict) -> None:
    """Both files under temporary names, then renamed, settings last: an entry with settings is whole."""
    folder.mkdir(parents=True, exist_ok=True)
    suffix = f".tmp{os.getpid()}"
    backend.save(str(backend_file) + suffix)
    os.replace(str(backend_file) + suffix, backend_file)
    Path(str(settings_file) + suffix).write_text(json.dumps(kwargs))
    os.replace(str(settings_file) + suffix, settings_file)
    entries = sorted(folder.glob("*.settings.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[MAX_ENTRIES:]:
        old.unlink(missing_ok=True)
        old.with_name(old.name.replace(".settings.json", ".tokenizer.json")).unlink(missing_ok=True)
