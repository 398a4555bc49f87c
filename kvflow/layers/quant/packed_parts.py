"""A fused projection whose parts the file stores in different types, kept as one packed layer per run of
parts that share a layout (PackedParts), instead of all parts widened to the widest one's layout.

A Q4_K_M file stores v in Q6_K where q and k are Q4_K in many layers (llama.cpp's quantizer gives v more
bits). Fused into one packed weight, q and k would be held as 6-bit codes in blocks of 16 with a float16
scale and offset each: 8 bits a weight where the file has 4.5, about 5% more bytes per decode step on an 8B
model. As two packed weights (q/k, then v), each keeps its own type's bytes; the outputs are the same
columns side by side, each bitwise what its own layer gives.
"""

from __future__ import annotations

import torch

from kvflow.kernels import packed_matmul, packed_weight
from kvflow.layers.quant.base import QuantLinear
from kvflow.layers.quant.packed_linear import PackedLinear


class PackedParts(QuantLinear):
    tile_align = packed_weight.COLUMNS

    def __init__(self, parts: list[PackedLinear], bias: torch.Tensor | None = None) -> None:
        if any(p.bias is not None or p.in_features != parts[0].in_features for p in parts):
            raise ValueError("the parts of a PackedParts share their inputs and carry no bias of their own")
        super().__init__(parts[0].in_features, sum(p.out_features for p in parts), bias)
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.reshape(-1, self.in_features).shape[0] > self.max_kernel_rows:
            return super().forward(x)  # the dense path, on the whole layer's bfloat16 copy
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def kernel_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.kernel_mm(x) for p in self.parts], dim=-1)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def dequantize_t(self, start: int, stop: int) -> torch.Tensor:
        pieces, first = [], 0  # only the parts' rows in [start, stop): the tiled path asks a tile at a time
        for part in self.parts:
            lo, hi = max(start, first), min(stop, first + part.out_features)
            if lo < hi:
                pieces.append(packed_matmul.rows(part.packed, torch.arange(lo - first, hi - first)))
            first += part.out_features
        w = torch.cat(pieces).to(torch.bfloat16)
        if stop > self.out_features:
            w = torch.cat([w, w.new_zeros(stop - self.out_features, self.in_features)])
        return w.t()

    def dense_bf16_into(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        if not all(packed_matmul.takes_bf16_tiles(p.packed) for p in self.parts):
            return False
        first = 0
        for part in self.parts:  # each part's columns of out, side by side
            if not packed_matmul.matmul_bf16(x, part.packed, out[:, first : first + part.out_features]):
                return False
            first += part.out_features
        return True

    def cache_dense_bf16(self) -> None:
        self.dense_bf16 = torch.cat([_dense(p) for p in self.parts])

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


def _dense(part: PackedLinear) -> torch.Tensor:
    part.cache_dense_bf16()
    dense, part.dense_bf16 = part.dense_bf16, None  # held once, by the whole layer
    return dense
