"""Triton kernels: decode attention (one query per sequence) over the paged KV cache, split along the context.

Flash-decoding: a long context is cut into NUM_SPLITS partitions, each program attends one partition
for all query heads of one KV head (GQA: the group's heads share every K/V load), and writes a
partial output with its log-sum-exp. A second kernel merges the partitions. So a single long request
still spreads over the GPU, and a big batch simply uses one partition.

Nothing here reads per-step host values: lengths come from the seq_lens tensor, and the grid depends
only on the batch size, head count and split count, so launches can be replayed from a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256  # below this a partition's fixed cost outweighs the parallelism it adds
MAX_SPLITS = 64


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, num_splits,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + b)
    # Partitions are whole multiples of BLOCK_N so every loaded tile but the last is full.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = block * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = n_mask[:, None] & d_mask[None, :]
        # Cast to q's dtype: a cache may be stored in another dtype (kv_cache_dtype); no-op otherwise.
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * scale_log2  # [G, N], log2 domain
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds at least one key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new

    # An empty partition (short sequence, or a padded row with seq_len 0) leaves weight 0 for the merge.
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    part = (b * num_q_heads + heads) * num_splits + split  # [B, Hq, S] row index
    tl.store(part_lse_ptr + part, lse, mask=g_mask)
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    part = (b * tl.num_programs(1) + h) * num_splits + s
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all partitions empty: weights become 0, output 0
    w = tl.exp2(lse - m)
    o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Enough partitions to give every SM about two programs, never shorter than MIN_TOKENS_PER_SPLIT.

    Uses only static quantities (batch size, context bound from the block-table width), so a captured
    CUDA graph and an eager step of the same shape agree.
    """
    programs = max(1, batch * num_kv_heads)
    wanted = triton.cdiv(2 * num_sms, programs)
    useful = max(1, triton.cdiv(max_context, MIN_TOKENS_PER_SPLIT))
    return max(1, min(wanted, useful, MAX_SPLITS))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """q: [B, Hq, D], one query per sequence at its last position; K/V already in the cache.

    block_tables: int32 [B, W]; seq_lens: int32 [B] (0 for padding rows, which then output zeros).
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    assert group * num_kv_heads == num_q_heads and k_cache.shape[3] == head_dim
    assert q.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    part_out = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_partial_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse,
        scale * LOG2E, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs at least 16 rows
        BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps,
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        part_out, part_lse, out, num_splits,
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
    )
    return out
