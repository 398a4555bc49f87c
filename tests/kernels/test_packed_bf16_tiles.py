"""The packed weights multiplied on AMX bfloat16 tiles without a copy (packed_matmul.matmul_bf16): the same
product as a bfloat16 copy of the weights through oneDNN, for every code layout, row count and width."""

from __future__ import annotations

import pytest
import torch
from test_packed_matmul import LAYOUTS, codes, pack  # tests/kernels is no package

from kvflow.kernels import cpu_features, packed_matmul, packed_weight

# The tile kernel exists only in the amx tier's library and runs only on a CPU with AMX bfloat16: elsewhere
# there is nothing of it to run (layers there keep their bfloat16 copies or the packed kernel).
pytestmark = pytest.mark.skipif(not packed_matmul.available() or cpu_features.isa_tier() != "amx",
                                reason="AMX bfloat16 tiles: the amx tier's library only")


def bf16_copy(pw: packed_weight.PackedWeight) -> torch.Tensor:
    """What cache_dense_bf16 holds: the exact dequantized weights rounded to bfloat16."""
    return packed_matmul.rows(pw, torch.arange(pw.n)).to(torch.bfloat16)


@pytest.mark.parametrize("bits", LAYOUTS)
@pytest.mark.parametrize("m, n, k", [(512, 96, 256), (37, 40, 64), (1, 16, 32), (70, 33, 96)])
def test_tiles_match_the_bfloat16_copy(bits, m, n, k):
    pw = pack(codes(bits, n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    assert packed_matmul.takes_bf16_tiles(pw)
    assert packed_matmul.matmul_bf16(x, pw, out)
    ref = x.float() @ bf16_copy(pw).float().t()  # float32 sums, as both kernels keep them
    # Only the order of the float32 sums differs: within one bfloat16 rounding of the output.
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=1e-3 * ref.abs().max().item())


def test_strided_output_columns_are_left_alone():
    """A fused projection's parts write their own columns of one output (PackedParts)."""
    pw = pack(codes(4, 40, 64))
    x = torch.randn(20, 64).to(torch.bfloat16)
    out = torch.zeros(20, 100, dtype=torch.bfloat16)
    assert packed_matmul.matmul_bf16(x, pw, out[:, 30:70])
    assert (out[:, :30] == 0).all() and (out[:, 70:] == 0).all()
    torch.testing.assert_close(out[:, 30:70].float(), x.float() @ bf16_copy(pw).float().t(), rtol=2**-7, atol=1e-2)


def test_wrong_shapes_are_refused():
    pw = packed_matmul.random_weight(32, 64)
    with pytest.raises(ValueError, match="bfloat16"):
        packed_matmul.matmul_bf16(torch.zeros(4, 64), pw, torch.empty(4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        packed_matmul.matmul_bf16(torch.zeros(4, 32, dtype=torch.bfloat16), pw, torch.empty(4, 32, dtype=torch.bfloat16))
