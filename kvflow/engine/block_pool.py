"""The paged KV cache's blocks: reference counts, an LRU free queue, and the prefix-cache map.

A block with ref_cnt 0 sits in the free queue. If it was full and hashed, it keeps its hash and can
still be found by a prefix-cache lookup (and revived) until it is popped for reuse; only then is it
evicted and its hash forgotten. Freeing a hashed block appends it to the queue's tail and allocation
pops the head, so the least recently freed cached blocks are evicted first. A block freed without a hash
holds nothing to find again: it goes to the head and is reused first, ahead of blocks never written.
A block marked kept (a prompt block of a request that named a prefix-cache key: OpenAI's prompt_cache_key,
Anthropic's cache_control) waits in a second queue, taken only once the first is empty: under pressure,
unmarked cached blocks are evicted first, least recently freed first within each class. On
CPU the cache starts as untouched memory, and first writes to a page fault it in: reusing written
blocks first keeps those faults out of requests' prefill (figures: benchmarks/RESULTS.md, "Figures
behind the code").
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = int


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    """Chained hash of one full block: it names the block's tokens and, through the parent, every token
    before them. sha256 over a canonical repr, so it is the same in every process (Python's hash() of None
    is not)."""
    key = repr((parent_hash, tuple(int(t) for t in token_ids), tuple(extra_keys))).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:16], "little")


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free", "kept")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set only while full and registered in the cache
        self.token_ids: tuple[int, ...] | None = None  # the tokens its hash names (kept for checks)
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None
        self.kept = False  # evicted after unmarked blocks (set while held, cleared on eviction)

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves: O(1) push at either end,
    pop at the head, and removal from the middle (when a cached free block is revived by a hit)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels, so no edge cases at either end
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None and block.prev_free is None and block.next_free is None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next_free
        assert first is not None and block.prev_free is None and block.next_free is None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self._len += 1

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool = True, max_evicted_hashes: int = 1 << 16
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.kept_queue = FreeBlockQueue(())  # free cached blocks marked kept: taken after free_queue's
        self.cached: dict[BlockHash, KVBlock] = {}  # one block per hash; duplicates stay unregistered
        # Hashes whose block was evicted, so a miss can be blamed on eviction. Bounded: oldest forgotten.
        self.evicted_hashes: OrderedDict[BlockHash, None] = OrderedDict()
        self._max_evicted_hashes = max_evicted_hashes

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + len(self.kept_queue)

    def queue_of(self, block: KVBlock) -> FreeBlockQueue:
        """The free queue a block with ref_cnt 0 sits in."""
        return self.kept_queue if block.kept else self.free_queue

    def keep(self, blocks: Iterable[KVBlock]) -> None:
        """Mark held, cached blocks kept: once freed they are evicted after every unmarked one."""
        for block in blocks:
            if block.block_hash is not None:
                assert block.ref_cnt > 0, f"{block} is not held"
                block.kept = True

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (freed-but-cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def was_evicted(self, block_hash: BlockHash) -> bool:
        return block_hash in self.evicted_hashes

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits; a free one leaves the free queue (it is revived)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.queue_of(block).remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks but only {self.num_free_blocks} are free")
        new = []
        for _ in range(n):
            block = (self.free_queue if len(self.free_queue) else self.kept_queue).popleft()
            self._evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            new.append(block)
        return new

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given order; callers pass a request's blocks tail
        first, so its tail (least likely to be shared) is evicted before its prefix."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.queue_of(block).append(block)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Register a full, computed block under its hash. Returns False (and leaves the map alone) when
        caching is off, the block is already registered, or another block already holds this hash; the
        duplicate then serves its request as an ordinary private block."""
        if not self.enable_caching:
            return False
        if block.block_hash is not None:  # shared by a fork, already registered by its sibling
            assert block.block_hash == block_hash, "a block's tokens changed after it was hashed"
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block
        self.evicted_hashes.pop(block_hash, None)
        return True

    def _evict(self, block: KVBlock) -> None:
        block.kept = False
        if block.block_hash is None:
            return
        del self.cached[block.block_hash]
        self.evicted_hashes[block.block_hash] = None
        if len(self.evicted_hashes) > self._max_evicted_hashes:
            self.evicted_hashes.popitem(last=False)
        block.block_hash = None
        block.token_ids = None

    def reset_prefix_cache(self) -> None:
        """Forget every hash (blocks in use keep serving their requests, just no longer shareable)."""
        while len(self.kept_queue):  # nothing left to keep: reused first, as any block without a hash
            self.free_queue.appendleft(self.kept_queue.popleft())
        for block in self.cached.values():
            block.block_hash = None
            block.token_ids = None
            block.kept = False
        self.cached.clear()
        self.evicted_hashes.clear()
