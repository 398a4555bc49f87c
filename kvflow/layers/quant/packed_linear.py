"""4-, 6- and 8-bit group-wise linear on kvflow's own kernel (kernels/packed_matmul): the GGUF types of
packing.PACKED_BITS (Q6_K and the 5-bit ones with free offsets as 6-bit codes, Q5_0 in 6 bits too, IQ4_NL,
IQ4_XS and MXFP4 as 4-bit indices into their codebooks), in blocks of 32 or 16 inputs.

Where the kernels build (a C++ compiler; every CPU tier), it replaces Int4Linear and Int8BlockLinear: the codes
and float16 scales are stored as the GGUF has them, so the weights it multiplies by are the file's own
(no bfloat16 copy of the scales), and its float32 output is not rounded to bfloat16. The only rounding
is the input's quantization to 16-bit integers per block of 32 inputs (2^-16 of the block's largest).
Its packed bytes are also what the native decoder (kvflow/executors/native_model.py) reads.
"""

from __future__ import annotations

import torch

from kvflow.kernels import packed_matmul, packed_weight
from kvflow.layers.quant.base import QuantLinear
from kvflow.layers.quant.packing import BlockQuant

ROWS_PER_TILE = 512  # rows dequantized at a time (float32 temporaries of a few MB)


class PackedLinear(QuantLinear):
    tile_align = packed_weight.COLUMNS

    def __init__(self, bq: BlockQuant | packed_weight.PackedWeight, bias: torch.Tensor | None = None) -> None:
        """From codes, or from bytes already in the kernel's layout (packed_weight.pack_gguf)."""
        if isinstance(bq, BlockQuant):
            bq = packed_weight.pack(bq.q, bq.scale, bq.offset, bq.group_size, bq.bits, bq.centre, bq.codebook)
        super().__init__(bq.k, bq.n, bias)
        self.packed = bq
        self._block_abs_sum: torch.Tensor | None = None  # for error_bound, computed on first use

    @staticmethod
    def can_build(bq: BlockQuant) -> bool:
        return packed_matmul.available() and packed_weight.can_pack(bq.q, bq.scale, bq.offset, bq.group_size, bq.bits,
                                                                    bq.centre, bq.codebook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] > self.max_kernel_rows:
            return super().forward(x)
        x2 = x2.float().contiguous()
        if torch.compiler.is_compiling():
            p = self.packed
            y = torch.ops.kvflow.packed_matmul(x2, p.data, self.out_features, p.bits, p.has_offset, p.group, p.centre,
                                               p.super_scales, p.codebook)
        else:
            y = packed_matmul.matmul(x2, self.packed)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def dense_bf16_into(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        return packed_matmul.takes_bf16_tiles(self.packed) and packed_matmul.matmul_bf16(x, self.packed, out)

    def cache_dense_bf16(self) -> None:
        """The bfloat16 copy for many-row steps, filled a tile of rows at a time: dequantizing all rows at
        once would hold float32 temporaries several times the copy's size (the load's peak memory)."""
        dense = torch.empty(self.out_features, self.in_features, dtype=torch.bfloat16)
        for start in range(0, self.out_features, ROWS_PER_TILE):
            rows = torch.arange(start, min(start + ROWS_PER_TILE, self.out_features))
            dense[start : start + len(rows)] = packed_matmul.rows(self.packed, rows)
        self.dense_bf16 = dense

    def kernel_mm(self, x: torch.Tensor) -> torch.Tensor:
        return packed_matmul.matmul(x.float().contiguous(), self.packed)

    def dequantize_t(self, start: int, stop: int) -> torch.Tensor:
        rows = torch.arange(start, min(stop, self.out_features))
        w = packed_matmul.rows(self.packed, rows).to(torch.bfloat16)
        if stop > self.out_features:
            w = torch.cat([w, w.new_zeros(stop - self.out_features, self.in_features)])
        return w.t()

    def dequantize(self) -> torch.Tensor:
        return torch.cat([packed_matmul.rows(self.packed, torch.arange(s, min(s + ROWS_PER_TILE, self.out_features)))
                          for s in range(0, self.out_features, ROWS_PER_TILE)])

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight, float32 [*ids.shape, in]: exactly the GGUF's dequantized values."""
        if torch.compiler.is_compiling():
            p = self.packed
            flat = torch.ops.kvflow.packed_rows(ids.reshape(-1), p.data, p.n, p.k, p.bits, p.has_offset, p.group,
                                                p.centre, p.super_scales, p.codebook)
            return flat.view(*ids.shape, self.in_features)
        return packed_matmul.rows(self.packed, ids)

    def nbytes(self) -> int:
        return self.packed.nbytes()

    def exact_top(self, x: torch.Tensor) -> torch.Tensor | None:
        """y = x @ W^T [T, out] float32 with every output that could be its row's largest recomputed
        exactly (see error_bound), or None where this layer cannot (a bias)."""
        if self.bias is not None:
            return None
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        y = packed_matmul.matmul(x2, self.packed)
        self.prepare_error_bound()
        packed_matmul.refine_top(x2, self.packed, y, self._block_abs_sum)
        return y.reshape(*x.shape[:-1], self.out_features)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """A bound on |y - x @ W^T| per row of x [T, in] (float32 [T, 1]): the kernel's only approximation
        is the input's, at most half a step of max|x| / 32639 per block (the weight's group), times that
        block's largest sum of |w| over an output row; plus slack for float32 sums."""
        self.prepare_error_bound()
        amax = x.float().view(x.shape[0], -1, self.packed.group).abs().amax(-1)  # [T, blocks]
        bound = amax @ self._block_abs_sum / (2 * packed_weight.INPUT_STEPS)
        return (bound * 1.01 + 1e-6 * x.float().abs().sum(-1) * self._block_abs_sum.max()).unsqueeze(-1)

    def prepare_error_bound(self) -> None:
        """Per block of inputs, the largest sum of |w| over an output row (error_bound's one weight statistic;
        a pass over every weight, so done once, at load for the output projection)."""
        if self._block_abs_sum is None:
            self._block_abs_sum = packed_matmul.block_abs_sum(self.packed)  # [blocks]


@torch.library.custom_op("kvflow::packed_matmul", mutates_args=())
def _packed_matmul_op(x: torch.Tensor, data: torch.Tensor, n: int, bits: int, has_offset: bool,
                      group: int, centre: int, super_scales: torch.Tensor | None, codebook: int) -> torch.Tensor:
    # An op of its own so that torch.compile calls the kernel rather than tracing into ctypes.
    pw = packed_weight.PackedWeight(data, n, x.shape[1], bits, has_offset, group, centre, super_scales=super_scales,
                                    codebook=codebook)
    return packed_matmul.matmul(x, pw)


@_packed_matmul_op.register_fake
def _(x: torch.Tensor, data: torch.Tensor, n: int, bits: int, has_offset: bool, group: int,
      centre: int, super_scales: torch.Tensor | None, codebook: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


@torch.library.custom_op("kvflow::packed_rows", mutates_args=())
def _packed_rows_op(ids: torch.Tensor, data: torch.Tensor, n: int, k: int, bits: int, has_offset: bool,
                    group: int, centre: int, super_scales: torch.Tensor | None, codebook: int) -> torch.Tensor:
    return packed_matmul.rows(packed_weight.PackedWeight(data, n, k, bits, has_offset, group, centre,
                                                         super_scales=super_scales, codebook=codebook), ids)


@_packed_rows_op.register_fake
def _(ids: torch.Tensor, data: torch.Tensor, n: int, k: int, bits: int, has_offset: bool, group: int,
      centre: int, super_scales: torch.Tensor | None, codebook: int) -> torch.Tensor:
    return data.new_empty(ids.shape[0], k, dtype=torch.float32)
