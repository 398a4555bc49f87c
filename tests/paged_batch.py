"""Random paged-cache batches for kernel tests, plus the plain-PyTorch answers to compare against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.kernels import kv_int8
from kvflow.layers.attention import reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D], this step's keys, not yet in the cache
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], earlier context already written
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, W]
    seq_lens: torch.Tensor  # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    slot_mapping: torch.Tensor  # int64 [T]
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]

    def reference_output(self, scale: float, window: int = 0, softcap: float = 0.0,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
        """write_kv + paged_attention on copies of the caches, in float32 (an 8-bit cache dequantized)."""
        if kv_int8.is_int8(self.k_cache):
            k_cache, v_cache = kv_int8.dequantize(self.k_cache), kv_int8.dequantize(self.v_cache)
        else:
            k_cache, v_cache = self.k_cache.float().clone(), self.v_cache.float().clone()
        reference.write_kv(self.k.float(), self.v.float(), k_cache, v_cache, self.slot_mapping)
        starts = self.query_start_loc.tolist()
        return reference.paged_attention(
            self.q.float(), k_cache, v_cache, self.block_tables, self.seq_lens_cpu, starts, scale, window, softcap,
            sinks)


def at_slots(cache: torch.Tensor, slots) -> tuple:
    """An index of cache [blocks, block_size, ...] for token slots (an int or a tensor), for reading or
    writing their rows in either layout (a flat view works only for token-major caches)."""
    block_size = cache.shape[1]
    return slots // block_size, slots % block_size


def make_paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    spare_blocks: int = 3,
    seed: int = 0,
    cache_dtype: torch.dtype | None = None,
    layout: str | None = None,
) -> PagedBatch:
    """Each sequence gets shuffled (non-contiguous) blocks; its first seq_len - query_len tokens are
    already cached with random K/V, the last query_len are this step's q/k/v. layout: "head" (each block
    stored [kv_heads, block_size, row], the caches a transposed view of it) or "token" (contiguous); by
    default as engine/kv_cache_alloc lays out caches on this device."""
    layout = layout or ("head" if device.type == "cpu" else "token")
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(blocks_per_seq + [1])
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    slots: list[int] = []
    used = 0
    for b, (n, lq) in enumerate(zip(seq_lens, query_lens)):
        table = order[used : used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(n - lq, n)]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    total = sum(query_lens)
    starts = [0]
    for lq in query_lens:
        starts.append(starts[-1] + lq)

    def rand(*s):
        return torch.randn(*s, generator=g).to(dtype)

    def laid_out(c: torch.Tensor) -> torch.Tensor:  # the same values, stored in `layout`
        return c.transpose(1, 2).contiguous().transpose(1, 2) if layout == "head" else c

    def cache():
        if cache_dtype == torch.int8:  # written as the kernels write it: values and their scales
            return laid_out(kv_int8.quantize(rand(*shape)).to(device))
        return laid_out(rand(*shape).to(cache_dtype or dtype).to(device))

    return PagedBatch(
        q=rand(total, num_kv_heads * group, head_dim).to(device),
        k=rand(total, num_kv_heads, head_dim).to(device),
        v=rand(total, num_kv_heads, head_dim).to(device),
        k_cache=cache(),
        v_cache=cache(),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        seq_lens_cpu=list(seq_lens),
        query_lens_cpu=list(query_lens),
    )


def assert_close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    # fp16/bf16 round the softmax weights before the P @ V product; float32 only accumulates differently.
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    err = (ours.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), f"max abs error {err:.3e} (tolerance {tol:.1e})"
