"""PyTorch's CPU int4 weight format (`_convert_weight_to_int4pack_for_cpu`) and the ways we read it.

The kernel `_weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)` dequantizes
    w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]      (float32 FMA, scale and zero in x's dtype)
with scales_and_zeros [K // group_size, N, 2]. Only bfloat16 activations get a vectorized kernel on x86
(float32 falls to a scalar loop, far slower), so scales and zeros are stored in bfloat16.
An affine code w = s*q + o maps exactly onto it with scale = s and zero = o + 8 s.

For prefill and for embedding rows we also read the packed bytes directly. The packing interleaves rows
in blocks of B rows: B = 64 with AVX-512, 32 with AVX2 ("halves": byte j of a block holds row j in its low
nibble and row B/2 + j in its high nibble), 16 and ("pairs": rows 2j, 2j+1) elsewhere. `layout()` finds
which one this build uses by packing a probe once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

aten = torch.ops.aten


@dataclass
class Int4Pack:
    packed: torch.Tensor  # uint8, PyTorch's layout for N_pad x K
    scales_zeros: torch.Tensor  # bfloat16 [K // group_size, N_pad, 2], for the kernel
    out_features: int  # N before padding
    group_size: int

    @property
    def in_features(self) -> int:
        return self.scales_zeros.shape[0] * self.group_size

    @property
    def padded_out(self) -> int:
        return self.scales_zeros.shape[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_zeros))

    def scale_offset(self, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 [K // group_size, len(rows)] each: the kernel's weights as w = scale * q + offset."""
        sz = self.scales_zeros[:, rows].float()
        scale = sz[..., 0]
        return scale, sz[..., 1] - 8.0 * scale


def pack_int4(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int) -> Int4Pack:
    """q uint8 [N, K] in 0..15, scale/offset float32 [N, K // group_size]: w = scale * q + offset."""
    n, k = q.shape
    if group_size not in (32, 64, 128, 256) or k % group_size:
        raise ValueError(f"int4 kernel needs group size 32/64/128/256 dividing K={k}, got {group_size}")
    block, _ = layout()
    pad = -n % block  # whole interleave blocks keep one layout for every row
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
        offset = torch.cat([offset, offset.new_zeros(pad, offset.shape[1])])
    packed = aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    scale_bf16 = scale.t().to(torch.bfloat16)
    zero = (offset + 8.0 * scale).t().to(torch.bfloat16)
    scales_zeros = torch.stack([scale_bf16, zero], dim=-1).contiguous()
    return Int4Pack(packed, scales_zeros, n, group_size)


def int4_mm(x: torch.Tensor, p: Int4Pack) -> torch.Tensor:
    """x bfloat16 [M, K] contiguous -> bfloat16 [M, N_pad]."""
    return aten._weight_int4pack_mm_for_cpu(x, p.packed, p.group_size, p.scales_zeros)


def nibbles_t(p: Int4Pack, start: int, stop: int) -> torch.Tensor:
    """q (uint8 0..15) transposed, [K, stop - start], for padded rows start:stop on block boundaries."""
    block, mode = layout()
    k = p.in_features
    half = block // 2
    view = p.packed.view(-1, k, half)[start // block : stop // block].permute(1, 0, 2)  # [K, nb, B/2]
    out = torch.empty(k, view.shape[1], block, dtype=torch.uint8)
    if mode == "halves":
        torch.bitwise_and(view, 0x0F, out=out[..., :half])
        torch.bitwise_right_shift(view, 4, out=out[..., half:])
    else:
        torch.bitwise_and(view, 0x0F, out=out[..., 0::2])
        torch.bitwise_right_shift(view, 4, out=out[..., 1::2])
    return out.view(k, stop - start)


def dequantize_t(
    p: Int4Pack, start: int, stop: int, scale: torch.Tensor, offset: torch.Tensor, q: torch.Tensor | None = None
) -> torch.Tensor:
    """W^T bfloat16 [K, stop - start] = scale * q + offset, one rounding; q defaults to this pack's rows
    start:stop (multiples of the block size); scale and offset are [K // group_size, stop - start]."""
    k, g = p.in_features, p.group_size
    q = nibbles_t(p, start, stop) if q is None else q
    q = q.view(k // g, g, stop - start).to(torch.bfloat16)
    out = torch.addcmul(offset.to(torch.bfloat16).unsqueeze(1), q, scale.to(torch.bfloat16).unsqueeze(1))
    return out.view(k, stop - start)


def gather_nibbles(p: Int4Pack, rows: torch.Tensor) -> torch.Tensor:
    """q (uint8 0..15) of the given padded rows, [len(rows), K] (embedding lookups)."""
    block, mode = layout()
    k = p.in_features
    blocks = p.packed.view(-1, k, block // 2)[rows // block]  # [R, K, B/2]
    j = rows % block
    if mode == "halves":
        col, high = j % (block // 2), j >= block // 2
    else:
        col, high = j // 2, (j % 2) == 1
    byte = blocks.gather(2, col.view(-1, 1, 1).expand(-1, k, 1)).squeeze(2)
    return torch.where(high.view(-1, 1), byte >> 4, byte & 0x0F)


_layout: tuple[int, str] | None = None  # a plain global rather than functools.cache: torch.compile reads it


def layout() -> tuple[int, str]:
    """(rows per interleave block, 'halves' | 'pairs') of this build's int4 packing, found by a probe."""
    global _layout
    if _layout is None:
        _layout = _probe_layout()
    return _layout


def _probe_layout() -> tuple[int, str]:
    probe = torch.randint(0, 16, (64, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = aten._convert_weight_to_int4pack_for_cpu(probe, 1).view(-1)
    for block in (64, 32, 16):
        view = packed.view(64 // block, 64, block // 2)
        lo, hi = (view & 0x0F).int(), (view >> 4).int()
        halves = torch.cat([lo, hi], -1)
        pairs = torch.stack([lo, hi], -1).flatten(-2)
        for mode, rows in (("halves", halves), ("pairs", pairs)):
            if torch.equal(rows.permute(0, 2, 1).reshape(64, 64), probe):
                return block, mode
    raise RuntimeError("unrecognised int4 weight packing in this PyTorch build")
