"""The prefix cache's disk tier in the engine (the tiny random Llama, int4-packed in exact mode, where every row
is computed independently of the others): a prefix evicted from memory or cached before a restart is read
back from disk, counted as such, and gives bit-identical logprobs to computing it; a damaged file is refused
and its block recomputed."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.engine.block_pool import hash_block_tokens

BLOCK = 4
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


def prompt(seed: int, n: int = 41) -> list[int]:
    return [3 + (seed * 37 + i * 11) % 300 for i in range(n)]


@pytest.fixture(scope="module")
def tiny(tiny_packed):
    return tiny_packed


@pytest.fixture(scope="module")
def reference(tiny):
    """What each prompt gives computed in full (no prefix cache): tokens and logprobs."""
    llm = LLM(loaded_model=tiny, block_size=BLOCK, num_blocks=64, enable_prefix_caching=False)
    return lambda tokens: answer(llm, tokens)


def answer(llm: LLM, tokens: list[int]):
    out = llm.generate({"prompt_token_ids": tokens}, PARAMS)[0]
    c = out.outputs[0]
    return c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs], out.metrics


def engine(tiny, folder, num_blocks: int = 64) -> LLM:
    return LLM(loaded_model=tiny, block_size=BLOCK, num_blocks=num_blocks, prefix_cache_dir=str(folder))


def test_a_restart_serves_the_prefix_from_disk(tiny, reference, tmp_path):
    tokens = prompt(1)
    with engine(tiny, tmp_path) as first:
        ids, logprobs, m = answer(first, tokens)
        assert m.num_disk_cached_tokens == 0
    assert (ids, logprobs) == reference(tokens)[:2]
    store = first.engine.prefix_store
    # Every full block of the prompt and of the output but the last token's, written on the way.
    assert len(store) == (len(tokens) + PARAMS.max_tokens - 1) // BLOCK == store.stats.writes

    with engine(tiny, tmp_path) as second:
        ids2, logprobs2, m2 = answer(second, tokens)
        hit = (len(tokens) - 1) // BLOCK * BLOCK
        assert m2.num_cached_tokens == m2.num_disk_cached_tokens == hit
        assert second.engine.scheduler.kv_cache_manager.stats.disk_hit_tokens == hit
        assert (ids2, logprobs2) == (ids, logprobs)  # bit-identical, not close
        # A prompt that shares only its first 5 blocks reads those 5 and computes the rest.
        other = tokens[:20] + prompt(2, 21)
        ids3, logprobs3, m3 = answer(second, other)
        assert m3.num_cached_tokens == 20 and m3.num_disk_cached_tokens == 0  # in memory by now
        assert (ids3, logprobs3) == reference(other)[:2]


def test_a_prefix_evicted_from_memory_comes_back_from_disk(tiny, reference, tmp_path):
    with engine(tiny, tmp_path, num_blocks=14) as llm:  # 56 tokens: each prompt evicts the one before
        first = answer(llm, prompt(3))
        for seed in (4, 5):
            answer(llm, prompt(seed))
        pool = llm.engine.scheduler.kv_cache_manager.pool
        assert pool.get_cached_block(hash_block_tokens(None, prompt(3)[:BLOCK])) is None  # gone from memory
        ids, logprobs, m = answer(llm, prompt(3))
        assert m.num_disk_cached_tokens == m.num_cached_tokens == 40
        assert (ids, logprobs) == first[:2] == reference(prompt(3))[:2]


def test_a_damaged_file_is_refused_and_its_block_recomputed(tiny, reference, tmp_path):
    tokens = prompt(6)
    with engine(tiny, tmp_path) as first:
        answer(first, tokens)
    store = first.engine.prefix_store
    parent = None
    chain = []
    for i in range(len(tokens) // BLOCK):
        parent = hash_block_tokens(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
        chain.append(parent)
    path = store.path(chain[3])
    data = bytearray(path.read_bytes())
    data[-30] ^= 0x40  # one bit of one K/V value
    path.write_bytes(bytes(data))

    with engine(tiny, tmp_path) as second:
        ids, logprobs, m = answer(second, tokens)
        second.engine.prefix_store.flush()  # the writer thread writes the recomputed block on its own time
        stats = second.engine.prefix_store.stats
        assert stats.refused == 1 and stats.writes == 1  # the block, recomputed, is written again
        assert m.num_disk_cached_tokens == 3 * BLOCK  # the blocks before the damaged one
        assert (ids, logprobs) == reference(tokens)[:2]
    # The recomputed block was written again: a third start reads the whole prefix.
    with engine(tiny, tmp_path) as third:
        assert answer(third, tokens)[2].num_disk_cached_tokens == (len(tokens) - 1) // BLOCK * BLOCK
