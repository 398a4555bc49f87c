"""Size and allocate the paged KV cache: one K and one V tensor per layer, [blocks, block_size, kv_heads, head_dim]
(head_dim + 4 for an 8-bit cache: each row's scale follows it)."""

from __future__ import annotations

import logging
import math

import torch

from kvflow.kernels import kv_int8
from kvflow.kernels.huge_pages import huge_page_zeros
from kvflow.models.arch import ArchConfig

log = logging.getLogger("kvflow")

CPU_DEFAULT_SHARE = 0.25  # of available RAM, when the user names no budget
CPU_DEFAULT_CAP = 4 << 30
CUDA_DEFAULT_SHARE = 0.85  # of free device memory once the model is loaded


def row_width(arch: ArchConfig, dtype: torch.dtype) -> int:
    """A cache row's last dimension: head_dim values, and an 8-bit cache's scale (kernels/kv_int8.py)."""
    return arch.head_dim + (kv_int8.SCALE_BYTES if dtype == torch.int8 else 0)


def bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * row_width(arch, dtype) * elem


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


def group_num_blocks(memory: int, arch: ArchConfig, block_size: int, dtype: torch.dtype, max_num_seqs: int,
                     chunk: int) -> list[int]:
    """Blocks per KV cache group (ArchConfig.kv_group_windows) out of `memory` bytes. A sliding group
    needs no more than its window and a step's chunk for every running sequence; it gets that (or an
    even share, if less), and the global group the rest. One group takes the whole budget."""
    windows = arch.kv_group_windows
    layers = [sum(arch.layer_kv_group(i) == g for i in range(arch.num_layers)) for g in range(len(windows))]
    per_layer_block = bytes_per_block(arch, block_size, dtype) // arch.num_layers
    even = memory // (per_layer_block * arch.num_layers)
    if len(windows) == 1 or windows[0] != 0:
        return [even] * len(windows)
    blocks = [0] + [min(even, max_num_seqs * (-(-(w - 1) // block_size) + 2) + -(-chunk // block_size) + 1)
                    for w in windows[1:]]
    left = memory // per_layer_block - sum(n * count for n, count in zip(blocks, layers))
    blocks[0] = max(0, left // layers[0])
    return blocks


def allocate_kv_cache(
    arch: ArchConfig, num_blocks: int | list[int], block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V, with its KV group's number of blocks (one int: every layer's), each seen as
    [blocks, block_size, kv_heads, row]. On the CPU a block is stored head-major, [kv_heads, block_size,
    row], and the tensor returned is a transposed view of it: a decode step reads each KV head's rows of a
    block as one contiguous run, which the hardware prefetcher follows (token-major, they lie a token's
    width apart). CUDA caches stay token-major: the layout the Triton kernels were tuned and checked on."""
    sizes = [num_blocks] * len(arch.kv_group_windows) if isinstance(num_blocks, int) else num_blocks
    caches = []
    for i in range(arch.num_layers):
        blocks, heads, row = sizes[arch.layer_kv_group(i)], arch.num_kv_heads, row_width(arch, dtype)
        if device.type == "cpu":
            pair = tuple(_untouched_zeros((blocks, heads, block_size, row), dtype).transpose(1, 2) for _ in range(2))
        else:
            pair = tuple(torch.zeros((blocks, block_size, heads, row), dtype=dtype, device=device) for _ in range(2))
        caches.append(pair)
    return caches


def _untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros whose pages the OS maps on first write: a large CPU cache costs resident memory only as
    sequences fill it (torch.zeros writes every byte up front). On huge pages where the OS grants them
    (kernels/huge_pages): a decode step reads every cached block of its sequences."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return huge_page_zeros(nbytes).view(dtype).view(shape)
