"""Greedy outputs are identical whatever the batch, chunk size, prefix-cache state or preemption.

Run for four ways of holding the model: float32 weights and cache; packed Q4_1/Q8_0 weights
(quantization="gguf") with a float32, a bfloat16 and a float16 cache.

Not in the list: the default fast mode (dtype auto). It multiplies chunks of 32 rows or more by bfloat16
copies of the weights on AMX, and runs steps of up to 16 rows through the fused C++ step: a token's
arithmetic depends on how many rows its step had, and greedy outputs did differ with the batch (one of
16 prompts, at its 21st token). Exact mode (dtype float32) is the mode that guarantees invariance.

Not in the list: float32 dense weights with a 16-bit cache. PyTorch's float32 matmul rounds a row
differently depending on how many rows the call has (M <= 3 differs from M = 64 for 960x576), and
rounding K/V to 16 bits turns those last-bit differences into 16-bit-sized ones, which flipped a
greedy token of one prompt here. The packed kernels compute each row independently of the others."""

from __future__ import annotations

import pytest
from engine_helpers import GREEDY_32, PROMPTS, greedy_tokens, llm_builder

TARGET = PROMPTS[0]


VARIANTS = {
    "float32": ("default_loaded", {}),
    "packed gguf weights": ("packed_loaded", {}),
    "packed gguf weights, kv bfloat16": ("packed_loaded", {"kv_cache_dtype": "bfloat16"}),
    "packed gguf weights, kv float16": ("packed_loaded", {"kv_cache_dtype": "float16"}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    """(loaded model, engine options) of one variant."""
    fixture, options = VARIANTS[request.param]
    return request.getfixturevalue(fixture), options


@pytest.fixture(scope="module")
def model(variant):
    loaded, options = variant
    return llm_builder(loaded, **options)


@pytest.fixture(scope="module")
def alone(model) -> dict[str, list[int]]:
    """Each prompt run alone, with a plain configuration: the answer every other run must match."""
    llm = model(enable_prefix_caching=False)
    return {p: greedy_tokens(llm, [p])[0] for p in PROMPTS}


def test_batched_with_fifteen_others(model, alone):
    llm = model(enable_prefix_caching=False)
    outs = greedy_tokens(llm, PROMPTS)
    assert outs == [alone[p] for p in PROMPTS]


@pytest.mark.parametrize("chunk", [8, 64, 2048])
def test_chunk_sizes(model, alone, chunk):
    llm = model(max_num_batched_tokens=chunk, enable_prefix_caching=False)
    prompts = PROMPTS[:6]
    assert greedy_tokens(llm, prompts) == [alone[p] for p in prompts]


def test_prefix_cache_on_and_warm(model, alone):
    llm = model(enable_prefix_caching=True, block_size=4)  # prompts are short
    prompts = PROMPTS[:8]
    cold = greedy_tokens(llm, prompts)
    stats = llm.engine.scheduler.kv_cache_manager.stats
    hits_after_cold = stats.hit_tokens
    warm = greedy_tokens(llm, prompts)
    assert stats.hit_tokens > hits_after_cold, "the second run should hit the prefix cache"
    assert cold == warm == [alone[p] for p in prompts]


def test_preemption(model, alone):
    # 12 blocks of 16 tokens: a handful of ~45-token sequences cannot all stay resident.
    llm = model(num_blocks=12, block_size=16)
    prompts = PROMPTS[:6]
    outs = llm.generate(prompts, GREEDY_32)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"
    assert [o.outputs[0].token_ids for o in outs] == [alone[p] for p in prompts]
    manager = llm.engine.scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
