"""The invariance tests of test_invariance.py on tiny random Gemma 2 and Gemma 3 models (sliding-window
layers between global ones, windows of 24 and 20 tokens that the prompts and answers outgrow; Gemma 2's
capped scores), int4-packed, in the exact mode with a float16 cache."""

from __future__ import annotations

import pytest
from engine_helpers import llm_builder

from engine.test_invariance import (  # noqa: F401 - the tests and their fixture, run here on this module's models
    alone,
    test_batched_with_fifteen_others,
    test_chunk_sizes,
    test_preemption,
    test_prefix_cache_on_and_warm,
)
from kvflow.config import ModelConfig
from kvflow.executors.model_setup import load_model


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def windowed(request, tiny_checkpoints):
    return load_model(ModelConfig(model=str(tiny_checkpoints[request.param]), device="cpu", mode="exact",
                                  quantization="int4"))


@pytest.fixture(scope="module")
def model(windowed):
    assert windowed.plan.batch_invariant
    assert {layer.self_attn.window for layer in windowed.model.layers} == {0, windowed.arch.sliding_window}
    return llm_builder(windowed, kv_cache_dtype="float16", kv_cache_memory=16 << 20)
