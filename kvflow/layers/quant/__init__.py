"""Packed-integer linear layers for CPU: weights stay 4- or 8-bit in memory (issue 7).

Build codes with `packing.from_gguf` (GGUF bytes of the types in packing.PACKED_BITS) or `quantize.quantize_weight`
(float weights), fuse with `concat_rows`, reorder with `permute_rows`, then `build_quant_linear`.
"""

from kvflow.layers.quant.base import QuantLinear
from kvflow.layers.quant.factory import build_quant_linear, gguf_linear
from kvflow.layers.quant.int4_linear import Int4Linear
from kvflow.layers.quant.int8_block_linear import Int8BlockLinear
from kvflow.layers.quant.int8_linear import Int8Linear
from kvflow.layers.quant.packed_linear import PackedLinear
from kvflow.layers.quant.packing import BlockQuant, concat_rows, from_gguf, permute_rows, unpermute_rope_index
from kvflow.layers.quant.quantize import quantize_weight

__all__ = [
    "BlockQuant",
    "Int4Linear",
    "Int8BlockLinear",
    "Int8Linear",
    "PackedLinear",
    "QuantLinear",
    "build_quant_linear",
    "concat_rows",
    "from_gguf",
    "gguf_linear",
    "permute_rows",
    "quantize_weight",
    "unpermute_rope_index",
]
