"""The `gguf` package's reader over a plain array view of the mapped file, with arrays read in bulk.

GGUFReader slices its np.memmap once or twice per metadata value, and each memmap slice runs Python code
(`memmap.__array_finalize__`): a Llama 3 vocabulary (128K tokens, 280K merges) is about a million slices,
5.5 s of a load. A base-class view of the same mapping slices at C speed (2.4 s) and still reads the file
lazily; tensors' `.data` are then plain (read-only) arrays over the mapping. Arrays are then the rest of
that time (1.4 s): GGUFReader reads them an element at a time through several numpy calls each. Here an
array of numbers is one part (one view of the mapping) and an array of strings a memoryview slice per
string: `field.contents()` gives the same values, and `len(field.data)` the same count for strings.
"""

from __future__ import annotations

import mmap
import struct

import gguf
import numpy as np

_LENGTH = struct.Struct("<Q")  # a GGUF string's byte count (little-endian files: the only ones read fast)


class MappedGGUFReader(gguf.GGUFReader):
    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.memmap) -> None:  # GGUFReader.__init__ assigns its np.memmap here
        self._mapped = mapped
        self._plain = mapped.view(np.ndarray)
        self._bytes = memoryview(self._plain)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        item_type = gguf.GGUFValueType(int(raw_itype[0]))
        types = [gguf.GGUFValueType.ARRAY] + ([item_type] if int(count[0]) else [])
        offs = orig_offs + 12
        if item_type == gguf.GGUFValueType.STRING:
            view, unpack = self._bytes, _LENGTH.unpack_from
            parts: list = [raw_itype, count]
            for _ in range(int(count[0])):
                length = unpack(view, offs)[0]
                parts += (view[offs : offs + 8], view[offs + 8 : offs + 8 + length])
                offs += 8 + length
            return offs - orig_offs, parts, list(range(3, len(parts), 2)), types
        nptype = self.gguf_scalar_to_np.get(item_type)
        if nptype is None:  # nested arrays: the package's own reading
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, nptype, int(count[0]))
        return offs + int(values.nbytes) - orig_offs, [raw_itype, count, values], [2], types


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
