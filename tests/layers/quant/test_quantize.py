"""quantize_weight (`--quantization int8|int4`): error bounds against the float weight, and the layers built."""

import pytest
import torch

from kvflow.kernels import packed_matmul
from kvflow.layers.quant import (
    Int4Linear,
    Int8BlockLinear,
    Int8Linear,
    PackedLinear,
    build_quant_linear,
    quantize_weight,
)


def weight(n: int = 192, k: int = 768) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1


def test_int8_per_channel_error_and_layer():
    w = weight()
    bq = quantize_weight(w, "int8")
    assert bq.group_size == w.shape[1]
    err = (bq.dequantize() - w).abs()
    assert (err <= bq.scale * 0.5 * (1 + 1e-5) + 1e-12).all()  # round to nearest: half a step
    layer = build_quant_linear(bq)
    assert isinstance(layer, Int8Linear)
    x = torch.randn(4, w.shape[1])
    for rows in (4, 40):
        x = torch.randn(rows, w.shape[1])
        ref = x @ bq.dequantize().t()
        assert ((layer(x) - ref).abs().max() / ref.abs().max()) < 1e-2


def test_int8_grouped_is_q8_0_like():
    w = weight()
    bq = quantize_weight(w, "int8", group_size=32)
    assert ((bq.dequantize() - w).abs() <= bq.scale.repeat_interleave(32, 1) * 0.5 * (1 + 1e-5)).all()
    assert isinstance(build_quant_linear(bq), Int8BlockLinear)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_bound(group_size):
    w = weight()
    bq = quantize_weight(w, "int4", group_size)
    step = bq.scale.repeat_interleave(group_size, 1)
    err = (bq.dequantize() - w).abs()
    # Half a step, plus the bf16 rounding of the minimum (2^-9 of it) that shifts the grid.
    lo = bq.offset.abs().repeat_interleave(group_size, 1)
    assert (err <= 0.5 * step + 2**-8 * lo + 1e-7).all()
    layer = build_quant_linear(bq)
    # Groups of 32 with float16-exact scales go to kvflow's kernel where it runs.
    assert isinstance(layer, PackedLinear if group_size == 32 and packed_matmul.available() else Int4Linear)
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(group_size))
    ref = x @ bq.dequantize().t()
    assert ((layer(x) - ref).abs().max() / ref.abs().max()) < 1e-2
    # Against the float weight, the whole int4 error. 16 levels over a group's range of about 5 sigma make
    # a step of ~0.33 sigma, so the rounding error is ~0.33/sqrt(12) ~ 0.1 sigma per weight: a relative
    # output error near 0.1 for 128-wide groups, less for narrower ones.
    assert ((layer(x) - x @ w.t()).norm() / (x @ w.t()).norm()) < 0.15


def test_bad_scheme_and_group():
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_weight(weight(), "int3")
    with pytest.raises(ValueError, match="must divide"):
        quantize_weight(weight(), "int4", 100)
