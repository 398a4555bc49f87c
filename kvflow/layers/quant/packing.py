"""GGUF block formats -> one unpacked form, `BlockQuant`, from which the packed linear layers are built.

Every format here is an affine code per group of `group_size` inputs along a row:

    w[n, k] = scale[n, g] * q[n, k] + offset[n, g],   g = k // group_size,  q unsigned

GGUF Q8_0 (q8 signed, w = d*q8) becomes q = q8 + 128, offset = -128 d; Q4_0 (w = d*(q-8)) becomes
offset = -8 d; Q4_1 (w = d*q + m) is already affine. With d an f16 value, d*q and the offset are exact in
float32, so `dequantize` reproduces gguf.quants.dequantize bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 32  # elements per GGUF Q4_0 / Q4_1 / Q8_0 block
_BLOCK_BYTES = {"Q8_0": 2 + QK, "Q4_0": 2 + QK // 2, "Q4_1": 4 + QK // 2}


@dataclass
class BlockQuant:
    """Unpacked group-wise affine weights: q uint8 [N, K], scale and offset float32 [N, K // group_size]."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group_size: int
    bits: int  # 4 (q in 0..15) or 8 (q in 0..255)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]; the same rounding as gguf.quants.dequantize (one float32 rounding, or none)."""
        n, k = self.q.shape
        q = self.q.view(n, k // self.group_size, self.group_size).float()
        w = q * self.scale.unsqueeze(-1) + self.offset.unsqueeze(-1)
        return w.view(n, k)


def from_gguf(raw: np.ndarray, qtype: str) -> BlockQuant:
    """Decode GGUF block bytes, shaped [out, bytes_per_row] as gguf.GGUFReader gives them."""
    if qtype not in _BLOCK_BYTES:
        raise ValueError(f"GGUF type {qtype} has no packed kernel here; supported: {', '.join(_BLOCK_BYTES)}")
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if not raw.flags.writeable:  # a memory-mapped GGUF; torch wants writable memory even to read
        raw = raw.copy()
    n, row_bytes = raw.shape
    if row_bytes % _BLOCK_BYTES[qtype]:
        raise ValueError(f"{qtype} rows must be whole blocks of {_BLOCK_BYTES[qtype]} bytes, got {row_bytes}")
    blocks = torch.from_numpy(raw).view(n, row_bytes // _BLOCK_BYTES[qtype], _BLOCK_BYTES[qtype])
    d = _f16(blocks[..., 0:2])
    if qtype == "Q8_0":
        q = (blocks[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return BlockQuant(q.reshape(n, -1), d, -128.0 * d, QK, 8)
    nibbles = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]
    # Low nibbles are elements 0..15 of a block, high nibbles 16..31.
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(n, -1)
    offset = _f16(blocks[..., 2:4]) if qtype == "Q4_1" else -8.0 * d
    return BlockQuant(q, d, offset, QK, 4)


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    return two_bytes.contiguous().view(torch.float16).squeeze(-1).float()


def concat_rows(parts: list[BlockQuant]) -> BlockQuant:
    """Stack several tensors along the output dim (fused q/k/v or gate/up); formats must agree."""
    first = parts[0]
    for p in parts[1:]:
        if (p.group_size, p.bits, p.q.shape[1]) != (first.group_size, first.bits, first.q.shape[1]):
            raise ValueError("fused tensors must share input size, group size and bit width")
    return BlockQuant(
        torch.cat([p.q for p in parts]),
        torch.cat([p.scale for p in parts]),
        torch.cat([p.offset for p in parts]),
        first.group_size,
        first.bits,
    )


def permute_rows(bq: BlockQuant, index: torch.Tensor) -> BlockQuant:
    """Reorder output rows: row i of the result is row index[i]. Groups run along the input dim, so
    a row permutation moves whole rows of q, scale and offset together."""
    return BlockQuant(bq.q[index], bq.scale[index], bq.offset[index], bq.group_size, bq.bits)


def unpermute_rope_index(n_rows: int, n_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k rope permutation (same as loader.gguf_file.unpermute_rope)."""
    rows = torch.arange(n_rows)
    return rows.reshape(n_heads, n_rows // n_heads // 2, 2).transpose(1, 2).reshape(n_rows)
