"""What an engine says about itself: a snapshot of its state after every step (EngineStats: requests,
KV blocks, prefix-cache hits; /metrics and /health read it), and its last steps, summarised (StepHistory):
how many prompt (prefill) and decode tokens each one ran, how long it took and how full the KV cache was.
The server's page draws the steps (a long prompt's chunks between other users' decode steps); --trace
writes the same records to a file.

The engine thread appends one record a step; any other thread reads the records after a step number. A
bounded deque under a lock: a step pays one append, a reader a copy of what it asks for.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass

from kvflow.engine.prefix_store import StoreStats


@dataclass(frozen=True)
class StepRecord:
    step: int  # the engine's step number, from 1
    t: float  # wall clock (time.time()) at the step's end
    seconds: float  # the step's duration
    prefill_tokens: int  # tokens of prompt chunks (and of outputs recomputed after a preemption)
    decode_tokens: int  # tokens of sequences decoding: one each, plus the drafts a speculative step verifies
    batch_size: int  # sequences in the step
    kv_usage: float  # fraction of KV blocks held by requests after the step
    # The time this step was planned to stay within, with sequences decoding beside prompt chunks
    # (engine/step_budget.py); 0 where no such bound applied.
    limit_seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


class StepHistory:
    def __init__(self, capacity: int = 1024) -> None:
        self._records: deque[StepRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def add(self, record: StepRecord) -> None:
        with self._lock:
            self._records.append(record)

    def since(self, step: int, limit: int | None = None) -> list[StepRecord]:
        """The records after step number `step`, oldest first (at most the last `limit` of them)."""
        with self._lock:
            records = list(self._records)
        newer = [r for r in records if r.step > step]
        return newer[-limit:] if limit else newer


@dataclass(frozen=True)
class EngineStats:
    """A snapshot taken by the engine thread after every step and every batch of commands."""

    num_running: int = 0
    num_waiting: int = 0  # in the scheduler, plus adds not yet applied
    num_blocks: int = 0
    num_free_blocks: int = 0  # cached-but-unreferenced blocks count as free
    kv_cache_usage: float = 0.0  # fraction of blocks held by requests
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_disk_hit_tokens: int = 0  # of the hits, tokens read back from the disk tier
    disk_store: StoreStats | None = None  # the disk tier's counters (None: no disk tier)
    disk_store_blocks: int = 0
    disk_store_bytes: int = 0
    num_preemptions: int = 0
    num_steps: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    @property
    def num_blocks_used(self) -> int:
        return self.num_blocks - self.num_free_blocks
