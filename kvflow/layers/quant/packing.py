"""GGUF block formats -> one unpacked form, `BlockQuant`, from which the packed linear layers are built.

Every format here is an affine code per group of `group_size` inputs along a row:

    w[n, k] = scale[n, g] * q[n, k] + offset[n, g],   g = k // group_size,  q unsigned

GGUF Q8_0 (q8 signed, w = d*q8) becomes q = q8 + 128, offset = -128 d; Q4_0 (w = d*(q-8)) becomes
offset = -8 d; Q4_1 (w = d*q + m) is already affine. The 5-bit formats and the table types are held as 8-bit codes
(the packed kernel stores the 5-bit ones in its 6-bit layout: LAYOUT_BITS): Q5_0 (w = d*(q5-16)) q = q5,
offset = -16 d, centre 16 (centred_at_128 shifts it to Q8_0's centring for PyTorch's int8 kernels); Q5_1
(w = d*q5 + m) q = q5, offset = m; IQ4_NL (w = d*table[i], a fixed 16-entry table of int8 values)
q = table[i] + 128, offset = -128 d; MXFP4 (w = 2^(e-128) * table[i], its E2M1 values doubled, e an E8M0
exponent) likewise. The table types' codes are all entries of their codebook (`codebook`), so the packed
kernel stores each as its 4-bit index (kernels/packed_weight.CODEBOOKS): 4.5 bits a weight, not 8.5.
With d an f16 value, d*q and the offset are exact in float32, so `dequantize` reproduces
gguf.quants.dequantize bit for bit.

The K-quants (super-blocks of 256 with an f16 d, and dmin where there are mins) are affine per sub-block:
- Q4_K, Q5_K: per 32, a 6-bit scale sc and min m: scale = d*sc, offset = -dmin*m; 4-bit or (Q5_K) 8-bit codes.
- Q6_K: per 16, an int8 scale: w = d*sc*(q6-32), 8-bit codes q6, offset = -32 scale.
- Q3_K: per 16, a 6-bit scale: w = d*(sc-32)*(q3-4), 4-bit codes q3, offset = -4 scale.
- Q2_K: per 16, a 4-bit scale and min: w = d*sc*q2 - dmin*m, 4-bit codes.
- IQ4_XS: per 32, a 6-bit scale: w = d*(ls-32)*table[i], IQ4_NL's codes.
Their scales are decoded exactly into float32; those products need up to 19 significant bits, so the packed
kernel's float16 scales hold them rounded (`round_scales_to_f16`: each within 2^-11 of its own size).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvflow.kernels.packed_weight import CODEBOOKS

QK = 32  # elements per GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL block
_BLOCK_BYTES = {"Q8_0": 2 + QK, "Q4_0": 2 + QK // 2, "Q4_1": 4 + QK // 2, "Q5_0": 6 + QK // 2, "Q5_1": 8 + QK // 2,
                "IQ4_NL": 2 + QK // 2, "MXFP4": 1 + QK // 2}
QK_K = 256  # elements per K-quant super-block
_SUPER_BLOCK_BYTES = {"Q4_K": 4 + 12 + QK_K // 2, "Q5_K": 4 + 12 + QK_K // 8 + QK_K // 2,
                      "Q6_K": QK_K // 2 + QK_K // 4 + QK_K // 16 + 2, "Q3_K": QK_K // 8 + QK_K // 4 + 12 + 2,
                      "Q2_K": QK_K // 16 + QK_K // 4 + 4, "IQ4_XS": 4 + QK_K // 64 + QK_K // 2}
PACKED_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 8, "Q5_1": 8, "Q8_0": 8, "IQ4_NL": 8, "Q4_K": 4, "Q5_K": 8,
               "Q6_K": 8, "Q3_K": 4, "Q2_K": 4, "IQ4_XS": 8, "MXFP4": 8}
# The packed kernel's code width per type, where it differs from the codes above: 6 bits hold Q6_K's codes
# and the 5-bit ones (Q5_0, Q5_1, Q5_K), 6.5 to 7 bits a weight with their scales, not 8.5 to 9 as 8-bit
# codes. (A fused layer whose parts need two layouts keeps two packed weights: layers/quant/packed_parts.py.)
LAYOUT_BITS = {**PACKED_BITS, "Q5_0": 6, "Q5_1": 6, "Q5_K": 6, "Q6_K": 6}
# The symmetric types' centre c: w = scale * (q - c), so offset = -c * scale is not stored (the packed
# kernel derives it, exactly). The others (Q4_1, Q5_1, Q4_K, Q5_K, Q2_K) have free offsets (mins).
CENTRES = {"Q8_0": 128, "Q5_0": 16, "IQ4_NL": 128, "IQ4_XS": 128, "MXFP4": 128, "Q4_0": 8, "Q6_K": 32, "Q3_K": 4}
# The table types' codebooks (kernels/packed_weight.CODEBOOKS): their 8-bit codes are always one of 16 values.
CODEBOOK_OF = {"IQ4_NL": 1, "IQ4_XS": 1, "MXFP4": 2}
GROUP_16_TYPES = ("Q6_K", "Q3_K", "Q2_K")  # a scale per 16 inputs; every other type has one per 32
ROUNDED_SCALE_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS")  # exact in float32 only: rounded to f16


@dataclass
class BlockQuant:
    """Unpacked group-wise affine weights: q uint8 [N, K], scale and offset float32 [N, K // group_size]."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group_size: int
    bits: int  # 4 (q in 0..15) or 8 (q in 0..255)
    centre: int = 0  # offset = -centre * scale for every group (symmetric codes), or 0: offsets free
    codebook: int = 0  # every code is an entry of CODEBOOKS[codebook] (the table types), or 0

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: each weight's exact value rounded once, as gguf.quants.dequantize gives it (the
        sums are exact in float64: a scale's 19 bits times an 8-bit code)."""
        n, k = self.q.shape
        q = self.q.view(n, k // self.group_size, self.group_size).double()
        w = q * self.scale.double().unsqueeze(-1) + self.offset.double().unsqueeze(-1)
        return w.view(n, k).float()


def from_gguf(raw: np.ndarray, qtype: str) -> BlockQuant:
    """Decode GGUF block bytes, shaped [out, bytes_per_row] as gguf.GGUFReader gives them."""
    if qtype not in PACKED_BITS:
        raise ValueError(f"GGUF type {qtype} has no packed kernel here; supported: {', '.join(PACKED_BITS)}")
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if not raw.flags.writeable:  # a memory-mapped GGUF; torch wants writable memory even to read
        raw = raw.copy()
    bq = _from_k_quant(raw, qtype) if qtype in _SUPER_BLOCK_BYTES else _from_blocks(raw, qtype)
    bq.centre = CENTRES.get(qtype, 0)
    bq.codebook = CODEBOOK_OF.get(qtype, 0)
    return bq


def _from_blocks(raw: np.ndarray, qtype: str) -> BlockQuant:
    n, row_bytes = raw.shape
    if row_bytes % _BLOCK_BYTES[qtype]:
        raise ValueError(f"{qtype} rows must be whole blocks of {_BLOCK_BYTES[qtype]} bytes, got {row_bytes}")
    blocks = torch.from_numpy(raw).view(n, row_bytes // _BLOCK_BYTES[qtype], _BLOCK_BYTES[qtype])
    if qtype == "MXFP4":  # e, then nibbles as Q4_0's; 2^(e - 128) is exact in float32 for every e
        d = torch.ldexp(torch.ones(blocks.shape[:-1]), blocks[..., 0].to(torch.int32) - 128)
        q = CODEBOOKS[2][_nibbles(blocks[..., 1:]).long()].reshape(n, -1)
        return BlockQuant(q, d, -128.0 * d, QK, 8)
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
        return BlockQuant(q, d, -16.0 * d, QK, 8)  # d * (q5 - 16)
    if qtype == "IQ4_NL":
        q = CODEBOOKS[1][_nibbles(blocks[..., 2:]).long()].reshape(n, -1)
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
    decode = {"Q6_K": _q6_k, "Q3_K": _q3_k, "Q2_K": _q2_k, "IQ4_XS": _iq4_xs}.get(qtype, _q4_k_or_q5_k)
    q, scale, offset, group = decode(blocks, qtype)
    return BlockQuant(q.reshape(n, -1).contiguous(), scale.reshape(n, -1), offset.reshape(n, -1), group,
                      PACKED_BITS[qtype])


def _q4_k_or_q5_k(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    n, size = blocks.shape[0], blocks.shape[-1]
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, m = _k_scales_and_mins(blocks[..., 4:16])
    # 32 bytes of low and high nibbles per pair of sub-blocks: low ones are sub-block 2j, high ones 2j + 1.
    qs = blocks[..., size - QK_K // 2 :].reshape(n, -1, 4, 1, 32)
    q = ((qs >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0x0F).reshape(n, -1, 8, 32)
    if qtype == "Q5_K":  # bit j of byte i of the 32 high-bit bytes: sub-block j's element i
        qh = blocks[..., 16:48].reshape(n, -1, 1, 32)
        q = q | (((qh >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1) << 4)
    return q, d.unsqueeze(-1) * sc.float(), -(dmin.unsqueeze(-1) * m.float()), QK


def _q6_k(blocks: torch.Tensor, _: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d. Element 128 h + 64 nib + 32 w + l
    (per half h) is nibble `nib` of low byte 64 h + 32 w + l and bit pair 2 nib + w of high byte 32 h + l."""
    n = blocks.shape[0]
    ql = blocks[..., 0:128].reshape(n, -1, 2, 1, 2, 32)  # [.., half, -, w, l]
    qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 1, 32)
    nib = torch.tensor([0, 4], dtype=torch.uint8).view(2, 1, 1)
    pair = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8).view(2, 2, 1)  # [nib, w]
    q = ((ql >> nib) & 0x0F) | (((qh >> pair) & 3) << 4)  # [.., half, nib, w, l]
    scale = _f16(blocks[..., 208:210]).unsqueeze(-1) * blocks[..., 192:208].view(torch.int8).float()
    return q, scale, -32.0 * scale, 16


def _low_2_bit_planes(qs: torch.Tensor) -> torch.Tensor:
    """[.., 64] bytes of 2-bit codes -> [.., 256]: element 128 h + 32 j + l is bits 2j of byte 32 h + l."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    return (qs.reshape(*qs.shape[:-1], 2, 1, 32) >> shifts) & 3  # [.., half, j, l]


def _q3_k(blocks: torch.Tensor, _: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """32 bytes of high bits (bit 4 h + j of byte l: element 128 h + 32 j + l), 64 of low bit pairs, 12 bytes
    of 6-bit scales, d."""
    n = blocks.shape[0]
    low = _low_2_bit_planes(blocks[..., 32:96])
    hm = blocks[..., 0:32].reshape(n, -1, 1, 1, 32)
    high = (hm >> torch.arange(8, dtype=torch.uint8).view(2, 4, 1)) & 1  # [.., half, j, l]
    q = low | (high << 2)
    packed = blocks[..., 96:108]  # scale s: low 4 bits from byte s % 8 (high nibble for s >= 8), top 2 bits
    low4 = torch.cat([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], dim=-1)  # from byte 8 + s % 4
    top2 = (packed[..., 8:12].unsqueeze(-2) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3
    sc = (low4 | (top2.reshape(*low4.shape) << 4)).float() - 32.0
    scale = _f16(blocks[..., 108:110]).unsqueeze(-1) * sc
    return q, scale, -4.0 * scale, 16


def _q2_k(blocks: torch.Tensor, _: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """16 bytes of (4-bit scale, 4-bit min) per 16, 64 bytes of 2-bit codes, d, dmin."""
    sc = blocks[..., 0:16]
    d, dmin = _f16(blocks[..., 80:82]).unsqueeze(-1), _f16(blocks[..., 82:84]).unsqueeze(-1)
    return _low_2_bit_planes(blocks[..., 16:80]), d * (sc & 0x0F).float(), -(dmin * (sc >> 4).float()), 16


def _iq4_xs(blocks: torch.Tensor, _: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """d, 2 bytes of the scales' top bit pairs, 4 bytes of their low nibbles, then IQ4_NL's nibbles per 32."""
    n = blocks.shape[0]
    low = torch.stack([blocks[..., 4:8] & 0x0F, blocks[..., 4:8] >> 4], dim=-1).reshape(n, -1, 8)
    high = _bits_of(torch.cat([blocks[..., 2:4], torch.zeros_like(blocks[..., 2:4])], dim=-1))[..., :16]
    top = high.reshape(n, -1, 8, 2)
    ls = (low | (top[..., 0] << 4) | (top[..., 1] << 5)).float() - 32.0
    q = CODEBOOKS[1][_nibbles(blocks[..., 8:].reshape(n, -1, 8, 16)).long()]
    scale = _f16(blocks[..., 0:2]).unsqueeze(-1) * ls
    return q, scale, -128.0 * scale, QK


def _k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes of a Q4_K/Q5_K super-block -> its 8 sub-blocks' 6-bit scales and mins: bytes 0-3
    hold scales 0-3 (low 6 bits), 4-7 mins 0-3; scales and mins 4-7 take their low 4 bits from bytes 8-11
    and their top 2 bits from the top bits of bytes 0-3 and 4-7."""
    lo, hi, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
    m = torch.cat([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], dim=-1)
    return sc, m


def packed_form(qtypes: list[str]) -> tuple[int, int, int, int]:
    """(bits, group, centre, codebook) of one packed layer fused from tensors of these types: the widest
    part's code width (LAYOUT_BITS; 4-bit indices where every part shares a codebook), blocks of 16 if any
    part's scales cover 16, the parts' common centre (or 0) and common codebook (or 0)."""
    centres, books = {CENTRES.get(q, 0) for q in qtypes}, {CODEBOOK_OF.get(q, 0) for q in qtypes}
    book = books.pop() if len(books) == 1 else 0
    return (4 if book else max(LAYOUT_BITS[q] for q in qtypes), 16 if any(q in GROUP_16_TYPES for q in qtypes) else 32,
            centres.pop() if len(centres) == 1 else 0, book)


def centred_at_128(bq: BlockQuant) -> BlockQuant:
    """Symmetric 8-bit-held codes of another centre (Q5_0's 16) as codes centred on 128, Q8_0's: the same
    weights, scale * (q - c) = scale * (q + 128 - c - 128), for kernels that take only that centring."""
    if not bq.centre or bq.centre == 128 or bq.bits != 8:
        return bq
    return BlockQuant((bq.q.to(torch.int16) + 128 - bq.centre).to(torch.uint8), bq.scale, -128.0 * bq.scale,
                      bq.group_size, 8, 128)  # codebook: none (Q5_0's codes come from none)


def as_8_bit(bq: BlockQuant) -> BlockQuant:
    """The same weights as 8-bit codes (4-bit codes 0..15 are 8-bit ones), to fuse with 8-bit parts."""
    return BlockQuant(bq.q, bq.scale, bq.offset, bq.group_size, 8, bq.centre, bq.codebook)


def with_group(bq: BlockQuant, group_size: int) -> BlockQuant:
    """The same weights with scales per `group_size` inputs, a divisor of the current group (each scale
    repeated), to fuse with parts of smaller groups (a Q4_K q beside a Q6_K v)."""
    if bq.group_size % group_size:
        raise ValueError(f"groups of {bq.group_size} cannot be split into groups of {group_size}")
    times = bq.group_size // group_size
    return BlockQuant(bq.q, bq.scale.repeat_interleave(times, dim=1), bq.offset.repeat_interleave(times, dim=1),
                      group_size, bq.bits, bq.centre, bq.codebook)


def round_scales_to_f16(bq: BlockQuant) -> BlockQuant:
    """The same codes with scales and offsets rounded to float16 (nearest), for the packed kernel; a centred
    weight's offsets stay -centre * scale (of the rounded scale: the kernel derives them so)."""
    scale = bq.scale.half().float()
    offset = -bq.centre * scale if bq.centre else bq.offset.half().float()
    return BlockQuant(bq.q, scale, offset, bq.group_size, bq.bits, bq.centre, bq.codebook)


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
        first.centre if all(p.centre == first.centre for p in parts) else 0,
        first.codebook if all(p.codebook == first.codebook for p in parts) else 0,
    )


def permute_rows(bq: BlockQuant, index: torch.Tensor) -> BlockQuant:
    """Reorder output rows: row i of the result is row index[i]. Groups run along the input dim, so
    a row permutation moves whole rows of q, scale and offset together."""
    return BlockQuant(bq.q[index], bq.scale[index], bq.offset[index], bq.group_size, bq.bits, bq.centre, bq.codebook)


def unpermute_rope_index(n_rows: int, n_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k rope permutation (same as loader.gguf_file.unpermute_rope)."""
    rows = torch.arange(n_rows)
    return rows.reshape(n_heads, n_rows // n_heads // 2, 2).transpose(1, 2).reshape(n_rows)
