"""KVCacheManager: prefix-cache lookups and their counters, slot allocation, freeing, forking."""

from kvflow.engine.block_pool import hash_block_tokens
from kvflow.engine.kv_cache_manager import KVCacheManager
from kvflow.engine.request import Request
from kvflow.sampling_params import SamplingParams

BS = 16


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def compute(kv: KVCacheManager, req: Request, num_new: int, hits: list[int] | None = None) -> None:
    """What the scheduler and runner do for one chunk: allocate, advance, register full blocks."""
    assert kv.allocate_slots(req, num_new, hits)
    req.num_computed_tokens += num_new + len(hits or []) * kv.block_size
    kv.cache_full_blocks(req)


def test_shared_prefix_hits_and_counters_are_exact():
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    prefix = list(range(1000, 1000 + 10 * BS))  # 10 full blocks
    first = make_request("a", prefix + [1, 2, 3, 4, 5])
    hits, n = kv.get_computed_blocks(first)
    assert (hits, n) == ([], 0)
    compute(kv, first, first.num_tokens)
    # The second request shares the 10 blocks, then differs for 20 more tokens (1 full block + 4).
    second = make_request("b", prefix + list(range(20)))
    hits, n = kv.get_computed_blocks(second)
    assert n == 160 and hits == kv.get_block_ids("a")[:10]
    compute(kv, second, second.num_tokens - n, hits)
    assert kv.get_block_ids("b")[:10] == kv.get_block_ids("a")[:10]
    assert all(kv.pool.blocks[i].ref_cnt == 2 for i in hits)
    assert kv.lookups == 2
    assert kv.queried_tokens == first.num_tokens + second.num_tokens
    assert kv.hit_tokens == 160
    # first: block 0 never cached; second: block 10 (tokens 0..15) never cached.
    assert kv.misses == {"no_shared_prefix": 2, "prefix_shorter_than_block": 0, "evicted": 0}
    # A third request with only 5 tokens after the shared prefix: nothing more could hit.
    third = make_request("c", prefix + [9, 9, 9, 9, 9])
    assert kv.get_computed_blocks(third)[1] == 160
    assert kv.misses["prefix_shorter_than_block"] == 1
    kv.reset_stats()
    assert (kv.lookups, kv.hit_tokens, kv.queried_tokens, sum(kv.misses.values())) == (0, 0, 0, 0)


def test_whole_prompt_cached_still_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(2 * BS))
    compute(kv, make_request("a", tokens), 2 * BS)
    again = make_request("b", tokens)
    hits, n = kv.get_computed_blocks(again)
    assert n == BS and len(hits) == 1  # 31 tokens at most, so only the first block
    assert kv.misses["prefix_shorter_than_block"] == 1
    # The last block must be recomputed into a fresh block, not written into the cached one.
    compute(kv, again, 2 * BS - n, hits)
    assert kv.get_block_ids("b")[0] == kv.get_block_ids("a")[0]
    assert kv.get_block_ids("b")[1] != kv.get_block_ids("a")[1]


def test_evicted_prefix_is_counted_as_evicted():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    tokens = list(range(2 * BS))
    a = make_request("a", tokens)
    compute(kv, a, 2 * BS)
    kv.free(a)
    compute(kv, make_request("x", list(range(500, 500 + 2 * BS))), 2 * BS)  # reuses both blocks
    hits, n = kv.get_computed_blocks(make_request("b", tokens + [1]))
    assert (hits, n) == ([], 0)
    assert kv.misses["evicted"] == 1


def test_freed_blocks_remain_hits_until_reused():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(3 * BS)))
    compute(kv, a, 3 * BS)
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.usage == 0.0
    b = make_request("b", list(range(3 * BS)) + [7])
    hits, n = kv.get_computed_blocks(b)
    assert n == 3 * BS
    compute(kv, b, 1, hits)
    assert kv.num_free_blocks == 0 and kv.usage == 1.0  # 3 revived + 1 new


def test_allocate_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(2 * BS)))
    compute(kv, a, 2 * BS)
    kv.free(a)
    # b hits both freed blocks (reviving them uses 2 of the 3 free) and needs 2 more: impossible.
    b = make_request("b", list(range(2 * BS)) + list(range(900, 900 + 2 * BS)))
    hits, _ = kv.get_computed_blocks(b)
    assert len(hits) == 2
    assert not kv.allocate_slots(b, 2 * BS, hits)
    assert kv.num_free_blocks == 3 and kv.get_block_ids("b") == []
    assert all(kv.pool.blocks[i].ref_cnt == 0 for i in hits)


def test_cached_blocks_hold_the_tokens_their_hash_names():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("a", list(range(10)))
    compute(kv, req, 6)  # only block 0 is full so far
    assert len(kv.pool.cached) == 1
    compute(kv, req, 4)
    req.append_output_token_ids([42, 43])
    compute(kv, req, 2)  # 12 computed: blocks 0..2 full
    parent = None
    for i, block_id in enumerate(kv.get_block_ids("a")):
        block = kv.pool.blocks[block_id]
        expected = tuple(req.all_token_ids[4 * i : 4 * i + 4])
        parent = hash_block_tokens(parent, expected)
        assert block.block_hash == parent and block.token_ids == expected
        assert req.block_hashes[i] == parent


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    tokens = list(range(12))
    compute(kv, make_request("a", tokens), 12)
    assert kv.get_computed_blocks(make_request("b", tokens + [1])) == ([], 0)
    assert not kv.pool.cached and kv.hit_tokens == 0 and kv.lookups == 0


def test_free_releases_tail_first():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(12)))
    compute(kv, a, 12)
    ids = kv.get_block_ids("a")
    kv.free(a)
    assert [b.block_id for b in kv.pool.free_queue] == ids[::-1]


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_request("p", list(range(10)))  # 2 full blocks + 2 tokens
    compute(kv, parent, 10)
    child = make_request("c", list(range(10)))
    child.num_computed_tokens = parent.num_computed_tokens
    copies = kv.fork(parent, child)
    p_ids, c_ids = kv.get_block_ids("p"), kv.get_block_ids("c")
    assert c_ids[:2] == p_ids[:2] and c_ids[2] != p_ids[2]
    assert copies == [(p_ids[2], c_ids[2])]
    assert [kv.pool.blocks[i].ref_cnt for i in p_ids] == [2, 2, 1]
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_fork_on_a_block_boundary_copies_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    parent = make_request("p", list(range(8)))
    compute(kv, parent, 8)
    child = make_request("c", list(range(8)))
    assert kv.fork(parent, child) == []
    assert kv.get_block_ids("c") == kv.get_block_ids("p")


def test_fork_without_a_free_block_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    parent = make_request("p", list(range(6)))
    compute(kv, parent, 6)
    assert kv.fork(parent, make_request("c", list(range(6)))) is None
    assert kv.get_block_ids("c") == [] and [b.ref_cnt for b in kv.pool.blocks] == [1, 1]


def test_reset_prefix_cache_drops_hits():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(8)))
    compute(kv, a, 8)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", list(range(9))))[1] == 0
