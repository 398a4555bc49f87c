"""Attention through PyTorch's scaled_dot_product_attention: the fast general path (CPU, or CUDA without Triton).

Prefill of a fresh sequence attends over its own k/v directly; anything with cached context gathers
that sequence's blocks once. Decode steps of many sequences run as one padded, masked batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.layers.attention import reference
from kvflow.layers.attention.metadata import AttentionMetadata


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask=None, causal=False):
    """q [Lq, Hq, D], k/v [Lk, Hkv, D] -> [Lq, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.transpose(0, 1)


def _offset_causal_mask(lq: int, lk: int, device) -> torch.Tensor:
    q_pos = torch.arange(lk - lq, lk, device=device)[:, None]
    return torch.arange(lk, device=device)[None, :] <= q_pos


def _context(k_cache, v_cache, meta: AttentionMetadata, b: int, seq_len: int):
    """Sequence b's first seq_len cached K/V: a slice when its blocks are consecutive, else a gather."""
    first = meta.contiguous_first_block[b] if meta.contiguous_first_block else -1
    if first >= 0:
        n_blocks = (seq_len + k_cache.shape[1] - 1) // k_cache.shape[1]
        return (k_cache[first : first + n_blocks].flatten(0, 1)[:seq_len],
                v_cache[first : first + n_blocks].flatten(0, 1)[:seq_len])
    table = meta.block_tables[b]
    return reference.gather_kv(k_cache, table, seq_len), reference.gather_kv(v_cache, table, seq_len)


class SDPABackend:
    name = "sdpa"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if k_cache is not None:
            reference.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if k_cache is not None and meta.is_decode_only and meta.num_seqs > 1:
            return self._batched_decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        start = 0
        for b, (lq, lk) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            end = start + lq
            if lq == 0:
                continue
            if k_cache is None or lq == lk:  # nothing cached before this chunk: attend to fresh k/v
                out[start:end] = _sdpa(q[start:end], k[start:end], v[start:end], scale, causal=lq > 1)
            else:
                kb, vb = _context(k_cache, v_cache, meta, b, lk)
                mask = None if lq == 1 else _offset_causal_mask(lq, lk, q.device)
                out[start:end] = _sdpa(q[start:end], kb, vb, scale, mask=mask)
            start = end
        return out

    def _batched_decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # One query per sequence: gather each sequence's blocks into a padded [B, Hkv, L, D] batch.
        bs = k_cache.shape[1]
        max_blocks = (meta.max_seq_len + bs - 1) // bs
        tables = meta.block_tables[:, :max_blocks].long()
        b = tables.shape[0]
        kb = k_cache[tables].reshape(b, max_blocks * bs, *k_cache.shape[2:]).transpose(1, 2)
        vb = v_cache[tables].reshape(b, max_blocks * bs, *v_cache.shape[2:]).transpose(1, 2)
        valid = torch.arange(max_blocks * bs, device=q.device)[None, :] < meta.seq_lens[:, None]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],
            kb,
            vb,
            attn_mask=valid[:, None, None, :],
            scale=scale,
            enable_gqa=kb.shape[1] != q.shape[1],
        )
        return out[:, :, 0, :]
