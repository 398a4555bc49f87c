"""The prefix cache's disk tier: full KV blocks saved as files, found again by their chained block hash.

A block's hash (engine/block_pool.hash_block_tokens) names its tokens and every token before them, and is
the same in every process, so a block written by one server can serve a prompt in the next one. Files
live under `<root>/<namespace>/`, where the namespace names everything that changes a block's bytes (the
model file, the dtypes, the block size, the kernel tier: engine/prefix_tier.store_namespace); another
model's blocks are never looked at.

One file per block: a magic line, a JSON header (namespace, hash, parent hash, tokens, payload size), the
K/V bytes, and a BLAKE2b digest of header and payload. A file is written under a temporary name and then
renamed, so a crash leaves either the whole file or none. Reading checks all of it (digest, size, header,
and that the tokens hash to the file's name); anything wrong is logged, deleted and treated as a miss, so
the block is recomputed, never served wrong.

Writes run on a background thread: the step loop hands over bytes already copied out of the cache and goes
on. The store is bounded in bytes; past the bound the least recently used files (written or hit) go.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvflow.engine.block_pool import BlockHash, hash_block_tokens

log = logging.getLogger("kvflow")

MAGIC = b"kvflow-kv-block 1\n"
DIGEST_BYTES = 16
SUFFIX = ".kvb"
DEFAULT_DISK_BYTES = 16 << 30
MAX_PENDING_BYTES = 256 << 20  # writes queued beyond this are dropped: the step loop never waits on a disk


@dataclass
class StoreStats:
    """Counters since the store opened (blocks, not tokens)."""

    hits: int = 0  # blocks read back and served
    writes: int = 0  # blocks written
    written_bytes: int = 0
    dropped: int = 0  # offered while the write queue was full
    refused: int = 0  # files that failed a check, deleted
    evicted: int = 0  # files removed to stay under the bound


@dataclass
class StoredBlock:
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    payload: bytes


class DiskPrefixStore:
    def __init__(self, root: str | os.PathLike, namespace: str, block_bytes: int,
                 max_bytes: int | None = None) -> None:
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.folder = Path(root) / namespace
        self.folder.mkdir(parents=True, exist_ok=True)
        if max_bytes is None:
            max_bytes = min(DEFAULT_DISK_BYTES, shutil.disk_usage(self.folder).free // 2)
        self.max_bytes = max_bytes
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> file size, least recent first
        self._size = 0
        self._pending: set[BlockHash] = set()
        self._pending_bytes = 0
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kvflow-prefix-store", daemon=True)
        self._writer.start()

    # ---- what is there ------------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index the files already on disk, oldest use first; leftovers of interrupted writes go."""
        found = []
        for path in self.folder.rglob("*"):
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
            elif path.suffix == SUFFIX:
                try:
                    st = path.stat()
                    found.append((st.st_mtime_ns, int(path.stem, 16), st.st_size))
                except (OSError, ValueError):
                    continue
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self._size += size
        if found:
            log.info("prefix cache on disk: %d blocks (%.1f MiB) in %s", len(found), self._size / 2**20,
                     self.folder)
        self._trim()

    def __contains__(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def size_bytes(self) -> int:
        with self._lock:
            return self._size

    def path(self, block_hash: BlockHash) -> Path:
        name = f"{block_hash:032x}"
        return self.folder / name[:2] / (name + SUFFIX)

    # ---- reading ------------------------------------------------------------------------------------
    def get(self, block_hash: BlockHash) -> StoredBlock | None:
        """The block's tokens and K/V bytes, checked; None if absent or refused (the file is then gone)."""
        with self._lock:
            if block_hash not in self._index:
                return None
        path = self.path(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # removed meanwhile (another server sharing the folder evicted it): a miss
            self._forget(block_hash)
            return None
        except OSError as exc:
            self._refuse(block_hash, f"unreadable ({exc})")
            return None
        block, why = self._parse(block_hash, data)
        if block is None:
            self._refuse(block_hash, why)
            return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        try:
            os.utime(path)  # its use order survives a restart
        except OSError:
            pass
        self.stats.hits += 1
        return block

    def _parse(self, block_hash: BlockHash, data: bytes) -> tuple[StoredBlock | None, str]:
        if not data.startswith(MAGIC):
            return None, "not a kvflow block file"
        body, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
        if len(data) < len(MAGIC) + 4 + DIGEST_BYTES or hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != digest:
            return None, "its checksum does not match (truncated or changed)"
        start = len(MAGIC)
        header_len = int.from_bytes(body[start:start + 4], "little")
        try:
            header = json.loads(body[start + 4:start + 4 + header_len])
        except ValueError:
            return None, "its header is not JSON"
        payload = body[start + 4 + header_len:]
        if header.get("namespace") != self.namespace:
            return None, "it belongs to another model or setting"
        if header.get("hash") != f"{block_hash:032x}" or len(payload) != self.block_bytes:
            return None, "its name or size does not match"
        parent = None if header.get("parent") is None else int(header["parent"], 16)
        tokens = tuple(int(t) for t in header.get("tokens", ()))
        if hash_block_tokens(parent, tokens) != block_hash:
            return None, "its tokens do not hash to its name"
        return StoredBlock(parent, tokens, payload), ""

    def _refuse(self, block_hash: BlockHash, why: str) -> None:
        log.warning("prefix cache on disk: block %032x refused and deleted: %s", block_hash, why)
        self.stats.refused += 1
        self._forget(block_hash)

    def _forget(self, block_hash: BlockHash) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._size -= size
        self.path(block_hash).unlink(missing_ok=True)

    # ---- writing ------------------------------------------------------------------------------------
    def put(self, block_hash: BlockHash, parent: BlockHash | None, token_ids: Sequence[int],
            payload: bytes) -> bool:
        """Queue a block for writing; False when it is already there or the queue is full."""
        if len(payload) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got {len(payload)}")
        with self._lock:
            if self._closed or block_hash in self._index or block_hash in self._pending:
                return False
            if self._pending_bytes + len(payload) > MAX_PENDING_BYTES:
                self.stats.dropped += 1
                return False
            self._pending.add(block_hash)
            self._pending_bytes += len(payload)
        self._queue.put((block_hash, parent, tuple(int(t) for t in token_ids), payload))
        return True

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._writer.join()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except OSError as exc:
                log.warning("prefix cache on disk: a block could not be written: %s", exc)
            finally:
                if item is not None:
                    with self._lock:
                        self._pending.discard(item[0])
                        self._pending_bytes -= len(item[3])
                self._queue.task_done()

    def _write(self, block_hash: BlockHash, parent: BlockHash | None, token_ids: tuple[int, ...],
               payload: bytes) -> None:
        header = json.dumps({"namespace": self.namespace, "hash": f"{block_hash:032x}",
                             "parent": None if parent is None else f"{parent:032x}",
                             "tokens": list(token_ids)}).encode()
        body = MAGIC + len(header).to_bytes(4, "little") + header + payload
        data = body + hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()
        path = self.path(block_hash)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.{threading.get_ident()}.tmp")  # folders may be shared
        tmp.write_bytes(data)
        os.replace(tmp, path)
        with self._lock:
            self._index[block_hash] = len(data)
            self._size += len(data)
        self.stats.writes += 1
        self.stats.written_bytes += len(data)
        self._trim()

    def _trim(self) -> None:
        while True:
            with self._lock:
                if self._size <= self.max_bytes or not self._index:
                    return
                block_hash = next(iter(self._index))
            self.stats.evicted += 1
            self._forget(block_hash)
