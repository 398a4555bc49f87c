"""The KV cache of a model whose layers see different spans (Gemma: sliding-window layers between global
ones): one KVCacheManager per group of layers that share a window, each over its own pool of blocks (its
layers' cache tensors), driven as one.

A request holds blocks in every group. An allocation succeeds in every group or changes none. A prefix hit
is the longest prefix every group can serve: the global group needs all of its blocks, a sliding group only
those inside its window before the hit's end (it dropped the rest as the request went). Group 0 is the
primary one (the global layers', where a request's length costs blocks); what is not about several groups
(counters, statistics, the primary pool) reads it.
"""

from __future__ import annotations

from kvflow.engine.kv_cache_manager import KVCacheManager
from kvflow.engine.request import Request


class KVCacheGroups:
    def __init__(self, groups: list[KVCacheManager]) -> None:
        if not groups:
            raise ValueError("a KV cache needs at least one group")
        self.groups = groups
        self.primary = groups[0]

    def __getattr__(self, name: str):  # counters, stats, pool, block_size...: the primary group's
        return getattr(self.primary, name)

    def capacity_tokens(self, chunk: int) -> int:
        """The longest request (computed tokens) every group can hold, computing up to `chunk` a step."""
        return min(g.capacity_tokens(chunk) for g in self.groups)

    # ---- prefix cache -------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[list[int]], int]:
        """Per group, the block table of the longest prefix all groups can serve; and its token count."""
        primary = self.primary
        if not primary.enable_prefix_caching:
            return [[] for _ in self.groups], 0
        max_blocks = primary.max_hit_blocks(request)
        num_hits = max_blocks
        while True:  # each group may shorten the hit; a sliding group's answer can change as it shrinks
            shorter = min(g.longest_hit(request, num_hits) for g in self.groups)
            if shorter == num_hits:
                break
            num_hits = shorter
        primary.record_lookup(request, num_hits, max_blocks)
        return [g.hit_block_ids(request, num_hits) for g in self.groups], num_hits * primary.block_size

    def keep_for_waiting(self, request: Request) -> int:
        return min(g.keep_for_waiting(request) for g in self.groups)

    def reset_prefix_cache(self) -> None:
        for g in self.groups:
            g.reset_prefix_cache()

    def trim(self, request: Request, num_tokens: int) -> None:
        for g in self.groups:
            g.trim(request, num_tokens)

    def cache_full_blocks(self, request: Request) -> None:
        for g in self.groups:
            g.cache_full_blocks(request)

    # ---- allocation ---------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_block_ids: list[list[int]] | None = None) -> bool:
        hits = computed_block_ids or [None] * len(self.groups)
        if not all(g.can_allocate(request, num_new_tokens, h) for g, h in zip(self.groups, hits)):
            return False
        for g, h in zip(self.groups, hits):
            assert g.allocate_slots(request, num_new_tokens, h)
        return True

    def free(self, request: Request) -> None:
        for g in self.groups:
            g.free(request)

    def fork(self, parent: Request, child: Request) -> None:
        """Not across groups: the runner's block copies name no group. The child recomputes instead, its
        prefix mostly from the cache."""
        return None

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.primary.get_block_ids(request_id)

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        return [g.get_block_ids(request_id) for g in self.groups]
