"""The native decoder against the PyTorch layers on every kernel tier below this CPU's own (the rest of
test_cpu_fast.py runs on its own): biases and head norms, experts, the packed router, two-type fused
projections and a packed head, forced with KVFLOW_ISA in a fresh process. Each tier plans its own weight
copies (bfloat16 where AMX or AVX512-BF16 pays), which is what let these tests fail on one tier only."""

from __future__ import annotations

import pytest
from forced_tier import LOWER, assert_passes_on_tier

from kvflow.kernels import packed_matmul

SELECTION = "bias_and_head or experts_do_not or router or two_types or gemma_file"


# Skips only where nothing can run: a generic-tier CPU has no lower tier to force, and a machine without a
# C++ compiler no native decoder (CI has g++ and an x86 CPU with at least AVX2).
@pytest.mark.skipif(not LOWER or not packed_matmul.available(), reason="no tier below this CPU's, or no kernels")
@pytest.mark.parametrize("tier", LOWER)
def test_native_decoder_against_the_pytorch_layers_on_a_lower_tier(tier):
    assert_passes_on_tier(tier, ["executors/test_cpu_fast.py"], SELECTION)
