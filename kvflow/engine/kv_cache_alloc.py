"""Size and allocate the paged KV cache: one K and one V tensor per layer, [blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import logging

import torch

from kvflow.models.arch import ArchConfig

log = logging.getLogger("kvflow")

CPU_DEFAULT_SHARE = 0.25  # of available RAM, when the user names no budget
CPU_DEFAULT_CAP = 4 << 30
CUDA_DEFAULT_SHARE = 0.85  # of free device memory once the model is loaded


def bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def default_kv_cache_memory(device: torch.device, cuda_reserve: int = 0) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(max(0, free - cuda_reserve) * CUDA_DEFAULT_SHARE)
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        available = info.get("MemAvailable", 8 << 30)
    except OSError:
        available = 8 << 30
    return int(min(available * CPU_DEFAULT_SHARE, CPU_DEFAULT_CAP))


def num_blocks_for(memory: int, arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    return max(0, memory // bytes_per_block(arch, block_size, dtype))


def allocate_kv_cache(
    arch: ArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(arch.num_layers)
    ]
