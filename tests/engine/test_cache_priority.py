"""Prefix-cache keys as eviction priority (engine/block_pool.py): the prompt blocks of a request that named a
cache key (SamplingParams.cache_key: OpenAI's prompt_cache_key, Anthropic's cache_control) are evicted after
every unmarked cached block, least recently freed first within each class."""

from __future__ import annotations

import pytest
from engine_helpers import make_llm

from kvflow import SamplingParams
from kvflow.engine.block_pool import BlockPool


def _cached(pool: BlockPool, count: int, first_hash: int, keep: bool) -> list:
    blocks = pool.get_new_blocks(count)
    for i, block in enumerate(blocks):
        pool.cache_full_block(block, first_hash + i, [i])
    if keep:
        pool.keep(blocks)
    return blocks


@pytest.mark.parametrize("keep", [True, False])
def test_kept_blocks_are_evicted_after_unmarked_ones(keep):
    pool = BlockPool(6)
    older = _cached(pool, 2, 100, keep)
    newer = _cached(pool, 2, 200, keep=False)
    pool.free_blocks(older)  # freed first: least recently used, evicted first by plain LRU
    pool.free_blocks(newer)
    assert pool.num_free_blocks == 6
    pool.get_new_blocks(4)  # the 2 never written, then 2 cached ones
    survivors = {h for h in (100, 101, 200, 201) if pool.get_cached_block(h) is not None}
    assert survivors == ({100, 101} if keep else {200, 201})
    # A hit revives a kept block out of its own queue; the last free blocks are then the kept ones.
    if keep:
        pool.touch([pool.get_cached_block(100)])
        assert pool.num_free_blocks == 1 and pool.get_new_blocks(1)[0].block_hash is None
        assert pool.get_cached_block(101) is None and pool.get_cached_block(100) is not None


def test_reset_forgets_what_was_kept():
    pool = BlockPool(4)
    blocks = _cached(pool, 2, 1, keep=True)
    pool.free_blocks(blocks)
    pool.reset_prefix_cache()
    assert len(pool.kept_queue) == 0 and pool.num_free_blocks == 4 and not any(b.kept for b in pool.blocks)


PROMPT = 96  # tokens: 6 blocks of 16


def _prompt(seed: int) -> dict:
    return {"prompt_token_ids": [3 + (seed * 37 + 11 * i) % 300 for i in range(PROMPT)]}


@pytest.mark.parametrize("key", ["agent-1", None])
def test_a_keyed_prefix_survives_pressure_that_evicts_an_unkeyed_one(tiny_packed, key):
    """Through the engine: one agent's prompt, then other users' prompts that fill the pool (each evicting
    the least recently used cached blocks), then the agent's next turn. With a cache key the agent's blocks
    are still there; without one they were evicted first."""
    llm = make_llm(tiny_packed, num_blocks=20, block_size=16, max_num_seqs=1)
    agent = SamplingParams(temperature=0, max_tokens=1, cache_key=key)
    other = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([_prompt(0)], agent)
    # 4 x 6 blocks through a pool of 20: once the 14 never written are taken, least recently freed cached
    # blocks go, the first prompt's first (all 6 by the fourth), unless they are kept.
    for seed in range(1, 5):
        llm.generate([_prompt(seed)], other)
    again = llm.generate([_prompt(0)], agent)[0]
    assert again.metrics.num_cached_tokens == (PROMPT - 16 if key else 0)


def test_data_parallel_routes_a_key_back_to_its_replica():
    """The router sends a key where it went first, even where another replica matches more of the
    prompt or is less loaded; unkeyed requests, and a key whose replica died, route as before."""
    from kvflow.engine.data_parallel import PrefixRouter

    router = PrefixRouter(3, block_size=4)
    prompt = router.block_hashes(list(range(16)))
    router.remember(2, prompt)  # replica 2 holds this prompt's blocks
    assert router.pick([], {0: 5, 1: 0, 2: 5}, key="session-a") == 1  # first time: the lightest
    assert router.pick(prompt, {0: 0, 1: 9, 2: 0}, key="session-a") == 1  # then always there
    assert router.pick(prompt, {0: 0, 1: 9, 2: 0}) == 2  # no key: the longest match
    assert router.pick(prompt, {0: 0, 2: 0}, key="session-a") == 2  # replica 1 is gone: routed afresh
    assert router.pick([], {0: 0, 1: 0, 2: 0}, key="session-a") == 2
