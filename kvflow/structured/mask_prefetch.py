"""Token masks computed while the forward pass runs. A constrained sequence's mask for this step depends
only on the tokens it already has, so it can be computed on a worker thread between scheduling and
sampling: the forward is one C++ call that releases the GIL, and llguidance computes masks in Rust.

Only where the CPU has a core the forward leaves idle: on a machine whose every core runs the forward's
threads, the worker would take turns with them (and their barriers wait for the slowest), so there the
masks are computed after the forward, in the sampler."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvflow.structured.masks import mask_words


def has_idle_core() -> bool:
    return (os.cpu_count() or 1) > torch.get_num_threads()


class MaskPrefetcher:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvflow-masks")

    def start(self, matchers: dict[str, object], vocab_size: int) -> Future:
        """A future of {request id: its mask words} for matchers by request id."""
        ids, found = list(matchers), list(matchers.values())
        return self._pool.submit(lambda: dict(zip(ids, mask_words(found, vocab_size))))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
