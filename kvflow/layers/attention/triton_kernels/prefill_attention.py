"""Triton kernel: causal attention for a flat varlen batch whose K/V all sit in the paged cache.

Sequence b's query tokens are its last query_len positions (a fresh prompt, a chunk of a longer one,
or the uncached tail after a prefix-cache hit), so row i sits at absolute position
seq_len - query_len + i and sees every key at or before it. The kernel reads all keys, cached and new,
from the cache (store_kv runs first). Flash-attention style: one program per (sequence, query tile,
query head) streams key tiles with an online softmax, so no [Lq, Lk] score matrix is ever built.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, n0, q_pos, seq_len, table, k_cache_ptr, v_cache_ptr, kv_off, d, d_mask,
    stride_cb, stride_cs, scale_log2,
    CAUSAL_MASK: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One key tile of the online softmax; CAUSAL_MASK=False for tiles every query row fully sees."""
    n = n0 + tl.arange(0, BLOCK_N)
    if CAUSAL_MASK:
        n_mask = n < seq_len
        block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        n_mask = n >= 0
        block = tl.load(table + n // BLOCK_SIZE).to(tl.int64)
    row = block * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_off
    kv_mask = n_mask[:, None] & d_mask[None, :]
    # Cast to q's dtype: a cache may be stored in another dtype (kv_cache_dtype); no-op otherwise.
    k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k)) * scale_log2  # [M, N], log2 domain
    if CAUSAL_MASK:
        visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
    # Finite: the first tile of every row holds key 0, which every row sees.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    if m0 >= q_len:  # the grid covers the longest query; shorter sequences have spare tiles
        return
    seq_len = tl.load(seq_lens_ptr + b)
    context = seq_len - q_len  # keys cached before this chunk

    m = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < q_len
    d_mask = d < HEAD_DIM
    tokens = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = context + m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    kv_off = (head // GROUP) * stride_ch
    # Keys before context + m0 are visible to every row of the tile: no mask needed there.
    unmasked_end = ((context + m0) // BLOCK_N) * BLOCK_N
    for n0 in range(0, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, n0, q_pos, seq_len, table, k_cache_ptr, v_cache_ptr, kv_off, d, d_mask,
            stride_cb, stride_cs, scale_log2, CAUSAL_MASK=False, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N,
        )
    tile_end = tl.minimum(seq_len, context + m0 + BLOCK_M)
    for n0 in range(unmasked_end, tile_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, n0, q_pos, seq_len, table, k_cache_ptr, v_cache_ptr, kv_off, d, d_mask,
            stride_cb, stride_cs, scale_log2, CAUSAL_MASK=True, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N,
        )

    out = acc / l_i[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def default_tiles(head_dim: int, device: torch.device) -> dict[str, int]:
    """Tile sizes and warps; the interpreter (CPU) gets small tiles so tests cover several of them."""
    if device.type != "cuda":
        return {"block_m": 16, "block_n": 16, "num_warps": 4}
    if head_dim <= 64:
        return {"block_m": 128, "block_n": 64, "num_warps": 4}
    return {"block_m": 128, "block_n": 64, "num_warps": 8}


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] flat over sequences (query_start_loc int32 [B+1]); seq_lens int32 [B] include them."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    assert group * num_kv_heads == num_q_heads and k_cache.shape[3] == head_dim
    assert q.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    out = torch.empty_like(q) if out is None else out
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0 or max_query_len == 0:
        return out
    tiles = default_tiles(head_dim, q.device)
    block_m = block_m or tiles["block_m"]
    block_n = block_n or tiles["block_n"]
    grid = (batch, triton.cdiv(max_query_len, block_m), num_q_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        num_warps=num_warps or tiles["num_warps"],
    )
    return out
