"""GGUF block formats -> one unpacked form, `BlockQuant`, from which the packed linear layers are built.

Every format here is an affine code per group of `group_size` inputs along a row:

    w[n, k] = scale[n, g] * q[n, k] + offset[n, g],   g = k // group_size,  q unsigned

GGUF Q8_0 (q8 signed, w = d*q8) becomes q = q8 + 128, offset = -128 d; Q4_0 (w = d*(q-8)) becomes
offset = -8 d; Q4_1 (w = d*q + m) is already affine. The 5-bit formats and IQ4_NL become 8-bit codes (the
packed kernel has 4- and 8-bit codes): Q5_0 (w = d*(q5-16)) q = q5 + 112, offset = -128 d (Q8_0's
centring, which PyTorch's int4 kernel needs to stay exact); Q5_1 (w = d*q5 + m) q = q5, offset = m;
IQ4_NL (w = d*table[i], a fixed 16-entry table of int8 values) q = table[i] + 128, offset = -128 d.
With d an f16 value, d*q and the offset are exact in float32, so `dequantize` reproduces
gguf.quants.dequantize bit for bit.

The K-quants Q4_K and Q5_K (super-blocks of 256: an f16 d and dmin, and per sub-block of 32 a 6-bit scale
sc and min m) are affine per 32 too: scale = d*sc, offset = -dmin*m, 4-bit or (Q5_K) 8-bit codes, decoded
exactly into float32 scales. Those products need up to 17 significant bits, so the packed kernel's float16
scales hold them rounded (`round_scales_to_f16`: each scale and offset within 2^-11 of its own size).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 32  # elements per GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL block
_BLOCK_BYTES = {"Q8_0": 2 + QK, "Q4_0": 2 + QK // 2, "Q4_1": 4 + QK // 2, "Q5_0": 6 + QK // 2, "Q5_1": 8 + QK // 2,
                "IQ4_NL": 2 + QK // 2}
QK_K = 256  # elements per K-quant super-block
_SUPER_BLOCK_BYTES = {"Q4_K": 4 + 12 + QK_K // 2, "Q5_K": 4 + 12 + QK_K // 8 + QK_K // 2}
PACKED_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 8, "Q5_1": 8, "Q8_0": 8, "IQ4_NL": 8, "Q4_K": 4, "Q5_K": 8}
ROUNDED_SCALE_TYPES = ("Q4_K", "Q5_K")  # scales exact in float32 only: rounded to float16 to run packed
# IQ4_NL's values (ggml's kvalues_iq4nl), as 8-bit codes q = value + 128.
_IQ4_NL_CODES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]) + 128


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
    if qtype not in PACKED_BITS:
        raise ValueError(f"GGUF type {qtype} has no packed kernel here; supported: {', '.join(PACKED_BITS)}")
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if not raw.flags.writeable:  # a memory-mapped GGUF; torch wants writable memory even to read
        raw = raw.copy()
    n, row_bytes = raw.shape
    if qtype in _SUPER_BLOCK_BYTES:
        return _from_k_quant(raw, qtype)
    if row_bytes % _BLOCK_BYTES[qtype]:
        raise ValueError(f"{qtype} rows must be whole blocks of {_BLOCK_BYTES[qtype]} bytes, got {row_bytes}")
    blocks = torch.from_numpy(raw).view(n, row_bytes // _BLOCK_BYTES[qtype], _BLOCK_BYTES[qtype])
    d = _f16(blocks[..., 0:2])
    if qtype == "Q8_0":
        q = (blocks[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return BlockQuant(q.reshape(n, -1), d, -128.0 * d, QK, 8)
    if qtype in ("Q5_0", "Q5_1"):
        at = 4 if qtype == "Q5_1" else 2  # after d (and m): 4 bytes of fifth bits, then the nibbles
        high = _bits_of(blocks[..., at : at + 4]) << 4  # bit j of the little-endian word: element j's fifth bit
        q = (_nibbles(blocks[..., at + 4 :]) | high).reshape(n, -1)
        if qtype == "Q5_1":
            return BlockQuant(q, d, _f16(blocks[..., 2:4]), QK, 8)
        return BlockQuant(q + 112, d, -128.0 * d, QK, 8)  # d * (q5 - 16), centred as Q8_0's codes are
    if qtype == "IQ4_NL":
        q = _IQ4_NL_CODES.to(torch.uint8)[_nibbles(blocks[..., 2:]).long()].reshape(n, -1)
        return BlockQuant(q, d, -128.0 * d, QK, 8)
    nibbles = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]
    offset = _f16(blocks[..., 2:4]) if qtype == "Q4_1" else -8.0 * d
    return BlockQuant(_nibbles(nibbles).reshape(n, -1), d, offset, QK, 4)


def _from_k_quant(raw: np.ndarray, qtype: str) -> BlockQuant:
    n, row_bytes = raw.shape
    size = _SUPER_BLOCK_BYTES[qtype]
    if row_bytes % size:
        raise ValueError(f"{qtype} rows must be whole super-blocks of {size} bytes, got {row_bytes}")
    blocks = torch.from_numpy(raw).view(n, row_bytes // size, size)
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, m = _k_scales_and_mins(blocks[..., 4:16])
    # 32 bytes of low and high nibbles per pair of sub-blocks: low ones are sub-block 2j, high ones 2j + 1.
    qs = blocks[..., size - QK_K // 2 :].reshape(n, -1, 4, 1, 32)
    q = ((qs >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0x0F).reshape(n, -1, 8, 32)
    if qtype == "Q5_K":  # bit j of byte i of the 32 high-bit bytes: sub-block j's element i
        qh = blocks[..., 16:48].reshape(n, -1, 1, 32)
        q = q | (((qh >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1) << 4)
    scale = (d.unsqueeze(-1) * sc.float()).reshape(n, -1)
    offset = -(dmin.unsqueeze(-1) * m.float()).reshape(n, -1)
    return BlockQuant(q.reshape(n, -1).contiguous(), scale, offset, QK, PACKED_BITS[qtype])


def _k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes of a Q4_K/Q5_K super-block -> its 8 sub-blocks' 6-bit scales and mins: bytes 0-3
    hold scales 0-3 (low 6 bits), 4-7 mins 0-3; scales and mins 4-7 take their low 4 bits from bytes 8-11
    and their top 2 bits from the top bits of bytes 0-3 and 4-7."""
    lo, hi, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
    m = torch.cat([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], dim=-1)
    return sc, m


def as_8_bit(bq: BlockQuant) -> BlockQuant:
    """The same weights as 8-bit codes (4-bit codes 0..15 are 8-bit ones), to fuse with 8-bit parts."""
    return BlockQuant(bq.q, bq.scale, bq.offset, bq.group_size, 8)


def round_scales_to_f16(bq: BlockQuant) -> BlockQuant:
    """The same codes with scales and offsets rounded to float16 (nearest), for the packed kernel."""
    return BlockQuant(bq.q, bq.scale.half().float(), bq.offset.half().float(), bq.group_size, bq.bits)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values: low nibbles are elements 0..15 of a block, high nibbles 16..31."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _bits_of(four_bytes: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes of a little-endian 32-bit word -> [..., 32] of its bits (uint8 0/1), bit 0 first."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((four_bytes.unsqueeze(-1) >> shifts) & 1).reshape(*four_bytes.shape[:-1], 32)


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
