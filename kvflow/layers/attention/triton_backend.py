"""TritonBackend: the CUDA attention path. store_kv, then split-K decode or varlen prefill over the cache.

triton is imported when a TritonBackend is built, never when this module is imported, so the engine
loads on machines without triton; `triton_available()` tells the runner whether it may pick this backend.
Decode steps launch only kernels whose grids and arguments are fixed by tensor shapes, so they can be
captured in CUDA graphs (engine/cuda_graphs.py).
"""

from __future__ import annotations

import importlib.util

import torch

from kvflow.layers.attention.metadata import AttentionMetadata
from kvflow.layers.attention.sdpa import SDPABackend


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


class TritonBackend:
    name = "triton"
    supports_cuda_graphs = True  # decode steps depend on no host-side per-step values

    def __init__(self, num_sms: int | None = None) -> None:
        """num_sms: the GPU's multiprocessor count, which sizes the decode split (default: asked of the device)."""
        from kvflow.layers.attention import triton_kernels

        self._kernels = triton_kernels
        self._num_sms = num_sms
        self._no_cache = SDPABackend()  # one-shot scoring without a KV cache: nothing paged to read

    def build_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta  # the kernels read the shared tensors as they are

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor | None,
        v_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if window or softcap or sinks is not None:  # the executor picks SDPA for such models (choose_backend)
            raise NotImplementedError("the Triton kernels have no sliding window, soft-capping or sinks yet")
        if k_cache is None or meta.slot_mapping is None:  # no cache bound, or a one-shot forward
            return self._no_cache.forward(q, k, v, None, None, self._no_cache.build_metadata(meta), scale)
        kernels = self._kernels
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.is_decode_only and q.shape[0] == meta.num_seqs:
            splits = self.num_splits(meta.num_seqs, k_cache, meta.block_tables, q.device)
            return kernels.decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, num_splits=splits, out=out
            )
        # Prefill chunks, mixed with decodes or not: the prefill kernel handles a 1-token query too.
        return kernels.prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len,
            scale, out=out,
        )

    def num_splits(
        self, batch: int, k_cache: torch.Tensor, block_tables: torch.Tensor, device: torch.device
    ) -> int:
        """Decode partitions per sequence, from static sizes only: the context bound is the block-table
        width, so an eager step and a CUDA-graph replay of the same table width agree."""
        if self._num_sms is None:
            is_cuda = torch.device(device).type == "cuda"
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count if is_cuda else 4
        max_context = block_tables.shape[1] * k_cache.shape[1]
        return self._kernels.choose_num_splits(batch, k_cache.shape[2], max_context, self._num_sms)
