"""The 8-bit KV cache (kv_cache_dtype="int8"): each token's K or V row of one KV head is stored as head_dim
int8 values followed by their float32 scale (4 bytes), so a layer's cache is [blocks, block_size, kv_heads,
head_dim + 4] int8. Symmetric, per token and head: scale = absmax / 127, value = round(x * 127 / absmax).

Half the bytes of a 16-bit cache (plus 4 per row), so a decode step at depth reads about half as much K/V.
The C++ kernels (csrc/attention_rows.h) store and read this layout directly; this file is the PyTorch
side (for the reference and SDPA backends of layers/attention, and the cache's allocation), with the same
arithmetic, so either side can read what the other wrote. It sits with the kernels because the layout is
theirs.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size a cache holds (its last dimension, less the scale's bytes for an 8-bit cache)."""
    return cache.shape[-1] - SCALE_BYTES if is_int8(cache) else cache.shape[-1]


def element_bytes(dtype: torch.dtype, head_dim: int) -> float:
    """Bytes a K or V value takes in a cache of this dtype, its share of the row's scale included."""
    if dtype == torch.int8:
        return (head_dim + SCALE_BYTES) / head_dim
    return torch.empty((), dtype=dtype).element_size()


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float rows -> [..., D + 4] int8 rows with their scales, as csrc/attention_rows.h stores them."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    values = torch.round(x * inv).to(torch.int8)
    scale = (amax / 127.0).contiguous().view(torch.int8)  # the float32's 4 bytes
    return torch.cat([values, scale], dim=-1)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """[..., D + 4] int8 rows -> [..., D] float32: each value times its row's scale."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return rows[..., :d].float() * scale
