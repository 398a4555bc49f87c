"""Plain-PyTorch attention over a paged KV cache: slow, obvious, and the yardstick for every fast kernel.

Cache layout, per layer: k_cache and v_cache are [num_blocks, block_size, num_kv_heads, head_dim] (on the
CPU a transposed view of head-major storage: engine/kv_cache_alloc.py); token slot s lives at block
s // block_size, offset s % block_size.
"""

from __future__ import annotations

import torch

from kvflow.kernels import kv_int8
from kvflow.layers.activation import soft_cap


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's K/V ([T, Hkv, D]) into their slots. Negative slots are padding and are skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    store_kv(k, v, k_cache, v_cache, slot_mapping)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """write_kv without the padding check: every slot must be valid (the eager CPU path never pads)."""
    if kv_int8.is_int8(k_cache):
        k, v = kv_int8.quantize(k), kv_int8.quantize(v)
    # Indexed by (block, position in it), not through a flat view: a CPU cache is a transposed view of its
    # head-major storage (engine/kv_cache_alloc.py).
    block_size = k_cache.shape[1]
    blocks, within = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, within] = k.to(k_cache.dtype)
    v_cache[blocks, within] = v.to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len cached tokens of one sequence, [seq_len, Hkv, D] (an 8-bit cache's dequantized)."""
    block_size = cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    rows = cache[block_table[:n_blocks].long()].flatten(0, 1)[:seq_len]
    return kv_int8.dequantize(rows) if kv_int8.is_int8(cache) else rows


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence: q [Lq, Hq, D] are the last Lq positions of k/v [Lk, Hkv, D]; grouped-query aware.
    window > 0: each query sees its last `window` positions only; softcap > 0: scores are capped as
    softcap * tanh(score / softcap) before the mask (Gemma 2); sinks [Hq]: one more logit per head in the
    softmax, whose probability is dropped (gpt-oss: a head may attend to nothing)."""
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    group = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq, Lq, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, Lq, Lk]
    if softcap > 0:
        scores = soft_cap(scores, softcap)
    scores = scores.masked_fill(~visible(lq, lk, window, q.device), float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.float()[:, None, None].expand(hq, lq, 1)), dim=-1)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs[..., :lk] if sinks is not None else probs, vf)  # [Hq, Lq, D]
    return out.transpose(0, 1).to(q.dtype)


def visible(lq: int, lk: int, window: int = 0, device=None) -> torch.Tensor:
    """[Lq, Lk] bool: which positions each of the last Lq queries sees (causal; within its window)."""
    q_pos = torch.arange(lk - lq, lk, device=device)[:, None]
    k_pos = torch.arange(lk, device=device)[None, :]
    seen = k_pos <= q_pos
    return seen & (q_pos - k_pos < window) if window > 0 else seen


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_start_loc: list[int],
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for a flat batch whose K/V (this step's included) already sit in the paged cache."""
    out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[b], query_start_loc[b + 1]
        if end == start:
            continue
        k = gather_kv(k_cache, block_tables[b], seq_len)
        v = gather_kv(v_cache, block_tables[b], seq_len)
        out[start:end] = causal_attention(q[start:end], k, v, scale, window, softcap, sinks)
    return out
