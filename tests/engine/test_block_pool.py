"""BlockPool: reference counts, the LRU free queue, and cached blocks that survive until evicted."""

import pytest

from kvflow.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block_tokens


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def test_free_queue_removes_from_the_middle_and_keeps_order():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4, 2]
    assert queue.popleft().block_id == 0
    assert len(queue) == 4
    for b in list(queue):
        queue.remove(b)
    with pytest.raises(IndexError):
        queue.popleft()


def test_alloc_and_free_track_reference_counts():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert (a.ref_cnt, b.ref_cnt) == (1, 1)
    assert pool.num_free_blocks == 2 and pool.usage == 0.5
    pool.touch([a])  # a second request shares block a
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2  # still held by the other request
    pool.free_blocks([a, b])
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    with pytest.raises(AssertionError):
        pool.free_blocks([a])  # double free
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)


def test_free_order_is_eviction_order():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for i, block in enumerate(blocks):
        assert pool.cache_full_block(block, hash_block_tokens(None, [i]), [i])
    # A request frees tail first: its last block must be reused before its first.
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 2]


def test_unhashed_freed_blocks_are_reused_before_untouched_and_cached_ones():
    pool = BlockPool(6)
    cached, partial, scratch = pool.get_new_blocks(3)
    assert pool.cache_full_block(cached, hash_block_tokens(None, [1]), [1])
    pool.free_blocks([scratch, partial, cached])
    # The two blocks holding nothing findable come back first (their memory is already written), then
    # the never-used blocks 3 to 5; the cached block is evicted last.
    assert free_ids(pool) == [partial.block_id, scratch.block_id, 3, 4, 5, cached.block_id]
    assert pool.get_new_blocks(2) == [partial, scratch]
    assert pool.get_cached_block(hash_block_tokens(None, [1])) is cached


def test_freed_cached_block_is_found_and_revived_until_evicted():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    assert pool.cache_full_block(block, h, [1, 2])
    pool.free_blocks([block])
    assert pool.get_cached_block(h) is block  # freed, but its KV is still there
    pool.touch([block])  # a hit revives it: it leaves the free queue
    assert block.ref_cnt == 1 and block.block_id not in free_ids(pool)
    pool.free_blocks([block])
    # LRU: the never-used blocks 1 and 2 go first, then block 0 loses its hash on reuse.
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 2]
    assert pool.get_cached_block(h) is block
    (reused,) = pool.get_new_blocks(1)
    assert reused is block and block.block_hash is None and block.token_ids is None
    assert pool.get_cached_block(h) is None and pool.was_evicted(h)


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [7, 7])
    assert pool.cache_full_block(a, h, [7, 7])
    assert not pool.cache_full_block(b, h, [7, 7])
    assert pool.get_cached_block(h) is a and b.block_hash is None
    pool.free_blocks([b, a])
    pool.get_new_blocks(1)  # evicts b, which was never registered: a stays findable
    assert pool.get_cached_block(h) is a


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_full_block(a, hash_block_tokens(None, [1]), [1])
    assert a.block_hash is None and not pool.cached


def test_chained_hash_depends_on_parent_tokens_and_extra_keys():
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert h1 == hash_block_tokens(None, (1, 2, 3))  # deterministic, container-independent
    assert h1 != hash_block_tokens(None, [1, 2, 4])
    assert hash_block_tokens(h1, [5]) != hash_block_tokens(hash_block_tokens(None, [1, 2, 4]), [5])
    assert h1 != hash_block_tokens(None, [1, 2, 3], extra_keys=("lora-a",))


def test_reset_prefix_cache_forgets_every_hash():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_full_block(a, h, [1])
    pool.free_blocks([a])
    pool.reset_prefix_cache()
    assert pool.get_cached_block(h) is None and a.block_hash is None and pool.num_free_blocks == 2
