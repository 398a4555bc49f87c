"""Size and allocate the paged KV cache: one K and one V tensor per layer, [blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import functools
import logging
import math

import torch

from kvflow.kernels.huge_pages import huge_page_zeros
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
    zeros = _untouched_zeros if device.type == "cpu" else functools.partial(torch.zeros, device=device)
    return [(zeros(shape, dtype=dtype), zeros(shape, dtype=dtype)) for _ in range(arch.num_layers)]


def _untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros whose pages the OS maps on first write: a large CPU cache costs resident memory only as
    sequences fill it (torch.zeros writes every byte up front). On huge pages where the OS grants them
    (kernels/huge_pages): a decode step reads every cached block of its sequences."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return huge_page_zeros(nbytes).view(dtype).view(shape)
