"""Per-request block tables on top of the BlockPool, with automatic prefix caching.

Life of a request's blocks: `get_computed_blocks` finds the cached full blocks that prefix its tokens,
`allocate_slots` takes references on them and adds fresh blocks for the tokens to compute this step,
`cache_full_blocks` registers blocks once their tokens are computed, and `free` drops everything
(full blocks stay findable in the free queue until evicted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.engine.block_pool import BlockPool, KVBlock, hash_block_tokens
from kvflow.engine.request import Request

MISS_REASONS = ("no_shared_prefix", "prefix_shorter_than_block", "evicted")


@dataclass
class PrefixCacheStats:
    """Counters since the last reset. Every lookup leaves an uncached tail (at least its last token), and
    `misses` says why that tail was not a hit, so sum(misses.values()) == lookups:
    - no_shared_prefix: the first uncached block's hash was never cached (or was forgotten);
    - evicted: it was cached once, but its block has been reused since;
    - prefix_shorter_than_block: what is left to look up is shorter than a block, so nothing more could hit.
    """

    lookups: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def reset(self) -> None:
        self.lookups = self.queried_tokens = self.hit_tokens = 0
        self.misses = dict.fromkeys(MISS_REASONS, 0)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # how many leading blocks of each request are hashed
        self.stats = PrefixCacheStats()

    # ---- sizes and counters -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def lookups(self) -> int:
        return self.stats.lookups

    @property
    def hit_tokens(self) -> int:
        return self.stats.hit_tokens

    @property
    def queried_tokens(self) -> int:
        return self.stats.queried_tokens

    @property
    def misses(self) -> dict[str, int]:
        return self.stats.misses

    def reset_stats(self) -> None:
        self.stats.reset()

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------------------
    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_hashes to cover the full blocks among its first num_tokens tokens."""
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached full blocks that prefix the request's tokens: (block ids, tokens).
        Capped at num_tokens - 1 tokens so at least one token is computed and yields logits. Takes no
        references (allocate_slots does). Counts one lookup; with caching off, returns ([], 0) uncounted."""
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block.block_id)
        num_hit_tokens = len(hits) * self.block_size
        self.stats.lookups += 1
        self.stats.queried_tokens += request.num_tokens
        self.stats.hit_tokens += num_hit_tokens
        self.stats.misses[self._miss_reason(request, len(hits), max_blocks)] += 1
        return hits, num_hit_tokens

    def _miss_reason(self, request: Request, num_hits: int, max_blocks: int) -> str:
        if num_hits == max_blocks:
            return "prefix_shorter_than_block"
        if self.pool.was_evicted(request.block_hashes[num_hits]):
            return "evicted"
        return "no_shared_prefix"

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full of computed tokens since the last call."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request, num_full * self.block_size)
        bs = self.block_size
        for i in range(start, num_full):
            tokens = request.all_token_ids[i * bs : (i + 1) * bs]
            self.pool.cache_full_block(blocks[i], request.block_hashes[i], tokens)
        self._num_cached_blocks[request.request_id] = num_full

    # ---- allocation ---------------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_block_ids: list[int] | None = None
    ) -> bool:
        """Make room for num_new_tokens more tokens after the request's computed ones. For a request
        being scheduled for the first time (or again after preemption), computed_block_ids are its
        prefix-cache hits from get_computed_blocks: they come before the new tokens and get a reference.
        Returns False and changes nothing if the pool cannot supply the blocks."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        hits = [self.pool.blocks[i] for i in computed_block_ids or []]
        if hits and blocks:
            raise ValueError(f"request {rid!r} already holds blocks; prefix hits apply only to a new one")
        num_total = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(num_total) - len(blocks) - len(hits))
        # Hits sitting in the free queue stop being free once touched.
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks:
            return False
        self.pool.touch(hits)
        blocks = self.req_blocks.setdefault(rid, [])
        blocks.extend(hits)
        blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        if hits:
            self._num_cached_blocks[rid] = len(hits)
        return True

    def free(self, request: Request) -> None:
        """Release all the request's blocks, tail first so its tail is evicted before its prefix."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]] | None:
        """Give child the parent's KV: full blocks are shared (one more reference each); a partly filled
        last block is copied into a fresh block, since both will write after it. Returns the (src, dst)
        copies to perform before the next forward, or None (changing nothing) if no block is free."""
        if child.request_id in self.req_blocks:
            raise ValueError(f"request {child.request_id!r} already holds blocks")
        parent_blocks = self.req_blocks.get(parent.request_id, [])
        num_computed = parent.num_computed_tokens
        num_full = num_computed // self.block_size
        has_partial = num_computed % self.block_size != 0
        if has_partial and self.pool.num_free_blocks < 1:
            return None
        shared = parent_blocks[:num_full]
        self.pool.touch(shared)
        blocks = list(shared)
        copies = []
        if has_partial:
            (fresh,) = self.pool.get_new_blocks(1)
            copies.append((parent_blocks[num_full].block_id, fresh.block_id))
            blocks.append(fresh)
        self.req_blocks[child.request_id] = blocks
        self._num_cached_blocks[child.request_id] = min(
            self._num_cached_blocks.get(parent.request_id, 0), num_full
        )
        return copies
