"""CPU buffers on 2 MiB pages, for the data a decode step streams through every step (KV cache, packed
weights): with 4 KiB pages the step's ~200 MB cross 50,000 pages, a TLB miss and page walk each.

Linux backs a mapping with transparent huge pages only where it was asked to (MADV_HUGEPAGE, when
/sys/kernel/mm/transparent_hugepage/enabled is "madvise") before the memory is first touched, so the
buffer is a fresh anonymous mapping, advised, then filled. Pages are still mapped on first write, so a
large KV cache costs resident memory only as it fills (in 2 MiB steps). Where the advice is not
available (or with KVFLOW_HUGE_PAGES=0) the buffer is an ordinary one.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = HUGE_PAGE  # smaller buffers would not fill one huge page
enabled = os.environ.get("KVFLOW_HUGE_PAGES", "1") != "0"  # KVFLOW_HUGE_PAGES=0: ordinary pages


class HugePageArena:
    """Buffers smaller than a huge page, side by side on shared huge pages in the order asked for (a bump
    allocator over 1 GiB chunks, which cost resident memory only as they fill): weights packed one by one
    (a MoE model's thousands of 1-2 MB experts) land next to each other as they are written, so none is
    copied onto huge pages afterwards. A chunk lives as long as any buffer cut from it."""

    def __init__(self, chunk: int = 1 << 30) -> None:
        self.chunk = chunk
        self._buf: torch.Tensor | None = None
        self._used = 0

    def zeros(self, nbytes: int, align: int = 64) -> torch.Tensor | None:
        """A zero-filled uint8 slice of nbytes, or None where this arena does not serve it (huge pages off,
        or a buffer of a huge page or more, which gets its own)."""
        if not enabled or nbytes >= MIN_BYTES or getattr(mmap, "MADV_HUGEPAGE", None) is None:
            return None
        start = -(-self._used // align) * align
        if self._buf is None or start + nbytes > self._buf.numel():
            self._buf, start = huge_page_zeros(self.chunk), 0
        self._used = start + nbytes
        return self._buf[start:start + nbytes]


def huge_page_zeros(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 CPU tensor of ``nbytes``, on huge pages where the OS grants them."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if not enabled or nbytes < MIN_BYTES or advice is None:
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))  # calloc: fresh pages, mapped on first write
    # One spare huge page so the buffer can start on a 2 MiB boundary (huge pages need aligned ranges).
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(advice)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping alive for as long as it lives
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def onto_huge_pages(tensors: list[torch.Tensor], align: int = 64) -> list[torch.Tensor]:
    """Contiguous copies of CPU ``tensors`` side by side in one huge-page buffer, each starting on an
    ``align``-byte boundary: weights too small for a huge page each (a layer's projections are 0.2 to
    1 MB) share them. Returns ``tensors`` unchanged when huge pages are off or the total is too small."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += -(-size // align) * align
    if not enabled or total < MIN_BYTES or any(t.device.type != "cpu" for t in tensors):
        return tensors
    buf = huge_page_zeros(total)
    copies = []
    for t, start, size in zip(tensors, starts, sizes):
        copy = buf[start:start + size].view(t.dtype).view(t.shape)
        copy.copy_(t)
        copies.append(copy)
    return copies
