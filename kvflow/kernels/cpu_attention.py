"""Python side of the C++ paged-attention kernel (csrc/paged_attention.cpp)."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvflow.kernels import build
from kvflow.layers.attention.metadata import AttentionMetadata

CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_i64, _i32, _ptr, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float


@functools.cache  # resolved once: called on the per-step path
def _kernel():
    return build.function("kvflow_paged_attention", (
        _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i32, _ptr, _i32, _ptr, _ptr, _ptr, _i64,
        _i32, _ptr, _i64, _i32, _i32, _i32, _i32, _f32, _i32, _i32))


def available() -> bool:
    return _kernel() is not None


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Shapes and dtypes the kernel takes: float32 q/k/v rows, a float32, bfloat16 or float16 CPU cache."""
    ok_rows = all(t.dtype == torch.float32 and t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (q, k, v))
    return (
        q.device.type == "cpu" and ok_rows and k_cache.dtype in CACHE_DTYPES and k_cache.is_contiguous()
        and q.shape[1] % k.shape[1] == 0 and step_args(meta) is not None and available()
    )


def store_and_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, out: torch.Tensor, all_rows: bool = False,
) -> None:
    """Write every token's k/v to its slot, then fill `out` rows of sequences with a one-token query
    (with all_rows, every row: each query row attends to the cache up to its own position).

    q [T, Hq, D], k/v [T, Hkv, D] (rows may be strided), out [T, Hq, D] float32 contiguous."""
    if not available():
        raise RuntimeError("the C++ CPU kernels are not available (no compiler, or KVFLOW_CPU_KERNELS=0)")
    step = step_args(meta)
    if step is None:
        raise ValueError("attention metadata with index dtypes the kernel does not take (see supports)")
    rc = _kernel()(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        k_cache.data_ptr(), v_cache.data_ptr(), CACHE_DTYPES[k_cache.dtype], *step, out.data_ptr(), out.stride(0),
        q.shape[1], k.shape[1], q.shape[2], k_cache.shape[1], scale, int(all_rows), torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError("decode attention kernel refused its input shapes")


def step_args(meta: AttentionMetadata) -> tuple | None:
    """The metadata's share of the kernel's arguments, the same for every layer of a step: built (and its
    index dtypes checked) once per step, then kept on the metadata. None when the dtypes do not fit."""
    cached = getattr(meta, "_cpu_kernel_args", None)
    if cached is None:
        fits = (meta.slot_mapping.dtype == torch.int64 and meta.seq_lens.dtype == torch.int32
                and meta.query_start_loc.dtype == torch.int32 and meta.block_tables.dtype == torch.int32)
        if not fits:
            cached = (None, None)
        else:
            tables = meta.block_tables.contiguous()
            slots = meta.slot_mapping
            # The tensors ride along so the addresses stay valid while the metadata lives.
            cached = (slots.data_ptr(), slots.shape[0], meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(),
                      tables.data_ptr(), tables.stride(0), meta.num_seqs), tables
        meta._cpu_kernel_args = cached
    return cached[0]
