"""The `gguf` package's reader over a plain array view of the mapped file.

GGUFReader slices its np.memmap once or twice per metadata value, and each memmap slice runs Python code
(`memmap.__array_finalize__`): a Llama 3 vocabulary (128K tokens, 280K merges) is about a million slices,
5.5 s of a load. A base-class view of the same mapping slices at C speed (2.4 s) and still reads the file
lazily; tensors' `.data` are then plain (read-only) arrays over the mapping.
"""

from __future__ import annotations

import mmap

import gguf
import numpy as np


class MappedGGUFReader(gguf.GGUFReader):
    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.memmap) -> None:  # GGUFReader.__init__ assigns its np.memmap here
        self._mapped = mapped
        self._plain = mapped.view(np.ndarray)


def release_pages(array: np.ndarray) -> None:
    """Drop the whole pages under `array`, a view of a MappedGGUFReader's file, from this process's resident
    memory once its bytes are packed elsewhere: the mapping stays valid (a later read faults them back in
    from the page cache), but the file's pages no longer add to peak RSS on top of the packed copy."""
    base = array
    while base is not None and not isinstance(base, np.memmap):
        base = base.base
    region = getattr(base, "_mmap", None)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if region is None or advice is None:
        return
    start = array.ctypes.data - base.ctypes.data + base.offset
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (start + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo:
        region.madvise(advice, lo, hi - lo)
