"""8-bit codes with a scale per block of inputs (GGUF Q8_0) on PyTorch's int4 CPU kernel, exactly.

PyTorch's int8 kernel takes one scale per output row, so Q8_0's per-32 scales do not fit it without
requantizing (which adds error). Instead each byte is split into two nibbles, q = 16 h + l, and the layer
holds two 4-bit matrices stacked along the output dim: hi with scale 16 s and offset o, lo with scale s
and offset 0. One int4 kernel call yields both halves; their sum is s * q + o. For Q8_0 the kernel's zero
points come out as 0 and 8 s, so the weights it computes with are bf16(d) * q8 exactly. Same bytes as
int8 (1 per weight), plus 8 bytes of bfloat16 scales per block.
"""

from __future__ import annotations

import torch

from kvflow.layers.quant import int4pack
from kvflow.layers.quant.base import QuantLinear
from kvflow.layers.quant.packing import BlockQuant


class Int8BlockLinear(QuantLinear):
    def __init__(self, bq: BlockQuant, bias: torch.Tensor | None = None, exact_rows: bool = False) -> None:
        if bq.bits != 8:
            raise ValueError(f"Int8BlockLinear takes 8-bit codes, got {bq.bits}-bit")
        n, k = bq.shape
        super().__init__(k, n, bias)
        self.group_size = bq.group_size
        block = int4pack.layout()[0]
        self.half = -(-n // block) * block  # padded rows per half

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(self.half - n, t.shape[1])])

        q = torch.cat([pad(bq.q >> 4), pad(bq.q & 0x0F)])
        scale = torch.cat([pad(16.0 * bq.scale), pad(bq.scale)])
        offset = torch.cat([pad(bq.offset), pad(torch.zeros_like(bq.offset))])
        self.pack = int4pack.pack_int4(q, scale, offset, bq.group_size)
        self.tile_align = block
        self.row_scale = bq.scale.clone() if exact_rows else None
        self.row_offset = bq.offset.clone() if exact_rows else None

    def kernel_mm(self, x: torch.Tensor) -> torch.Tensor:
        y = int4pack.int4_mm(x, self.pack)
        return y[:, : self.half].float() + y[:, self.half :].float()  # sum in float32: one rounding less

    def _scale_offset(self, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 scale s (from the lo half) and offset o (from the hi half) for rows of the layer."""
        lo_rows = slice(rows.start + self.half, rows.stop + self.half) if isinstance(rows, slice) else rows + self.half
        scale, _ = self.pack.scale_offset(lo_rows)
        _, hi_offset = self.pack.scale_offset(rows)
        return scale, hi_offset  # the lo half's offset is 0

    def _codes_t(self, start: int, stop: int) -> torch.Tensor:
        hi = int4pack.nibbles_t(self.pack, start, stop)
        lo = int4pack.nibbles_t(self.pack, self.half + start, self.half + stop)
        return (hi << 4) | lo

    def dequantize_t(self, start: int, stop: int) -> torch.Tensor:
        scale, offset = self._scale_offset(slice(start, stop))
        return int4pack.dequantize_t(self.pack, start, stop, scale, offset, q=self._codes_t(start, stop))

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight, float32 [*ids.shape, in] (the tied token embedding of GGUF files)."""
        rows = ids.reshape(-1)
        hi = int4pack.gather_nibbles(self.pack, rows)
        lo = int4pack.gather_nibbles(self.pack, rows + self.half)
        q = ((hi << 4) | lo).float().view(rows.numel(), -1, self.group_size)
        if self.row_scale is not None:
            scale, offset = self.row_scale[rows], self.row_offset[rows]
        else:
            scale, offset = (t.t() for t in self._scale_offset(rows))
        w = q * scale.unsqueeze(-1) + offset.unsqueeze(-1)
        return w.view(*ids.shape, self.in_features)

    def nbytes(self) -> int:
        extra = 0 if self.row_scale is None else 2 * self.row_scale.numel() * 4
        return self.pack.nbytes() + extra
