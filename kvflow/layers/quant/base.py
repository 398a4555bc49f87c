"""The forward shared by the packed linear layers: a packed-integer kernel, and a dense path for many rows.

Few rows (decode): the packed kernel streams 0.5 to 1 byte per weight, where float32 reads 4; its cost
grows with the row count. Many rows (prefill), past `max_kernel_rows` (which the executor sets where
bfloat16 matmuls are native): weights are dequantized to bfloat16 one tile of output rows at a time and
multiplied through oneDNN, so no full-size float copy of the weights is kept; a tile is at most
`tile_bytes` of bfloat16. Eager dequantization costs about as much as a 512-row matmul, so
`cache_dense_bf16()` trades 2 bytes a weight for the fastest prefill, except where `dense_bf16_into`
multiplies the packed weights on AMX bfloat16 tiles directly (as fast, no copy). Both paths round activations to
bfloat16 and accumulate in float32; the result comes back in the input's dtype.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch
from torch import nn

DEFAULT_TILE_BYTES = 4 << 20  # a bfloat16 weight tile that stays in L2/LLC while it is used


class QuantLinear(nn.Module):
    """x [*, in_features] -> [*, out_features]; subclasses supply the two paths."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        # The kernel for every row count unless the executor sets a crossover: a row's result then never
        # depends on how many rows its call had.
        self.max_kernel_rows = sys.maxsize
        self.tile_bytes = DEFAULT_TILE_BYTES
        self.dense_bf16: torch.Tensor | None = None

    def cache_dense_bf16(self) -> None:
        """Keep a bfloat16 [out, in] copy for the many-rows path (faster prefill, +2 bytes a weight)."""
        self.dense_bf16 = self.dequantize().to(torch.bfloat16).contiguous()

    # --- what a format supplies -------------------------------------------------------------
    def kernel_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x bfloat16 [M, K] contiguous -> [M, >= out_features] (extra columns are padding)."""
        raise NotImplementedError

    def dequantize_t(self, start: int, stop: int) -> torch.Tensor:
        """W^T bfloat16 [K, stop - start] for output rows start:stop (start, stop multiples of tile_align)."""
        raise NotImplementedError

    tile_align = 64

    def dequantize(self) -> torch.Tensor:
        """The weights this layer computes with, float32 [out, in] (tests and debugging)."""
        end = -(-self.out_features // self.tile_align) * self.tile_align
        return self.dequantize_t(0, end).t()[: self.out_features].float()

    # --- shared forward -----------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        if x2.shape[0] <= self.max_kernel_rows:
            y = self.kernel_mm(x2)[:, : self.out_features]
        else:
            y = self._tiled_mm(x2)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def dense_bf16_into(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """out (bfloat16 [M, out_features]) = x (bfloat16 [M, in_features]) @ W^T straight from the stored
        weights, the values a bfloat16 copy would hold (AMX tiles: packed_matmul.matmul_bf16). False where
        this layer's format or this CPU has no such kernel."""
        return False

    def _tiled_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_bf16 is not None:
            return torch.nn.functional.linear(x, self.dense_bf16)
        if getattr(self, "dense_from_packed", False) and not torch.compiler.is_compiling():
            y = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
            if self.dense_bf16_into(x, y):  # set where model_setup found the AMX tiles take this layer
                return y
        row_bytes = 2 * self.in_features
        step = max(self.tile_align, self.tile_bytes // row_bytes // self.tile_align * self.tile_align)
        n = self.out_features
        if step >= n:
            end = -(-n // self.tile_align) * self.tile_align
            return torch.mm(x, self.dequantize_t(0, end))[:, :n]
        y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        for start in range(0, n, step):
            stop = min(start + step, -(-n // self.tile_align) * self.tile_align)
            part = torch.mm(x, self.dequantize_t(start, stop))
            y[:, start : min(stop, n)] = part[:, : min(stop, n) - start]
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def outermost_quant_layers(model: nn.Module) -> Iterator[QuantLinear]:
    """Each packed layer under `model` once, a layer made of packed parts (PackedParts) as itself, not again
    through its parts: what to count when summing the bytes packed layers hold or a step reads."""
    inside: set[int] = set()
    for module in model.modules():  # a parent comes before its children
        if isinstance(module, QuantLinear) and id(module) not in inside:
            inside.update(id(m) for m in module.modules())
            yield module
