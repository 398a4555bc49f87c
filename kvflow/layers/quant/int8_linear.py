"""8-bit per-output-channel linear (`--quantization int8`) on PyTorch's `_weight_int8pack_mm`.

The kernel computes y = (x @ q^T) * scale[n] with q int8 [N, K] and one scale per output row, in bfloat16
(its float32 path is a scalar loop on x86). This is gpt-fast's int8 weight-only scheme: symmetric codes,
w = scale * q8; 1 byte per weight plus 2 bytes per row.
"""

from __future__ import annotations

import torch

from kvflow.layers.quant.base import QuantLinear
from kvflow.layers.quant.packing import BlockQuant


class Int8Linear(QuantLinear):
    def __init__(self, bq: BlockQuant, bias: torch.Tensor | None = None) -> None:
        n, k = bq.shape
        if bq.bits != 8 or bq.group_size != k or not torch.equal(bq.offset, -128.0 * bq.scale):
            raise ValueError("Int8Linear takes symmetric 8-bit codes with one scale per row")
        super().__init__(k, n, bias)
        self.q8 = (bq.q.to(torch.int16) - 128).to(torch.int8).contiguous()
        self.scale = bq.scale.view(n).to(torch.bfloat16)
        self.tile_align = 1

    def kernel_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q8, self.scale)

    def dequantize_t(self, start: int, stop: int) -> torch.Tensor:
        return self.q8[start:stop].t().to(torch.bfloat16) * self.scale[start:stop]

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q8[ids].float() * self.scale[ids].float().unsqueeze(-1)

    def nbytes(self) -> int:
        return self.q8.numel() + 2 * self.scale.numel()
