"""Python side of the paged-attention kernels (csrc/paged_attention.cpp, csrc/prefill_attention_amx.cpp).

Takes plain tensors: a step's place in the cache (`step_struct`, built once per step by the attention
backend that uses it), one layer's cache (`layer_struct`), and the step's q/k/v rows.
"""

from __future__ import annotations

import ctypes

import torch

from kvflow.kernels import abi, kv_int8

CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}  # int8: kernels/kv_int8.py


def available() -> bool:
    return abi.native() is not None


def step_struct(slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                block_tables: torch.Tensor) -> abi.KvflowStep | None:
    """The step's KvflowStep, or None when the index dtypes are not the kernel's (int64 slots, int32 others)
    or the tensors are not on the CPU. The tensors must outlive the struct (it holds their addresses)."""
    tensors = (slot_mapping, query_start_loc, seq_lens, block_tables)
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return None
    if slot_mapping.dtype != torch.int64 or any(t.dtype != torch.int32 for t in tensors[1:]):
        return None
    return abi.KvflowStep(slots=slot_mapping.data_ptr(), query_start=query_start_loc.data_ptr(),
                          seq_lens=seq_lens.data_ptr(), block_tables=block_tables.data_ptr(),
                          table_stride=block_tables.stride(0), num_seqs=seq_lens.shape[0],
                          num_tokens=slot_mapping.shape[0])


def cache_layout(cache: torch.Tensor) -> str | None:
    """How a cache [blocks, block_size, kv_heads, row] lies in memory: "token" (contiguous), "head" (each
    block stored [kv_heads, block_size, row], as kv_cache_alloc lays out CPU caches: this tensor is then a
    transposed view of it), or None (neither: the kernels cannot read it)."""
    if cache.is_contiguous():
        return "token"
    return "head" if cache.transpose(1, 2).is_contiguous() else None


def layer_struct(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, scale: float, window: int = 0,
                 softcap: float = 0.0, sinks: torch.Tensor | None = None) -> abi.KvflowAttention:
    """One layer's paged cache [blocks, block_size, kv_heads, head_dim] (head_dim + 4 bytes for an 8-bit
    cache; either layout of cache_layout) as the kernels read it; window > 0 for a sliding-window layer,
    softcap > 0 for capped scores, sinks (float32 [num_heads], kept alive by the caller) for gpt-oss's."""
    layout = cache_layout(k_cache)
    if k_cache.dtype not in CACHE_DTYPES or layout is None or cache_layout(v_cache) != layout:
        raise ValueError("the CPU kernels take float32, bfloat16, float16 or int8 caches, token- or head-major")
    return abi.KvflowAttention(k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
                               cache_dtype=CACHE_DTYPES[k_cache.dtype], block_size=k_cache.shape[1],
                               num_heads=num_heads, num_kv_heads=k_cache.shape[2], head_dim=kv_int8.head_dim_of(k_cache),
                               scale=scale, window=window, softcap=softcap, head_major=int(layout == "head"),
                               sinks=None if sinks is None else _sinks_pointer(sinks, num_heads))


def _sinks_pointer(sinks: torch.Tensor, num_heads: int) -> int:
    if sinks.dtype != torch.float32 or not sinks.is_contiguous() or sinks.shape != (num_heads,):
        raise ValueError("the CPU kernels take sinks as float32 [num_heads]")
    return sinks.data_ptr()


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Rows and caches the kernel takes: float32 q/k/v rows (heads contiguous), a float32, bfloat16, float16
    or int8 CPU cache in either layout (cache_layout), and query heads that group over the KV heads."""
    ok_rows = all(t.dtype == torch.float32 and t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (q, k, v))
    return (q.device.type == "cpu" and ok_rows and k_cache.dtype in CACHE_DTYPES and cache_layout(k_cache) is not None
            and q.shape[1] % k.shape[1] == 0 and available())


def store_and_attend(layer: abi.KvflowAttention, step: abi.KvflowStep, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, out: torch.Tensor, all_rows: bool = False) -> None:
    """Write every row's k/v to its slot, then fill `out` rows of one-token queries (with all_rows, every
    row: each attends to the cache up to its own position). q [T, Hq, D], k/v [T, Hkv, D] (rows may be
    strided), out [T, Hq, D] float32 contiguous."""
    rows = abi.KvflowRows(q=q.data_ptr(), q_stride=q.stride(0), k=k.data_ptr(), k_stride=k.stride(0),
                          v=v.data_ptr(), v_stride=v.stride(0))
    rc = abi.native().kvflow_paged_attention(layer=ctypes.byref(layer), step=ctypes.byref(step),
                                             rows=ctypes.byref(rows), out=out.data_ptr(), out_stride=out.stride(0),
                                             all_rows=int(all_rows), num_threads=torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("paged attention kernel refused its input shapes")


def prompt_attention_bf16(layer: abi.KvflowAttention, step: abi.KvflowStep, q: torch.Tensor,
                          out: torch.Tensor) -> bool:
    """Prompt chunks' attention on AMX tiles into out (bfloat16 rows; one-token rows left alone), their K/V
    already stored. False where this CPU or build has no AMX (nothing written)."""
    rc = abi.native().kvflow_prefill_attention_bf16(layer=ctypes.byref(layer), step=ctypes.byref(step),
                                                    q=q.data_ptr(), q_stride=q.stride(0), out=out.data_ptr(),
                                                    out_stride=out.stride(0), num_threads=torch.get_num_threads())
    return rc == 0
