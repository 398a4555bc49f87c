"""Pick the packed layer for a set of codes, and build one from GGUF tensors (fused and unpermuted)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

import gguf
import numpy as np
import torch

from kvflow.kernels import packed_matmul, packed_weight
from kvflow.layers.quant.base import QuantLinear
from kvflow.layers.quant.int4_linear import Int4Linear
from kvflow.layers.quant.int8_block_linear import Int8BlockLinear
from kvflow.layers.quant.int8_linear import Int8Linear
from kvflow.layers.quant.packed_linear import PackedLinear
from kvflow.layers.quant.packed_parts import PackedParts
from kvflow.layers.quant.packing import (
    ROUNDED_SCALE_TYPES,
    BlockQuant,
    as_8_bit,
    centred_at_128,
    concat_rows,
    from_gguf,
    packed_form,
    permute_rows,
    round_scales_to_f16,
    with_group,
)

KERNELS = ("auto", "packed", "torch")


class UnpackableCodes(ValueError):
    """No kernel here holds these codes exactly; the caller keeps the weights as float."""


def build_quant_linear(
    bq: BlockQuant, bias: torch.Tensor | None = None, exact_rows: bool = False, kernel: str = "auto"
) -> QuantLinear:
    """Groups of 32 or 16 with float16 scales (the GGUF types of packing.PACKED_BITS) -> PackedLinear where its
    kernel runs (kernel "auto" or "packed"); otherwise, on PyTorch's kernels ("torch"): 4-bit -> Int4Linear;
    symmetric 8-bit per row -> Int8Linear; 8-bit per block -> Int8BlockLinear.

    exact_rows keeps float32 group scales so that `embedding()` matches the source exactly (tied embeddings);
    PackedLinear is exact without it."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel != "torch" and PackedLinear.can_build(bq):
        return PackedLinear(bq, bias)
    if kernel == "packed":
        raise ValueError("the packed kernel cannot take these codes here (needs AVX512-BF16, groups of 32 and "
                         "float16-exact scales)")
    n, k = bq.shape
    if bq.group_size < 32:  # PyTorch's int4 kernel takes groups of 32 and more
        raise UnpackableCodes(f"groups of {bq.group_size} inputs (GGUF Q6_K / Q3_K / Q2_K) need kvflow's packed kernel")
    if bq.bits == 4:
        return Int4Linear(bq, bias, exact_rows=exact_rows)
    bq = centred_at_128(bq)  # PyTorch's int8 kernels take Q8_0's centring (Q5_0's codes are shifted to it)
    if not torch.equal(bq.offset, -128.0 * bq.scale):
        # PyTorch's int4 kernel holds an offset as a bfloat16 zero point: exact for Q8_0's centred codes,
        # a bias of up to 2^-9 of 128 scales in every weight of a block for a free one (Q5_1).
        raise UnpackableCodes("8-bit codes with a free offset (GGUF Q5_1) need kvflow's packed kernel")
    if bq.group_size == k and torch.equal(bq.offset, -128.0 * bq.scale) and not exact_rows:
        return Int8Linear(bq, bias)
    return Int8BlockLinear(bq, bias, exact_rows=exact_rows)


def gguf_linear(
    parts: Sequence[tuple[np.ndarray, str]],
    row_orders: Sequence[torch.Tensor | None] | None = None,
    bias: torch.Tensor | None = None,
    exact_rows: bool = False,
) -> QuantLinear:
    """One layer from GGUF tensors concatenated along the output dim (q/k/v, gate/up).

    parts: (tensor.data [out, bytes], type name such as "Q4_1") per tensor, in fused order.
    row_orders: per part, a row index to apply first (packing.unpermute_rope_index for llama q/k), or None.
    Parts of different code widths are all held as 8-bit codes (exactly: a 4-bit code is an 8-bit one), and
    parts of different group sizes with the smallest one's (each scale repeated).
    """
    if packed_matmul.available():  # straight from the file's bytes, in C++; the same layer as below
        runs = _runs_of_one_layout(parts, row_orders)
        if len(runs) == 2 and not exact_rows:  # each run in its own type's bytes, not both in the widest's
            layers = [gguf_linear(run_parts, run_orders) for run_parts, run_orders in runs]
            if all(isinstance(layer, PackedLinear) for layer in layers):
                return PackedParts(layers, bias)
        bits, group, centre, codebook = packed_form([qtype for _, qtype in parts])
        pw = packed_weight.pack_gguf(
            [(raw, gguf.GGMLQuantizationType[qtype].value, row_orders[i] if row_orders is not None else None)
             for i, (raw, qtype) in enumerate(parts)], bits, group, centre, codebook)
        if pw is not None:
            return PackedLinear(pw, bias)
    codes = []
    for i, (raw, qtype) in enumerate(parts):
        bq = from_gguf(raw, qtype)
        if qtype in ROUNDED_SCALE_TYPES:
            bq = round_scales_to_f16(bq)
        order = row_orders[i] if row_orders is not None else None
        codes.append(bq if order is None else permute_rows(bq, order))
    if len({bq.bits for bq in codes}) > 1:  # a fused layer of 4- and 8-bit parts (a Q4_K q beside a Q5_0 k)
        codes = [as_8_bit(bq) for bq in codes]
    smallest = min(bq.group_size for bq in codes)
    codes = [bq if bq.group_size == smallest else with_group(bq, smallest) for bq in codes]
    return build_quant_linear(concat_rows(codes) if len(codes) > 1 else codes[0], bias, exact_rows)


def _runs_of_one_layout(parts: Sequence[tuple[np.ndarray, str]], row_orders: Sequence[torch.Tensor | None] | None
                        ) -> list[tuple[list, list | None]]:
    """Consecutive parts that packed_form holds in one layout, as (parts, row orders) runs."""
    orders = list(row_orders) if row_orders is not None else [None] * len(parts)
    runs = []
    for _, run in groupby(zip(parts, orders, strict=True), key=lambda part_order: packed_form([part_order[0][1]])):
        run = list(run)
        runs.append(([part for part, _ in run], None if row_orders is None else [order for _, order in run]))
    return runs
