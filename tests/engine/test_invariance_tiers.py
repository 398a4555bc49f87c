"""The exact mode's invariance on every kernel tier below this CPU's own (the rest of the suite runs on its
own): test_invariance.py's tests on the tiny model with a float16 and an 8-bit cache
(test_invariance_tiny.py), forced with KVFLOW_ISA in a fresh process. (The
default model's packed variant took 31 s a tier; the head-size-specialised attention paths that the tiny
model's heads do not reach are checked row by row on every tier in tests/kernels/test_tiers.py.)"""

from __future__ import annotations

import pytest
from forced_tier import LOWER, assert_passes_on_tier

from kvflow.kernels import packed_matmul


# Only a CPU with nothing below its own tier has nothing to run here (no such x86 CPU: generic is below all).
@pytest.mark.skipif(not LOWER or not packed_matmul.available(), reason="no tier below this CPU's, or no kernels")
@pytest.mark.parametrize("tier", LOWER)
def test_exact_mode_invariance_on_a_lower_tier(tier):
    assert_passes_on_tier(tier, ["engine/test_invariance_tiny.py"])
