"""4-bit group-wise linear (GGUF Q4_0 / Q4_1, `--quantization int4`) on PyTorch's int4 CPU kernel."""

from __future__ import annotations

import torch

from kvflow.layers.quant import int4pack
from kvflow.layers.quant.base import QuantLinear
from kvflow.layers.quant.packing import BlockQuant


class Int4Linear(QuantLinear):
    """Weights stay 4-bit (0.5 byte each plus a bfloat16 scale and zero per group).

    Relative to the GGUF's own dequantization, the only weight error is the kernel's bfloat16 copy of
    each group's scale and zero (relative error <= 2^-9 of the group's magnitude). With
    `exact_rows=True` the float32 scales are kept too (8 bytes a group) so that `embedding()` returns
    rows equal to the GGUF's dequantization."""

    def __init__(self, bq: BlockQuant, bias: torch.Tensor | None = None, exact_rows: bool = False) -> None:
        if bq.bits != 4:
            raise ValueError(f"Int4Linear takes 4-bit codes, got {bq.bits}-bit")
        n, k = bq.shape
        super().__init__(k, n, bias)
        self.group_size = bq.group_size
        self.pack = int4pack.pack_int4(bq.q, bq.scale, bq.offset, bq.group_size)
        self.tile_align = int4pack.layout()[0]
        self.row_scale = bq.scale.clone() if exact_rows else None
        self.row_offset = bq.offset.clone() if exact_rows else None

    def kernel_mm(self, x: torch.Tensor) -> torch.Tensor:
        return int4pack.int4_mm(x, self.pack)

    def dequantize_t(self, start: int, stop: int) -> torch.Tensor:
        scale, offset = self.pack.scale_offset(slice(start, stop))
        return int4pack.dequantize_t(self.pack, start, stop, scale, offset)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight, float32 [*ids.shape, in] (a tied embedding reads the same packed bytes)."""
        rows = ids.reshape(-1)
        q = int4pack.gather_nibbles(self.pack, rows).float().view(rows.numel(), -1, self.group_size)
        if self.row_scale is not None:
            scale, offset = self.row_scale[rows], self.row_offset[rows]
        else:
            scale, offset = (t.t() for t in self.pack.scale_offset(rows))
        w = q * scale.unsqueeze(-1) + offset.unsqueeze(-1)
        return w.view(*ids.shape, self.in_features)

    def nbytes(self) -> int:
        extra = 0 if self.row_scale is None else 2 * self.row_scale.numel() * 4
        return self.pack.nbytes() + extra
