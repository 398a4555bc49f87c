"""Per-request block tables on top of the BlockPool, with automatic prefix caching.

Life of a request's blocks: `get_computed_blocks` finds the cached full blocks that prefix its tokens,
`allocate_slots` takes references on them and adds fresh blocks for the tokens to compute this step,
`cache_full_blocks` registers blocks once their tokens are computed, and `free` drops everything
(full blocks stay findable in the free queue until evicted).

With a sliding window (the cache of sliding-window layers), a request keeps only the blocks its next
tokens can see: each allocation frees the blocks wholly behind the window (hashed, so they stay findable
as prefix-cache hits until evicted) and puts the null block in their place in the block table. The null
block is never handed out; attention reads it only at positions its mask excludes. A prefix hit then
needs only the blocks inside the window before the hit's end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.engine.block_pool import BlockPool, KVBlock, hash_block_tokens
from kvflow.engine.prefix_tier import DiskTier
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
    hit_tokens: int = 0  # both tiers'
    disk_hit_tokens: int = 0  # of those, read back from the disk tier
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def reset(self) -> None:
        self.lookups = self.queried_tokens = self.hit_tokens = self.disk_hit_tokens = 0
        self.misses = dict.fromkeys(MISS_REASONS, 0)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if window and num_blocks < 2:
            raise ValueError("a sliding-window cache needs at least 2 blocks (one is the null block)")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # 0: every position stays visible
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.null_block = self.pool.get_new_blocks(1)[0] if window else None  # held forever
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # how many leading blocks of each request are hashed
        self._num_dropped: dict[str, int] = {}  # leading table entries already replaced by the null block
        self.stats = PrefixCacheStats()
        self.tier: DiskTier | None = None  # the prefix cache's disk tier (engine/prefix_tier.py), if any

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

    def first_visible_block(self, position: int) -> int:
        """The first block a token at `position` attends to (0 without a window)."""
        return max(0, position - self.window + 1) // self.block_size if self.window else 0


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
        max_blocks = self.max_hit_blocks(request)
        num_hits = self.longest_hit(request, max_blocks)
        if num_hits < max_blocks and self.tier is not None and self._load_from_tier(request, num_hits, max_blocks):
            num_hits = self.longest_hit(request, max_blocks)
        self.record_lookup(request, num_hits, max_blocks)
        return self.hit_block_ids(request, num_hits), num_hits * self.block_size

    def _load_from_tier(self, request: Request, start: int, limit: int) -> int:
        """Bring the blocks after the request's first `start` (cached) ones back from the disk tier, as
        many as follow in a row there (fewer when the pool is short). They enter the prefix cache as free
        cached blocks, so the lookup then finds them like any other hit. Returns how many came back."""
        hashes, tier = request.block_hashes, self.tier
        n = 0
        while start + n < limit and self.pool.get_cached_block(hashes[start + n]) is None \
                and hashes[start + n] in tier:
            n += 1
        held = [self.pool.get_cached_block(h) for h in hashes[:start]]
        spare = self.pool.num_free_blocks - sum(1 for b in held if b.ref_cnt == 0)
        if self.blocks_needed(request.num_tokens) - start > spare:  # busy pool: leave a block to compute in
            n = min(n, spare - 1)
        if n <= 0:
            return 0
        self.pool.touch(held)  # so that taking blocks for the load cannot evict the hits before it
        fresh = self.pool.get_new_blocks(n)
        bs, tokens = self.block_size, request.all_token_ids
        spans = [tokens[i * bs:(i + 1) * bs] for i in range(start, start + n)]
        loaded = tier.load(hashes[start:start + n], [b.block_id for b in fresh], spans)
        for i in range(loaded):
            self.pool.cache_full_block(fresh[i], hashes[start + i], spans[i])
        self.pool.free_blocks(reversed(fresh))
        self.pool.free_blocks(reversed(held))
        self.stats.disk_hit_tokens += loaded * bs
        request.num_disk_hit_tokens += loaded * bs
        return loaded

    def keep_for_waiting(self, request: Request) -> int:
        """A request starts waiting: the cached blocks its prompt would hit move to the far end of the free
        queue, so the blocks that running requests take meanwhile are others (least recently used first).
        Returns the tokens it would hit now (in memory, or on the disk tier without reading it)."""
        if not self.enable_prefix_caching or request.prompt_logits_from is not None:
            return 0
        max_blocks = self.max_hit_blocks(request)
        num_hits = self.longest_hit(request, max_blocks)
        for block_id in reversed(self.hit_block_ids(request, num_hits)):  # its first block ends up last out
            block = self.pool.blocks[block_id]
            if block is not self.null_block and block.ref_cnt == 0:
                queue = self.pool.queue_of(block)
                queue.remove(block)
                queue.append(block)
        if self.tier is not None and not self.window:
            hashes = request.block_hashes
            while num_hits < max_blocks and hashes[num_hits] in self.tier:
                num_hits += 1
        return num_hits * self.block_size

    def max_hit_blocks(self, request: Request) -> int:
        self._update_block_hashes(request, request.num_tokens)
        return (request.num_tokens - 1) // self.block_size

    def longest_hit(self, request: Request, limit: int) -> int:
        """The most leading blocks, up to `limit`, whose tokens the cache can serve: every one of them, or
        with a window those the next token sees (blocks [first_visible_block(n * block_size), n))."""
        cached = [self.pool.get_cached_block(h) is not None for h in request.block_hashes[:limit]]
        if not self.window:
            return cached.index(False) if False in cached else len(cached)
        counts = [0]  # counts[i]: how many of the first i blocks are cached
        for hit in cached:
            counts.append(counts[-1] + hit)
        for n in range(len(cached), 0, -1):
            first = self.first_visible_block(n * self.block_size)
            if counts[n] - counts[first] == n - first:
                return n
        return 0

    def hit_block_ids(self, request: Request, num_hits: int) -> list[int]:
        """The block table of a hit of num_hits blocks (longest_hit): the null block where nothing is seen."""
        first = self.first_visible_block(num_hits * self.block_size)
        seen = [self.pool.get_cached_block(h).block_id for h in request.block_hashes[first:num_hits]]
        return [self.null_block.block_id] * first + seen if first else seen

    def record_lookup(self, request: Request, num_hits: int, max_blocks: int) -> None:
        self.stats.lookups += 1
        self.stats.queried_tokens += request.num_tokens
        self.stats.hit_tokens += num_hits * self.block_size
        self.stats.misses[self._miss_reason(request, num_hits, max_blocks)] += 1

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
        bs, hashes = self.block_size, request.block_hashes
        new = []
        for i in range(start, num_full):
            if blocks[i] is self.null_block:
                continue
            tokens = request.all_token_ids[i * bs : (i + 1) * bs]
            if self.pool.cache_full_block(blocks[i], hashes[i], tokens):
                new.append((blocks[i].block_id, hashes[i], hashes[i - 1] if i else None, tokens))
        if request.sampling_params.cache_key is not None:  # its prompt's blocks outlast unmarked ones
            self.pool.keep(b for b in blocks[start:min(num_full, request.num_prompt_tokens // bs)]
                           if b is not self.null_block)
        self._num_cached_blocks[request.request_id] = num_full
        if new and self.tier is not None:  # their K/V is computed: a copy goes to the disk tier
            self.tier.save(new)

    # ---- allocation ---------------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_block_ids: list[int] | None = None
    ) -> bool:
        """Make room for num_new_tokens more tokens after the request's computed ones. For a request
        being scheduled for the first time (or again after preemption), computed_block_ids are its
        prefix-cache hits from get_computed_blocks: they come before the new tokens and get a reference.
        Returns False if the pool cannot supply the blocks, having changed nothing (but for freeing blocks
        behind the window, which the request never reads again)."""
        rid = request.request_id
        self._drop_behind_window(rid, request.num_computed_tokens)
        hits, real_hits, num_new_blocks = self._needs(request, num_new_tokens, computed_block_ids)
        # Hits sitting in the free queue stop being free once touched.
        num_free_hits = sum(1 for b in real_hits if b.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks:
            return False
        self.pool.touch(real_hits)
        if request.sampling_params.cache_key is not None:  # hits another request cached: kept from now on
            self.pool.keep(real_hits)
        if self.window and hits:  # a hit's leading null entries count as dropped
            self._num_dropped[rid] = len(hits) - len(real_hits)
        blocks = self.req_blocks.setdefault(rid, [])
        blocks.extend(hits)
        blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        if hits:
            self._num_cached_blocks[rid] = len(hits)
        return True

    def can_allocate(self, request: Request, num_new_tokens: int, computed_block_ids: list[int] | None = None) -> bool:
        """Whether allocate_slots would succeed now (counting the blocks it would drop behind the window)."""
        _, real_hits, num_new_blocks = self._needs(request, num_new_tokens, computed_block_ids)
        done, first = self._behind_window(request.request_id, request.num_computed_tokens)
        blocks = self.req_blocks.get(request.request_id, [])
        droppable = sum(1 for b in blocks[done:first] if b is not self.null_block and b.ref_cnt == 1)
        num_free_hits = sum(1 for b in real_hits if b.ref_cnt == 0)
        return num_new_blocks + num_free_hits <= self.pool.num_free_blocks + droppable

    def _needs(self, request: Request, num_new_tokens: int, computed_block_ids: list[int] | None):
        """(hits, hits other than the null block, fresh blocks needed) for an allocation."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        hits = [self.pool.blocks[i] for i in computed_block_ids or []]
        if hits and blocks:
            raise ValueError(f"request {rid!r} already holds blocks; prefix hits apply only to a new one")
        num_total = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(num_total) - len(blocks) - len(hits))
        return hits, [b for b in hits if b is not self.null_block], num_new_blocks

    def capacity_tokens(self, chunk: int) -> int:
        """The longest request (computed tokens) this cache can hold alone, computing up to `chunk` a step:
        its whole pool's tokens, or with a window any length, if the window and a chunk fit."""
        usable = self.num_blocks - (1 if self.window else 0)
        # With a window a request never holds more than the window's blocks and a chunk's.
        if self.window and self.blocks_needed(self.window + chunk) + 1 <= usable:
            return 1 << 62
        return usable * self.block_size

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        return [self.get_block_ids(request_id)]

    def _behind_window(self, rid: str, position: int) -> tuple[int, int]:
        """The request's table entries [done, first) that no token from `position` on sees and that still
        hold blocks (empty without a window)."""
        blocks = self.req_blocks.get(rid)
        if not self.window or not blocks:
            return 0, 0
        return self._num_dropped.get(rid, 0), min(self.first_visible_block(position), len(blocks))

    def _drop_behind_window(self, rid: str, position: int) -> None:
        """Free the blocks no token from `position` on can see; the null block takes their place."""
        done, first = self._behind_window(rid, position)
        if first <= done:
            return
        blocks = self.req_blocks[rid]
        self.pool.free_blocks(b for b in blocks[done:first] if b is not self.null_block)
        blocks[done:first] = [self.null_block] * (first - done)
        self._num_dropped[rid] = first

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens tokens' (speculative decoding: blocks that held
        only rejected draft tokens). They were never registered in the prefix cache."""
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        keep = self.blocks_needed(num_tokens)
        if len(blocks) <= keep:
            return
        extra = blocks[keep:]
        del blocks[keep:]
        self._num_cached_blocks[request.request_id] = min(self._num_cached_blocks.get(request.request_id, 0), keep)
        self.pool.free_blocks(b for b in reversed(extra) if b is not self.null_block)

    def free(self, request: Request) -> None:
        """Release all the request's blocks, tail first so its tail is evicted before its prefix."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_dropped.pop(request.request_id, None)
        self.pool.free_blocks(b for b in reversed(blocks) if b is not self.null_block)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds (the null block's table entries aside)."""
        return sum(1 for b in self.req_blocks.get(request_id, []) if b is not self.null_block)

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
        self.pool.touch(b for b in shared if b is not self.null_block)
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
        if self.window:
            self._num_dropped[child.request_id] = min(self._num_dropped.get(parent.request_id, 0), num_full)
        return copies
