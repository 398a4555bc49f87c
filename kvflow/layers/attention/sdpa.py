"""Attention through PyTorch's scaled_dot_product_attention: the fast general path (CPU, or CUDA without Triton).

Prefill of a fresh sequence attends over its own k/v directly; anything with cached context gathers
that sequence's blocks once. Decode steps of many sequences run as one padded, masked batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvflow.kernels import abi, kv_int8, paged_attention
from kvflow.layers.attention import reference
from kvflow.layers.attention.metadata import AttentionMetadata


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask=None, causal=False):
    """q [Lq, Hq, D], k/v [Lk, Hkv, D] -> [Lq, Hq, D]."""
    hq, hkv = q.shape[1], k.shape[1]
    if q.shape[0] == 1 and mask is None:
        return _single_query(q, k, v, scale)
    # On CPU the fused (flash) kernel takes grouped-query heads as they are, faster than repeating them
    # (benchmarks/RESULTS.md, "Figures behind the code"); elsewhere repeat the few KV heads, as every kernel takes.
    gqa = hq != hkv and q.device.type == "cpu"
    if hq != hkv and not gqa:
        k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    # 4-D [1, H, L, D]: with 3-D inputs PyTorch takes the unfused math path on CPU, several times slower.
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def _single_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode token: query heads grouped by KV head, two batched matmuls, K/V never copied."""
    hkv, d = k.shape[1], k.shape[2]
    qg = q.reshape(hkv, -1, d)  # [Hkv, G, D]
    scores = torch.matmul(qg, k.permute(1, 2, 0)) * scale  # [Hkv, G, Lk]
    out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v.transpose(0, 1))  # [Hkv, G, D]
    return out.reshape(1, -1, d)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int, softcap: float,
            sinks: torch.Tensor | None = None):
    """One sequence's Lq queries, the last of its Lk positions in k/v: causal, within a sliding window if
    given, with capped scores or sinks if given (PyTorch's fused kernels take neither: those run in plain
    float32)."""
    lq, lk = q.shape[0], k.shape[0]
    if window > 0 and lk > window:  # nothing before the first query's window is seen: leave it out
        first = max(0, lk - lq - window + 1)
        k, v, lk = k[first:], v[first:], lk - first
    if softcap > 0 or sinks is not None:
        return reference.causal_attention(q, k, v, scale, window, softcap, sinks)
    if lq == lk and (window == 0 or lk <= window):
        return _sdpa(q, k, v, scale, causal=lq > 1)
    mask = None if lq == 1 and (window == 0 or lk <= window) else reference.visible(lq, lk, window, q.device)
    return _sdpa(q, k, v, scale, mask=mask)


def _context(k_cache, v_cache, meta: AttentionMetadata, b: int, seq_len: int):
    """Sequence b's first seq_len cached K/V: a slice when its blocks are consecutive, else a gather."""
    first = meta.first_block(b)
    if first >= 0:
        n_blocks = (seq_len + k_cache.shape[1] - 1) // k_cache.shape[1]
        k = k_cache[first : first + n_blocks].flatten(0, 1)[:seq_len]
        v = v_cache[first : first + n_blocks].flatten(0, 1)[:seq_len]
        return (kv_int8.dequantize(k), kv_int8.dequantize(v)) if kv_int8.is_int8(k_cache) else (k, v)
    table = meta.block_tables[b]
    return reference.gather_kv(k_cache, table, seq_len), reference.gather_kv(v_cache, table, seq_len)


def _padding_is_cheap(meta: AttentionMetadata) -> bool:
    """One padded batch beats a loop over sequences only while contexts are short and alike: the gather
    copies every sequence's context up to the longest one, and that traffic grows with depth."""
    padded = meta.num_seqs * meta.max_seq_len
    return meta.max_seq_len <= PADDED_DECODE_MAX_LEN and padded <= 1.25 * sum(meta.seq_lens_cpu)


PADDED_DECODE_MAX_LEN = 256


@dataclass
class SDPAMetadata:
    """The SDPA backend's view of a step: the shared metadata, plus the C++ kernel's step arguments."""

    common: AttentionMetadata
    kernel_step: abi.KvflowStep | None  # None where the kernel cannot take the step (no cache, index dtypes)


class SDPABackend:
    """exact=True (the batch-invariant mode): every query row, prefill rows too, goes through the C++
    kernel, which computes a row from its own query and the cached K/V alone, in fixed chunks; a
    prompt's result then does not depend on how it was chunked, batched or cached. Otherwise prefill
    runs through PyTorch's flash kernel, which is faster but rounds by the shape of the chunk."""

    name = "sdpa"

    def __init__(self, exact: bool = False) -> None:
        self.exact = exact

    def build_metadata(self, meta: AttentionMetadata) -> SDPAMetadata:
        step = None
        if meta.slot_mapping is not None and meta.block_tables is not None and paged_attention.available():
            step = paged_attention.step_struct(meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                                               meta.block_tables)
        return SDPAMetadata(meta, step)

    def forward(self, q, k, v, k_cache, v_cache, built: SDPAMetadata, scale: float, window: int = 0,
                softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        meta = built.common
        if meta.slot_mapping is None:  # a one-shot forward (scoring, parity checks): leave the cache alone
            k_cache = v_cache = None
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # dense rows, whatever q's strides
        decode_rows_done = False
        if k_cache is not None and built.kernel_step is not None and paged_attention.supports(q, k, v, k_cache):
            # C++ kernel: stores every new k/v and attends for every one-token query, whatever else the
            # step holds, so a decode token's rounding never depends on its batch.
            layer = paged_attention.layer_struct(k_cache, v_cache, q.shape[1], scale, window, softcap, sinks)
            # PyTorch's flash kernel has no sinks: their layers' prompt rows go through the kernel too.
            every_row = self.exact or sinks is not None
            paged_attention.store_and_attend(layer, built.kernel_step, q, k, v, out, all_rows=every_row)
            if meta.is_decode_only or every_row:
                return out
            decode_rows_done = True
        elif k_cache is not None:
            reference.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            if (meta.is_decode_only and meta.num_seqs > 1 and _padding_is_cheap(meta)
                    and not (window or softcap or sinks is not None) and not kv_int8.is_int8(k_cache)):
                return self._batched_decode(q, k_cache, v_cache, meta, scale)
        start = 0
        for b, (lq, lk) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            end = start + lq
            if lq == 0 or (lq == 1 and decode_rows_done):
                start = end
                continue
            if k_cache is None or lq == lk:  # nothing cached before this chunk: attend to fresh k/v
                kb, vb = k[start:end], v[start:end]
                if k_cache is not None and kv_int8.is_int8(k_cache):  # as stored (below)
                    kb, vb = (kv_int8.dequantize(kv_int8.quantize(t)).to(q.dtype) for t in (kb, vb))
                elif k_cache is not None and k_cache.dtype != q.dtype:
                    # As stored: a later chunk reads these rounded values back, so a prompt's result
                    # must not depend on whether it was split.
                    kb, vb = kb.to(k_cache.dtype).to(q.dtype), vb.to(k_cache.dtype).to(q.dtype)
            else:
                kb, vb = _context(k_cache, v_cache, meta, b, lk)
                kb, vb = kb.to(q.dtype), vb.to(q.dtype)  # a cache may be stored narrower (kv_cache_dtype)
            out[start:end] = _attend(q[start:end], kb, vb, scale, window, softcap, sinks)
            start = end
        return out

    def _batched_decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # One query per sequence: gather each sequence's blocks into a padded [B, L, Hkv, D] batch, then
        # grouped-query matmuls (query heads grouped under their KV head, so K/V are not repeated).
        bs, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        max_blocks = (meta.max_seq_len + bs - 1) // bs
        tables = meta.block_tables[:, :max_blocks].long()
        b = tables.shape[0]
        kb = k_cache[tables].reshape(b, max_blocks * bs, hkv, d).permute(0, 2, 3, 1)  # [B, Hkv, D, L]
        vb = v_cache[tables].reshape(b, max_blocks * bs, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
        qg = q.reshape(b, hkv, -1, d)  # [B, Hkv, G, D]
        scores = torch.matmul(qg, kb.to(q.dtype)).float() * scale  # [B, Hkv, G, L]
        valid = torch.arange(max_blocks * bs, device=q.device)[None, :] < meta.seq_lens[:, None]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), vb.to(q.dtype))  # [B, Hkv, G, D]
        return out.reshape(b, -1, d)
