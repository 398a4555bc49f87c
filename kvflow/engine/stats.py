"""What an engine says about itself: a snapshot of its state after every step (EngineStats: requests,
KV blocks, prefix-cache hits; /metrics and /health read it). The record of each step (StepHistory) is the
step loop's own (engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.engine.prefix_store import StoreStats


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
