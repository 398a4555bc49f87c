"""The invariance tests of test_invariance.py with n-gram speculation on (issue 20): greedy outputs alone,
batched with fifteen others, at three chunk sizes, with a warm prefix cache and under forced preemption
equal the outputs of plain decoding, on a tiny random Llama in the exact mode (int4-packed, float16 cache)."""

from __future__ import annotations

import pytest
from engine_helpers import PROMPTS, greedy_tokens, llm_builder

from engine.test_invariance import (  # noqa: F401 - the tests, run here on this module's model
    test_batched_with_fifteen_others,
    test_chunk_sizes,
    test_preemption,
    test_prefix_cache_on_and_warm,
)

# Lookups from one token on, up to 8 drafts: speculation runs often, and rejects often, on a random model.
SPECULATION = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
BUILT: list = []  # every LLM the tests built, to check that they did speculate


@pytest.fixture(scope="module")
def plain(tiny_packed):
    assert tiny_packed.plan.batch_invariant
    return llm_builder(tiny_packed, kv_cache_dtype="float16", kv_cache_memory=16 << 20)


@pytest.fixture(scope="module")
def model(plain):
    def build(**extra):
        llm = plain(speculative_config=SPECULATION, **extra)
        BUILT.append(llm)
        return llm

    return build


@pytest.fixture(scope="module")
def alone(plain) -> dict[str, list[int]]:
    """Each prompt alone, without speculation: the answer every speculative run must match."""
    llm = plain(enable_prefix_caching=False)
    return {p: greedy_tokens(llm, [p])[0] for p in PROMPTS}


def test_the_runs_above_did_speculate():
    """Guards the tests above against passing vacuously: drafts were verified, kept and rejected."""
    assert BUILT, "run with the invariance tests of this module"
    drafted = sum(llm.engine.speculator.num_draft_tokens for llm in BUILT)
    kept = sum(llm.engine.speculator.num_accepted_tokens for llm in BUILT)
    assert 0 < kept < drafted, (kept, drafted)
