"""Token masks computed while the forward pass runs. A constrained sequence's mask for this step depends
only on the tokens it already has, so it can be computed on a worker thread between scheduling and
sampling: the forward is one C++ call that releases the GIL, and llguidance computes masks in Rust.

Only where the CPU has a core the forward leaves idle: on a machine whose every core runs the forward's
threads, the worker would take turns with them (and their barriers wait for the slowest), so there the
masks are computed after the forward, in the sampler."""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvflow.structured.masks import mask_words


def has_idle_core() -> bool:
    return (os.cpu_count() or 1) > torch.get_num_threads()


class MaskPrefetcher:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvflow-masks")

    def start(self, matchers: Sequence, vocab_size: int) -> Future:
        """A future of mask_words(matchers, vocab_size)."""
        return self._pool.submit(mask_words, list(matchers), vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def rows_of(future: Future | None, ids: Sequence[str]) -> dict[str, np.ndarray]:
    """The prefetched mask words by request id (empty when nothing was prefetched)."""
    if future is None:
        return {}
    return dict(zip(ids, future.result()))
