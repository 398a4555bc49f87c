"""A progress bar while a large model's weights load: on a terminal only, for models of 1 GiB or more
(a small one loads in seconds, and a log or a pipe gets no bar)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO, TypeVar

T = TypeVar("T")
BIG_MODEL_BYTES = 1 << 30


def model_bytes(path: Path) -> int:
    """A GGUF file's size, or a folder's weight files' total."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in path.glob(pattern))


class LoadProgress:
    """Counts tensors as the loader consumes them, across its packed and float passes."""

    def __init__(self, label: str, num_tensors: int | None, size_bytes: int, stream: TextIO | None = None,
                 enabled: bool | None = None, mininterval: float = 0.5) -> None:
        stream = stream or sys.stderr
        if enabled is None:
            enabled = size_bytes >= BIG_MODEL_BYTES and stream.isatty()
        self._bar = None
        if enabled:
            from tqdm import tqdm  # a dependency of transformers and huggingface_hub

            self._bar = tqdm(total=num_tensors, desc=f"loading {label}", unit=" tensors", file=stream,
                             leave=False, mininterval=mininterval)

    def track(self, items: Iterable[T]) -> Iterator[T]:
        for item in items:
            yield item
            if self._bar is not None:
                self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
