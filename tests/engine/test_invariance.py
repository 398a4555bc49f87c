"""Greedy outputs are identical whatever the batch, chunk size, prefix-cache state or preemption (float32)."""

from __future__ import annotations

import pytest
from engine_helpers import GREEDY_32, PROMPTS, greedy_tokens, make_llm

TARGET = PROMPTS[0]


@pytest.fixture(scope="module")
def alone(default_loaded) -> dict[str, list[int]]:
    """Each prompt run alone, with a plain configuration: the answer every other run must match."""
    llm = make_llm(default_loaded, enable_prefix_caching=False)
    return {p: greedy_tokens(llm, [p])[0] for p in PROMPTS}


def test_batched_with_fifteen_others(default_loaded, alone):
    llm = make_llm(default_loaded, enable_prefix_caching=False)
    outs = greedy_tokens(llm, PROMPTS)
    assert outs == [alone[p] for p in PROMPTS]


@pytest.mark.parametrize("chunk", [8, 64, 2048])
def test_chunk_sizes(default_loaded, alone, chunk):
    llm = make_llm(default_loaded, max_num_batched_tokens=chunk, enable_prefix_caching=False)
    prompts = PROMPTS[:6]
    assert greedy_tokens(llm, prompts) == [alone[p] for p in prompts]


def test_prefix_cache_on_and_warm(default_loaded, alone):
    llm = make_llm(default_loaded, enable_prefix_caching=True, block_size=4)  # prompts are short
    prompts = PROMPTS[:8]
    cold = greedy_tokens(llm, prompts)
    stats = llm.engine.scheduler.kv_cache_manager.stats
    hits_after_cold = stats.hit_tokens
    warm = greedy_tokens(llm, prompts)
    assert stats.hit_tokens > hits_after_cold, "the second run should hit the prefix cache"
    assert cold == warm == [alone[p] for p in prompts]


def test_preemption(default_loaded, alone):
    # 12 blocks of 16 tokens: a handful of ~45-token sequences cannot all stay resident.
    llm = make_llm(default_loaded, num_blocks=12, block_size=16)
    prompts = PROMPTS[:6]
    outs = llm.generate(prompts, GREEDY_32)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"
    assert [o.outputs[0].token_ids for o in outs] == [alone[p] for p in prompts]
    manager = llm.engine.scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
