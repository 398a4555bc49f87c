"""The invariance tests of test_invariance.py with the 8-bit KV cache (kv_cache_dtype="int8"), on the tiny
random Llama, int4-packed, in the exact mode: results equal whatever the batch, chunk, cache state or
preemption."""

from __future__ import annotations

import pytest
from engine_helpers import llm_builder

from engine.test_invariance import (  # noqa: F401 - the tests and their fixture, run here on this module's model
    alone,
    test_batched_with_fifteen_others,
    test_chunk_sizes,
    test_preemption,
    test_prefix_cache_on_and_warm,
)


@pytest.fixture(scope="module")
def model(tiny_packed):
    assert tiny_packed.plan.batch_invariant
    return llm_builder(tiny_packed, kv_cache_dtype="int8", kv_cache_memory=16 << 20)
