"""The packed weight of the packed-weight matmul (csrc/packed_matmul.cpp): its byte layout, and packing into it.

`pack()` turns group-wise affine codes (w = scale * q + offset per group of 32 inputs, or of 16 for the
K-quants whose scales cover 16: GGUF Q4_0 / Q4_1 / Q8_0 / Q6_K ... or our own int4/int8 quantization) into
the kernel's layout, described in csrc/kvflow_cpu.h; packed_matmul.py runs it. The codes and the float16 scales
are kept exactly, so the kernel computes with the GGUF's own weights; the only rounding it adds is the
inputs' quantization to 16-bit integers per block of the weight's group (2^-16 of the block's largest input).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.kernels import abi
from kvflow.kernels.huge_pages import MIN_BYTES, HugePageArena, huge_page_zeros, onto_huge_pages

GROUP = 32  # inputs per block (one scale and offset per block and column)
GROUPS = (32, 16)  # the block sizes the kernel takes: 16 for Q6_K / Q3_K / Q2_K scales
COLUMNS = 16  # output columns side by side in one vector
BITS = (4, 6, 8)  # code widths: 6 keeps Q6_K (and 5-bit codes) at 7 bits a weight, not 9
INPUT_STEPS = 32639  # inputs are quantized per block to integers within +-INPUT_STEPS (kMaxInt in the C++)
# The codebooks of csrc/kvflow_cpu.h: nibble i of a weight with codebook b stands for 8-bit code CODEBOOKS[b][i]
# (centred on 128): IQ4_NL's values (ggml's kvalues_iq4nl), MXFP4's doubled E2M1 values.
CODEBOOKS = {book: (torch.tensor(values) + 128).to(torch.uint8) for book, values in (
    (1, [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]),
    (2, [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]))}


def _code_index(book: torch.Tensor) -> torch.Tensor:
    """[256] int64: the index of each 8-bit code in the codebook (its first, for MXFP4's two zeros), or -1."""
    index = torch.full((256,), -1, dtype=torch.int64)
    for i in reversed(range(16)):
        index[int(book[i])] = i
    return index


_CODE_INDEX = {book: _code_index(codes) for book, codes in CODEBOOKS.items()}


@dataclass
class PackedWeight:
    data: torch.Tensor  # uint8 [groups, blocks, chunk bytes]
    n: int
    k: int
    bits: int
    has_offset: bool
    group: int = GROUP  # inputs per block
    centre: int = 0  # no stored offsets: offset = -centre * scale (symmetric codes), or none where 0
    on_huge_pages: bool = False  # already in a huge-page buffer of its own (move_to_huge_pages skips it)
    # Q4_K / Q5_K kept with their own scales (csrc/kvflow_cpu.h): uint8 [groups, k // 256 * 64], d and dmin
    # per 256 inputs; each block's bytes then hold sc and m bytes instead of float16 scales and offsets.
    super_scales: torch.Tensor | None = field(default=None, repr=False)
    codebook: int = 0  # 4-bit indices into CODEBOOKS[codebook] (IQ4_NL/IQ4_XS 1, MXFP4 2), or 0: plain codes
    struct: abi.KvflowPackedWeight = field(init=False, repr=False)  # what the C++ kernels read

    def __post_init__(self) -> None:
        self.struct = abi.KvflowPackedWeight(
            data=self.data.data_ptr(), n=self.n, k=self.k, bits=self.bits, has_offset=int(self.has_offset),
            block=self.group, centre=self.centre,
            super_scales=None if self.super_scales is None else self.super_scales.data_ptr(), codebook=self.codebook)

    @property
    def code_bytes(self) -> int:
        return self.group * COLUMNS * self.bits // 8

    def nbytes(self) -> int:
        return self.data.numel() + (0 if self.super_scales is None else self.super_scales.numel())


def move_to_huge_pages(weights: list[PackedWeight]) -> None:
    """Put the weights' bytes side by side on huge pages (kernels/huge_pages), in the order given: a decode
    step streams every one of them, and on 4 KiB pages each page costs a TLB miss. Weights packed onto
    huge pages already (pack_gguf, for those of a huge page or more) stay where they are."""
    weights = [pw for pw in weights if not pw.on_huge_pages]
    for pw, data in zip(weights, onto_huge_pages([pw.data for pw in weights])):
        if data is not pw.data:
            pw.data = data
            pw.struct.data = data.data_ptr()  # the struct the C++ kernels read points at the new bytes


def _f16_exact(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.half().float(), t)) and bool(torch.isfinite(t.half()).all())


def can_pack(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int, bits: int,
             centre: int = 0, codebook: int = 0) -> bool:
    """Whether `pack` keeps these codes exactly: groups of 32 or 16, codes within `bits` (4, 6 or 8) or each
    an entry of `codebook`, scales and offsets exact in float16 (a centred weight's offsets are -centre * scale,
    not stored)."""
    if group_size not in GROUPS or q.shape[1] % group_size or bits not in BITS or codebook not in (0, *CODEBOOKS):
        return False
    if codebook and (centre != 128 or not bool(_CODE_INDEX[codebook][q.long()].ge(0).all())):
        return False
    if bits < 8 and q.numel() and int(q.max()) >= 1 << bits:
        return False
    return _f16_exact(scale) and (_f16_exact(offset) if not centre else torch.equal(offset, -centre * scale))


def pack(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int, bits: int,
         centre: int = 0, codebook: int = 0) -> PackedWeight:
    """The kernel's layout for codes q uint8 [n, k] with scale and offset float32 [n, k // group_size];
    with centre (symmetric codes: offset = -centre * scale) the offsets are not stored; with codebook (q
    that codebook's 8-bit codes) each code is stored as its 4-bit index. Raises ValueError where `can_pack`
    is false."""
    if not can_pack(q, scale, offset, group_size, bits, centre, codebook):
        raise ValueError("packed matmul needs groups of 32 or 16 inputs, codes within their width and float16-exact "
                         "scales and offsets")
    if codebook:
        q, bits = _CODE_INDEX[codebook][q.long()].to(torch.uint8), 4
    n, k = q.shape
    groups, blocks = -(-n // COLUMNS), k // group_size
    rows = group_size // (4 if bits == 8 else 8)  # 64-byte code rows per block (of nibbles, below 8 bits)
    pad = groups * COLUMNS - n
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scale = torch.cat([scale, scale.new_zeros(pad, blocks)])
        offset = torch.cat([offset, offset.new_zeros(pad, blocks)])
    if bits < 8:
        # input k = 8 row + 4 half + t -> byte (row, column, t): half 0 in the low nibble, 1 in the high
        q6 = (q & 0x0F).view(groups, COLUMNS, blocks, rows, 2, 4).permute(0, 2, 3, 4, 1, 5)
        codes = (q6[:, :, :, 0] | (q6[:, :, :, 1] << 4)).reshape(groups, blocks, 64 * rows)
        if bits == 6:  # then the top two bits: input k = 16 row + 4 i + t -> bits 2 i of byte (row, column, t)
            top = (q >> 4).view(groups, COLUMNS, blocks, rows // 2, 4, 4).permute(0, 2, 3, 1, 5, 4)
            top = top[..., 0] | (top[..., 1] << 2) | (top[..., 2] << 4) | (top[..., 3] << 6)
            codes = torch.cat([codes, top.reshape(groups, blocks, 32 * rows)], dim=-1)
    else:  # input k = 4 row + t -> byte (row, column, t)
        codes = q.view(groups, COLUMNS, blocks, rows, 4).permute(0, 2, 3, 1, 4).reshape(groups, blocks, 64 * rows)
    has_offset = not centre and bool(offset.any())

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [n, blocks] float -> [groups, blocks, 32 bytes]
        return t.half().view(groups, COLUMNS, blocks).permute(0, 2, 1).contiguous().view(torch.uint8)

    parts = [codes, per_block(scale)] + ([per_block(offset)] if has_offset else [])
    data = torch.cat(parts, dim=-1).contiguous()
    return PackedWeight(data, n, k, bits, has_offset, group_size, centre, codebook=codebook)


def split_rows(pw: PackedWeight, rows: int) -> list[PackedWeight] | None:
    """Views of a weight's consecutive blocks of `rows` output rows as weights of their own (a MoE layer's
    experts, packed in one call), or None where a block would not start on a column group."""
    if rows % COLUMNS or pw.n % rows:
        return None
    each = rows // COLUMNS
    supers = pw.super_scales
    return [PackedWeight(pw.data[i * each : (i + 1) * each], rows, pw.k, pw.bits, pw.has_offset, pw.group, pw.centre,
                         on_huge_pages=pw.on_huge_pages, codebook=pw.codebook,
                         super_scales=None if supers is None else supers[i * each : (i + 1) * each])
            for i in range(pw.n // rows)]


SMALL_WEIGHTS = HugePageArena()  # where pack_gguf puts weights under a huge page each, in the order packed
# GGUF Q4_K and Q5_K (ggml type ids): packed with their own scales (PackedWeight.super_scales) by pack_gguf.
OWN_SCALE_TYPES = (12, 13)
SUPER_INPUTS = 256  # inputs per d and dmin of those types


PACK_CACHE = None  # a loader/packed_cache.PackedCache while a load replays or records its pack calls


def start_arena() -> None:
    """A fresh arena for one model's small weights: they then sit side by side from a huge-page boundary,
    in the order the load packs them (a step's reading order)."""
    global SMALL_WEIGHTS
    SMALL_WEIGHTS = HugePageArena()


@contextlib.contextmanager
def packing_through(cache) -> Iterator[None]:
    """pack_gguf calls inside take their bytes from `cache` where it holds them, and give it the rest."""
    global PACK_CACHE
    PACK_CACHE = cache
    try:
        yield
    finally:
        PACK_CACHE = None


def pack_gguf(parts: list[tuple[np.ndarray, int, torch.Tensor | None]], bits: int, group: int,
              centre: int = 0, codebook: int = 0) -> PackedWeight | None:
    """GGUF tensors (block bytes [rows, bytes] from the mapped file, ggml type id, row order or None) fused
    along the output dim straight into the layout (csrc/gguf_repack.cpp): the bytes `pack` makes from
    packing.from_gguf's codes with float16-rounded scales, without the float32 temporaries. None where the
    packer refuses them (sizes that disagree with a type, a scale or offset not finite in float16): the
    caller then takes the checked Python path, which says what is wrong or keeps the weights another way.
    centre: every part's symmetric centre (packing.CENTRES), its offsets then not stored; or 0. codebook:
    every part's (packing.CODEBOOK_OF), its nibbles then kept as indices (bits 4); or 0."""
    orders = [None if order is None else order.to(torch.int64).contiguous() for _, _, order in parts]
    arrays = [np.ascontiguousarray(raw) for raw, _, _ in parts]  # views of the mapping: no copy
    structs = (abi.KvflowGgufPart * len(parts))(*[
        abi.KvflowGgufPart(data=raw.ctypes.data, rows=raw.shape[0], row_bytes=raw.shape[1], type=qtype,
                           row_order=None if order is None else order.data_ptr())
        for raw, (_, qtype, _), order in zip(arrays, parts, orders)])
    n, k = sum(raw.shape[0] for raw in arrays), _inputs(arrays[0], parts[0][1])
    own_scales = group == GROUP and not centre and k % SUPER_INPUTS == 0 and all(
        qtype in OWN_SCALE_TYPES for _, qtype, _ in parts)
    shape = (-(-n // COLUMNS), k // group, group * COLUMNS * bits // 8 + (32 if centre or own_scales else 64))
    signature = [n, k, bits, group, centre, own_scales, codebook, [[qtype, *raw.shape, _order_digest(order)]
                                                         for raw, (_, qtype, _), order in zip(arrays, parts, orders)]]
    cached = None if PACK_CACHE is None else PACK_CACHE.take(signature)
    if cached is not None:  # the same call's bytes from an earlier load, mapped (loader/packed_cache.py)
        return None if not cached.ok else PackedWeight(
            cached.data, n, k, bits, not centre, group, centre, super_scales=cached.supers, codebook=codebook,
            on_huge_pages=True)  # stays on the file's pages: a copy would cost what the mapping saves
    nbytes = shape[0] * shape[1] * shape[2]
    # Written once, in place, on huge pages (a small weight on pages it shares): no copy onto them later.
    small = SMALL_WEIGHTS.zeros(nbytes)
    data = (huge_page_zeros(nbytes) if small is None else small).view(shape)
    supers = torch.zeros(shape[0], k // SUPER_INPUTS * 64, dtype=torch.uint8) if own_scales else None
    rc = abi.native().kvflow_pack_gguf(parts=structs, count=len(parts), k=k, bits=bits, block=group, centre=centre,
                                       codebook=codebook, out=data.data_ptr(), super_out=None if supers is None else supers.data_ptr(),
                                       num_threads=torch.get_num_threads())
    if PACK_CACHE is not None:
        PACK_CACHE.add(signature, rc == 0, data if rc == 0 else None, supers if rc == 0 else None)
    pw = PackedWeight(data, n, k, bits, not centre, group, centre, codebook=codebook,
                      on_huge_pages=small is not None or nbytes >= MIN_BYTES, super_scales=supers)
    return pw if rc == 0 else None


def _order_digest(order: torch.Tensor | None) -> str | None:
    return None if order is None else hashlib.blake2b(order.numpy().tobytes(), digest_size=8).hexdigest()


def _inputs(raw: np.ndarray, qtype: int) -> int:
    import gguf

    elements, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    return raw.shape[1] // block_bytes * elements


def codes(pw: PackedWeight, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stored weights as (q float32 [R, k], scale, offset float32 [R, k // group]) for output rows
    `rows` (default all): w = scale * q + offset."""
    groups, blocks, _ = pw.data.shape
    code_rows = pw.group // (4 if pw.bits == 8 else 8)
    rows = torch.arange(pw.n) if rows is None else rows.reshape(-1)
    chunk = pw.data[rows // COLUMNS]  # [R, blocks, bytes]
    col = rows % COLUMNS
    picked = torch.arange(len(rows))
    code = chunk[..., : pw.code_bytes]
    if pw.bits < 8:
        mine = code[..., : 64 * code_rows].reshape(-1, blocks, code_rows, COLUMNS, 4)[picked, :, :, col]
        # [R, blocks, row, half, t]: input 8 row + 4 half + t of the block
        q = torch.stack([mine & 0x0F, mine >> 4], dim=3).reshape(len(rows), blocks, pw.group)
        if pw.bits == 6:  # the top two bits of input 16 row + 4 i + t: bits 2 i of byte (row, t)
            top = code[..., 64 * code_rows :].reshape(-1, blocks, code_rows // 2, COLUMNS, 4)[picked, :, :, col]
            pairs = torch.stack([(top >> (2 * i)) & 3 for i in range(4)], dim=3)  # [R, blocks, row, i, t]
            q = q | (pairs.reshape(len(rows), blocks, pw.group) << 4)
        if pw.codebook:
            q = CODEBOOKS[pw.codebook][q.long()]
        q = q.float()
    else:
        q = code.view(-1, blocks, code_rows, COLUMNS, 4)[picked, :, :, col].float()  # [R, blocks, row, t]
    q = q.reshape(len(rows), pw.k)

    def per_block(start: int) -> torch.Tensor:
        raw = chunk[..., start : start + 32].contiguous().view(torch.float16)  # [R, blocks, 16]
        return raw[picked, :, col].float()

    if pw.super_scales is not None:  # d * sc and -(dmin * m), each exact in float32
        def sub(start: int) -> torch.Tensor:  # [R, blocks] of the column's sc (or m) bytes
            return chunk[..., start : start + COLUMNS][picked, :, col].float()

        halves = pw.super_scales[rows // COLUMNS].view(len(rows), -1, 2, COLUMNS, 2)  # [R, supers, d|dmin, col, 2]
        pairs = halves[picked, :, :, col].contiguous().view(torch.float16).float()  # [R, supers, 2, 1]
        per_sub = SUPER_INPUTS // pw.group
        d = pairs[:, :, 0, 0].repeat_interleave(per_sub, dim=1)
        dmin = pairs[:, :, 1, 0].repeat_interleave(per_sub, dim=1)
        return q, d * sub(pw.code_bytes), -(dmin * sub(pw.code_bytes + COLUMNS))
    scale = per_block(pw.code_bytes)
    offset = per_block(pw.code_bytes + 32) if pw.has_offset else -pw.centre * scale
    return q, scale, offset


def dequantize(pw: PackedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [R, k]: the weights the kernel multiplies by (one float32 rounding per weight)."""
    q, scale, offset = codes(pw, rows)
    w = q.view(q.shape[0], -1, pw.group) * scale.unsqueeze(-1) + offset.unsqueeze(-1)
    return w.view(q.shape[0], pw.k)
