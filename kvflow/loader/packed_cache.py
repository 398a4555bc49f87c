"""Packed weights kept on disk: a GGUF model's packed layout is mapped on later loads instead of rebuilt.

Packing a GGUF file's weights (csrc/gguf_repack.cpp) writes every byte anew into fresh memory; for an 8B
Q4_K_M model that is 5 GB, and most of a load's time goes to first-touching those pages, then to the
packer itself. The bytes depend only on the file and the packer's sources, so the first load writes them
to one file under `<cache>/packed/` (on a background thread, after the model is ready), and every later
load maps that file: page-cache pages, no copy, no zeroing. Where the file system keeps the page cache in
large folios (ext4 on Linux 6.16 and later, xfs) most of the mapping is on 2 MiB pages, as a fresh pack
is; elsewhere it is on 4 KiB pages, which cost a decode step a few percent (RESULTS.md, session 7) but are
not copied: a copy would cost the load what the mapping saves. The share is logged.

The file is named by the model file (path, size, modification time), the kernel sources' digest and the
tensor-parallel shard, so a changed model or packer never meets an old file. Each pack call is recorded with
its signature (shapes, types, code width, block, row order); a load replays the file call by call and stops
replaying at the first call that differs, packing from there on and writing a new file.

Layout: a magic line, the header's length (8 bytes, little-endian), a JSON header (key, entries with their
signatures and byte ranges, the file's size, a BLAKE2b digest of the entries), then each entry's bytes from
the first 2 MiB boundary on, 64-byte aligned. A file is written under a temporary name and renamed when
whole; one whose size, magic, key or digest disagrees is deleted with a warning and the weights are packed
afresh. The bytes themselves are not hashed on load (5 GB would cost seconds): the file is kvflow's own,
written whole or not at all, as llama.cpp trusts the GGUF file it maps.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kvflow.kernels import build
from kvflow.kernels.huge_pages import HUGE_PAGE

log = logging.getLogger("kvflow")

MAGIC = b"kvflow-packed-weights 1\n"
SUFFIX = ".kvpack"
ALIGN = 64
DEFAULT_DISK_BYTES = 32 << 30
MADV_POPULATE_READ = 22  # Linux 5.14: fault the range in, read-only, without touching its bytes


@dataclass
class CacheStats:
    hits: int = 0  # pack calls served from the file
    packed: int = 0  # pack calls run (a cold load, or after the file stopped matching)
    refused: str | None = None  # why a file found was not used


@dataclass
class _Entry:
    signature: list
    ok: bool  # False: the packer refused these parts (the caller then takes the Python path)
    data: torch.Tensor | None
    supers: torch.Tensor | None


class PackedCache:
    """One model's packed weights on disk: `take` replays them in pack order, `add` records a fresh pack,
    `finish` (after the last pack) writes the file where the load did not replay it whole."""

    def __init__(self, folder: str | os.PathLike, key: str, max_bytes: int | None = None) -> None:
        self.folder = Path(folder)
        self.path = self.folder / f"{key}{SUFFIX}"
        self.key = key
        self.max_bytes = max_bytes
        self.stats = CacheStats()
        self._entries: list[_Entry] = []
        self.huge_page_share = 0.0  # of the mapped file, how much the kernel maps in 2 MiB pages
        self._replay: list[_Entry] | None = self._open()
        self.writer: threading.Thread | None = None

    # ---- a load's pack calls --------------------------------------------------------------------------
    def take(self, signature: list) -> _Entry | None:
        """The recorded result of this pack call, or None: pack it (and `add` the result)."""
        replay, i = self._replay, len(self._entries)
        if replay is None or i >= len(replay) or replay[i].signature != signature:
            self._replay = None  # from the first difference on, nothing later in the file is trusted
            return None
        entry = replay[i]
        self._entries.append(entry)
        self.stats.hits += 1
        return entry

    def add(self, signature: list, ok: bool, data: torch.Tensor | None, supers: torch.Tensor | None) -> None:
        self._replay = None
        self._entries.append(_Entry(signature, ok, data, supers))
        self.stats.packed += 1

    def finish(self) -> None:
        """After the load's last pack call: keep the file (a whole replay) or write a new one."""
        replay = self._replay
        if replay is not None and len(self._entries) == len(replay):  # `add` ends a replay
            log.info("packed weights: %d of %d mapped from %s (%.0f%% on 2 MiB pages)", self.stats.hits,
                     len(replay), self.path, 100 * self.huge_page_share)
            _touch(self.path)
            return
        if not self._entries:
            return
        self.writer = threading.Thread(target=self._write, args=(list(self._entries),),
                                       name="kvflow-packed-cache", daemon=False)  # exit waits for a whole file
        self.writer.start()

    # ---- reading ------------------------------------------------------------------------------------
    def _open(self) -> list[_Entry] | None:
        try:
            f = open(self.path, "rb")
        except OSError:
            return None
        with f:
            try:
                entries = self._map(f)
            except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
                self.stats.refused = str(exc)
                log.warning("packed-weight cache %s refused (%s): packing the weights afresh", self.path, exc)
                self.path.unlink(missing_ok=True)
                return None
        return entries

    def _map(self, f) -> list[_Entry]:
        head = f.read(len(MAGIC) + 8)
        if head[:len(MAGIC)] != MAGIC:
            raise ValueError("not a packed-weight file")
        (header_len,) = struct.unpack("<Q", head[len(MAGIC):])
        header = json.loads(f.read(header_len))
        size = os.fstat(f.fileno()).st_size
        if header["key"] != self.key:
            raise ValueError("written for another model or packer")
        if header["size"] != size:
            raise ValueError(f"{size} bytes where the header says {header['size']}")
        if header["digest"] != _digest(header["entries"]):
            raise ValueError("its header does not match its digest")
        region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # writes, if any, stay private
        whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive as long as any view
        start = header["data_start"]
        _populate(whole[start:])
        self.huge_page_share = _huge_page_share(whole.data_ptr() + start, size - start)

        def view(spec: list | None) -> torch.Tensor | None:
            if spec is None:
                return None
            offset, shape = spec[0], spec[1:]
            count = 1
            for d in shape:
                count *= d
            if offset < start or offset + count > size:
                raise ValueError("an entry lies outside the file")
            return whole[offset:offset + count].view(shape)

        return [_Entry(e["signature"], e["ok"], view(e["data"]), view(e["supers"])) for e in header["entries"]]

    # ---- writing ------------------------------------------------------------------------------------
    def _write(self, entries: list[_Entry]) -> None:
        specs, offset = [], 0
        for e in entries:
            spec = {"signature": e.signature, "ok": e.ok, "data": None, "supers": None}
            for name in ("data", "supers"):
                t = getattr(e, name)
                if t is not None:
                    offset = _aligned(offset, ALIGN)
                    spec[name] = [offset, *t.shape]
                    offset += t.numel()
            specs.append(spec)
        # The header's length moves the data's start, and the offsets move with it: size the header with
        # room for every offset and both totals to grow, then shift the offsets past it.
        room = 20 * (2 + 2 * len(specs))  # up to 20 digits more per offset, for data_start and size
        header_len = len(json.dumps({"key": self.key, "entries": specs, "digest": "0" * 32,
                                     "data_start": 0, "size": 0}).encode()) + room
        data_start = _aligned(len(MAGIC) + 8 + header_len, HUGE_PAGE)
        for spec in specs:
            for name in ("data", "supers"):
                if spec[name] is not None:
                    spec[name][0] += data_start
        total = _aligned(data_start + offset, ALIGN)
        header = {"key": self.key, "entries": specs, "digest": _digest(specs), "data_start": data_start,
                  "size": total}
        text = json.dumps(header).encode().ljust(header_len)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            if not self._make_room(total):
                return
            with open(tmp, "wb") as out:
                out.write(MAGIC + struct.pack("<Q", header_len) + text)
                for spec, e in zip(specs, entries):
                    for name in ("data", "supers"):
                        t = getattr(e, name)
                        if t is not None:
                            out.seek(spec[name][0])
                            out.write(memoryview(t.contiguous().numpy()))
                out.truncate(total)
            tmp.replace(self.path)
            log.info("packed weights written to %s (%.1f MiB): later loads map them", self.path, total / 2**20)
        except OSError as exc:
            log.warning("packed-weight cache not written (%s)", exc)
        finally:
            tmp.unlink(missing_ok=True)
            self._entries = []  # the model's own tensors: no reference kept past the write

    def _make_room(self, nbytes: int) -> bool:
        """Remove the least recently used files until nbytes more fit under the bound; False if they never will."""
        self.folder.mkdir(parents=True, exist_ok=True)
        bound = self.max_bytes
        if bound is None:
            bound = min(DEFAULT_DISK_BYTES, (shutil.disk_usage(self.folder).free + _folder_bytes(self.folder)) // 2)
        if nbytes > bound:
            log.info("packed-weight cache: %.1f MiB exceeds its bound (%.1f MiB); not written",
                     nbytes / 2**20, bound / 2**20)
            return False
        for tmp in self.folder.glob(f"*{SUFFIX}.*.tmp"):  # a writer killed mid-file left it
            if not _alive(int(tmp.name.rsplit(".", 2)[-2])):
                tmp.unlink(missing_ok=True)
        files = sorted(self.folder.glob(f"*{SUFFIX}"), key=_mtime)
        used = sum(_size(p) for p in files)
        for old in files:
            if used + nbytes <= bound:
                break
            used -= _size(old)
            old.unlink(missing_ok=True)
            log.info("packed-weight cache: removed %s (least recently used)", old.name)
        return True


def cache_key(model_path: Path, shard: tuple[int, int] | None = None) -> str:
    """Names a packed file: the model file as it is now, the kernel sources, and the tensor-parallel shard."""
    st = model_path.stat()
    what = [str(model_path.resolve()), st.st_size, st.st_mtime_ns, build.sources_digest(), shard]
    return hashlib.blake2b(json.dumps(what).encode(), digest_size=16).hexdigest()


def default_folder() -> Path:
    return build.cache_root() / "packed"


def _digest(specs: list) -> str:
    return hashlib.blake2b(json.dumps(specs, sort_keys=True).encode(), digest_size=16).hexdigest()


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def _populate(t: torch.Tensor) -> None:
    """Map the file's pages now (from the page cache, or read from disk), not one fault at a time later."""
    if not t.numel():
        return
    libc = ctypes.CDLL(None, use_errno=True)
    start, length = ctypes.c_void_p(t.data_ptr() & ~(mmap.PAGESIZE - 1)), ctypes.c_size_t(t.numel())
    for advice in (MADV_POPULATE_READ, mmap.MADV_WILLNEED):  # the second before Linux 5.14: read-ahead only
        if libc.madvise(start, length, advice) == 0:
            return


def _huge_page_share(address: int, nbytes: int) -> float:
    """How much of [address, address + nbytes) is mapped in 2 MiB pages (/proc/self/smaps)."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                if "-" in line.split(" ", 1)[0] and line[0] in "0123456789abcdef":
                    lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
                    inside = lo <= address < hi
                elif inside and line.startswith("FilePmdMapped:"):
                    return min(1.0, int(line.split()[1]) * 1024 / max(nbytes, 1))
    except (OSError, ValueError):
        pass
    return 0.0


def _touch(path: Path) -> None:
    try:
        os.utime(path)  # its use order for the bound
    except OSError:
        pass


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _folder_bytes(folder: Path) -> int:
    return sum(_size(p) for p in folder.glob(f"*{SUFFIX}"))
