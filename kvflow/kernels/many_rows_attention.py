"""Attention for the fast mode's many-row steps: prompt chunks in bfloat16 on AMX tiles
(csrc/prefill_attention_amx.cpp; PyTorch's bfloat16 flash kernel where that does not run), one-token
queries through the paged C++ kernel in float32, as in decode.

A prompt's attention is matmul-shaped (every row against every earlier position): in float32 FMAs the
paged kernel spent 40% of a 512-token prefill there, 6 to 7 ms a layer; PyTorch's bfloat16 flash kernel
takes 1.6 to 2.5 ms. The rows already enter every projection in bfloat16, and that rounding dominates:
on 16 long prompts the first token's logprobs sat 0.025 nats (mean) from the exact mode's either way.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvflow.kernels import build, cpu_attention
from kvflow.layers.attention.metadata import AttentionMetadata
from kvflow.layers.attention.sdpa import _context, _offset_causal_mask, _sdpa

_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@functools.cache  # resolved once: called on the per-step path
def _amx_kernel():
    return build.function("kvflow_prefill_attention_bf16", (
        _ptr, _i64, _ptr, _ptr, _i32, _ptr, _ptr, _ptr, _i64, _i32, _i32, _i32, _i32, _i32, _f32, _ptr, _i64, _i32))


def store_and_attend(qkv: torch.Tensor, heads: int, kv_heads: int, layer_attn: torch.nn.Module,
                     meta: AttentionMetadata, rows32: torch.Tensor, out: torch.Tensor) -> None:
    """Store the step's new K/V rows, then attend every row into `out` [T, heads * D] bfloat16.

    qkv [T, (heads + 2 * kv_heads) * D] float32 (rotary applied); rows32 [T, heads, D] float32 scratch
    that the C++ kernel fills for one-token queries."""
    rows = qkv.shape[0]
    d = rows32.shape[2]
    q_size, kv_size = heads * d, kv_heads * d
    q = qkv[:, :q_size].view(rows, heads, d)
    k = qkv[:, q_size : q_size + kv_size].view(rows, kv_heads, d)
    v = qkv[:, q_size + kv_size :].view(rows, kv_heads, d)
    k_cache, v_cache, scale = layer_attn.k_cache, layer_attn.v_cache, layer_attn.scale
    # Stores every row's K/V (prompt chunks read theirs back from the cache) and attends one-token queries.
    cpu_attention.store_and_attend(q, k, v, k_cache, v_cache, meta, scale, rows32, all_rows=False)
    out_heads = out.view(rows, heads, d)
    kernel = _amx_kernel()
    chunks_done = kernel is not None and kernel(
        qkv.data_ptr(), qkv.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), cpu_attention.CACHE_DTYPES[k_cache.dtype],
        *cpu_attention.step_args(meta)[2:], heads, kv_heads, d, k_cache.shape[1], scale, out.data_ptr(), out.stride(0),
        torch.get_num_threads()) == 0
    decode_rows = _decode_rows(meta)
    if decode_rows is not None:
        out_heads.index_copy_(0, decode_rows, rows32.index_select(0, decode_rows).to(out.dtype))
    if chunks_done:
        return
    start = 0
    for b, (lq, lk) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        end = start + lq
        if lq > 1:
            kb, vb = (t.to(torch.bfloat16) for t in _context(k_cache, v_cache, meta, b, lk))
            _flash_bf16(q[start:end].to(torch.bfloat16), kb, vb, scale, out_heads[start:end])
        start = end


def _decode_rows(meta: AttentionMetadata) -> torch.Tensor | None:
    """Rows of one-token queries (None when there are none), found once per step and kept on the metadata:
    every layer asks, and a copy per row per layer cost milliseconds in large decode batches."""
    cached = getattr(meta, "_decode_rows", False)
    if cached is False:
        starts = [int(s) for s, lq in zip(meta.query_start_loc.tolist(), meta.query_lens_cpu) if lq == 1]
        cached = torch.tensor(starts, dtype=torch.long) if starts else None
        meta._decode_rows = cached
    return cached


def _flash_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """PyTorch's bfloat16 flash kernel, where the AMX kernel does not run: q [Lq, Hq, D] are the last Lq
    of the Lk positions of k/v [Lk, Hkv, D]."""
    lq, lk = q.shape[0], k.shape[0]
    mask = None if lq == lk else _offset_causal_mask(lq, lk, q.device)
    out.copy_(_sdpa(q, k, v, scale, mask=mask, causal=mask is None))
