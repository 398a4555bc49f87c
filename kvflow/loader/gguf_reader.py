"""The `gguf` package's reader over a plain array view of the mapped file, with arrays read in bulk.

GGUFReader slices its np.memmap once or twice per metadata value, and each memmap slice runs Python code
(`memmap.__array_finalize__`): a Llama 3 vocabulary (128K tokens, 280K merges) is about a million slices,
5.5 s of a load. A base-class view of the same mapping slices at C speed (2.4 s) and still reads the file
lazily; tensors' `.data` are then plain (read-only) arrays over the mapping. Arrays are then the rest of
that time (1.4 s): GGUFReader reads them an element at a time through several numpy calls each. Here an
array of numbers is one part (one view of the mapping), and an array of strings is walked once for its
strings' offsets, its parts (a memoryview slice per length and per string) made only when read:
`field.contents()` gives the same values, and `len(field.data)` the same count for strings.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence

import gguf
import numpy as np

_LENGTH = struct.Struct("<Q")  # a GGUF string's byte count (little-endian files: the only ones read fast)


class _StringArrayParts(Sequence):
    """A string array field's parts, laid out as GGUFReader lays them out (the field's own leading parts,
    then each string's length and bytes), each made when it is read: a 262K-token vocabulary is half a
    million slices, most of a second at every load, and a tokenizer from the cache (loader/tokenizer_cache)
    reads none of them."""

    def __init__(self, head: list, view: memoryview, starts: list[int], lengths: list[int]) -> None:
        self._head, self._view, self._starts, self._lengths = head, view, starts, lengths

    def __len__(self) -> int:
        return len(self._head) + 2 * len(self._starts)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        if index < len(self._head):
            return self._head[index]
        string, is_bytes = divmod(index - len(self._head), 2)
        start = self._starts[string]
        return self._view[start + 8 : start + 8 + self._lengths[string]] if is_bytes else self._view[start : start + 8]


class MappedGGUFReader(gguf.GGUFReader):
    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.memmap) -> None:  # GGUFReader.__init__ assigns its np.memmap here
        self._mapped = mapped
        self._plain = mapped.view(np.ndarray)
        self._bytes = memoryview(self._plain)

    def _build_fields(self, offs: int, count: int) -> int:
        """GGUFReader._build_fields, with string arrays' parts made on demand (_StringArrayParts)."""
        for _ in range(count):
            orig_offs = offs
            kv_klen, kv_kdata = self._get_str(offs)
            offs += int(kv_klen.nbytes + kv_kdata.nbytes)
            raw_kv_type = self._get(offs, np.uint32)
            offs += int(raw_kv_type.nbytes)
            head = [kv_klen, kv_kdata, raw_kv_type]
            strings = self._string_array(offs) if int(raw_kv_type[0]) == gguf.GGUFValueType.ARRAY else None
            if strings is not None:
                size, parts = strings
                first = len(head) + 2  # after the array's item type and count
                field = gguf.ReaderField(orig_offs, str(bytes(kv_kdata), encoding="utf-8"),
                                         _StringArrayParts(head + parts[0], self._bytes, *parts[1:]),
                                         range(first + 1, first + 2 * len(parts[1]), 2),
                                         [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING])
            else:
                size, field_parts, idxs, types = self._get_field_parts(offs, raw_kv_type[0])
                field = gguf.ReaderField(orig_offs, str(bytes(kv_kdata), encoding="utf-8"), head + field_parts,
                                         [idx + len(head) for idx in idxs], types)
            self._push_field(field, skip_sum=True)
            offs += size
        return offs

    def _string_array(self, orig_offs: int) -> tuple[int, tuple[list, list[int], list[int]]] | None:
        """An array of strings at orig_offs: its size, and (its item type and count parts, each string's
        offset, each string's length); None for any other array, or a big-endian file."""
        if self.byte_order != "I":
            return None
        raw_itype = self._get(orig_offs, np.uint32)
        if int(raw_itype[0]) != gguf.GGUFValueType.STRING:
            return None
        count = self._get(orig_offs + 4, np.uint64)
        view, unpack = self._bytes, _LENGTH.unpack_from
        offs = orig_offs + 12
        starts, lengths = [], []
        for _ in range(int(count[0])):
            length = unpack(view, offs)[0]
            starts.append(offs)
            lengths.append(length)
            offs += 8 + length
        return offs - orig_offs, ([raw_itype, count], starts, lengths)

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
