"""The invariance tests of test_invariance.py on a tiny random Qwen3-MoE (4 experts, top 2, one dense
layer) and a tiny gpt-oss (4 experts with biases, a biased router, sinks, sliding windows between global
layers), int4-packed, in the exact mode: a token's experts and its sum over them must not depend on the
batch, the chunking, the prefix cache or preemption."""

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
from kvflow.config import ModelConfig
from kvflow.executors.model_setup import load_model


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def tiny_moe(request, tiny_checkpoints):
    return load_model(ModelConfig(model=str(tiny_checkpoints[request.param]), device="cpu", mode="exact",
                                  quantization="int4"))


@pytest.fixture(scope="module")
def model(tiny_moe):
    assert tiny_moe.plan.batch_invariant and tiny_moe.arch.num_experts == 4
    return llm_builder(tiny_moe, kv_cache_memory=16 << 20)
