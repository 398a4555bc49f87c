"""The invariance tests of test_invariance.py on a tiny random Llama, int4-packed, in the exact mode, with a
float16 and with an 8-bit cache (kv_cache_dtype="int8"): quick enough for every kernel tier, the plain C++
one included (test_invariance_tiers.py runs it there)."""

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


@pytest.fixture(scope="module", params=["float16", "int8"])
def model(tiny_packed, request):
    assert tiny_packed.plan.batch_invariant
    return llm_builder(tiny_packed, kv_cache_dtype=request.param, kv_cache_memory=16 << 20)
