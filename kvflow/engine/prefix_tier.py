"""The prefix cache's disk tier: opened where the options ask for it (open_disk_tier, with the namespace
that names what its blocks' bytes depend on), it moves full KV blocks between the paged cache's tensors and
the disk store (engine/prefix_store.py).

The KV cache manager decides which blocks move: it offers each block it registers in the prefix cache,
and on a lookup it asks for the blocks that follow its in-memory hits. DiskTier only copies: a block's
bytes are every layer's K then V rows for it ([layers, 2, block_size, kv_heads, head_dim]), in the cache's
dtype, so a block read back is bit for bit the block that was written.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvflow.config import CacheConfig
from kvflow.engine.block_pool import BlockHash
from kvflow.engine.kv_cache_alloc import bytes_per_block
from kvflow.engine.prefix_store import DiskPrefixStore

if TYPE_CHECKING:
    from kvflow.engine.runner import ModelRunner
    from kvflow.executors.model_setup import LoadedModel

log = logging.getLogger("kvflow")


def store_namespace(loaded, block_size: int, kv_dtype: torch.dtype) -> str:
    """Names what a cached block's bytes depend on: the weights (file, size, modification time), the
    architecture, how the model runs (mode, dtype, quantization, kernel tier) and the cache's layout."""
    path = Path(loaded.resolved.path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".json"))
    stamps = []
    for f in files:
        st = os.stat(f)
        stamps.append((str(f.resolve()), st.st_size, st.st_mtime_ns))
    plan = loaded.plan
    key = json.dumps({"files": stamps, "arch": repr(loaded.arch), "mode": plan.mode, "dtype": str(plan.dtype),
                      "quantization": plan.quantization, "tier": plan.cpu_tier, "device": plan.device.type,
                      "executor": plan.executor, "kv_dtype": str(kv_dtype), "block_size": block_size},
                     sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def open_disk_tier(cache: CacheConfig, loaded: LoadedModel, runner: ModelRunner) -> DiskTier | None:
    """The prefix cache's disk tier, where the options ask for it and the cache allows it: its store opened
    in the folder they name (closed at exit) and bound to the runner's KV cache; the KV cache manager's
    `tier` then. None without --prefix-cache-dir."""
    if cache.prefix_cache_dir is None:
        return None
    if not cache.enable_prefix_caching:
        raise ValueError("--prefix-cache-dir needs prefix caching (drop --no-prefix-caching)")
    if len(runner.group_windows) > 1 or runner.group_windows[0]:
        log.warning("the prefix cache's disk tier is off: this model has sliding-window layers")
        return None
    namespace = store_namespace(loaded, runner.block_size, runner.kv_dtype)
    block_bytes = bytes_per_block(loaded.arch, runner.block_size, runner.kv_dtype)
    try:
        store = DiskPrefixStore(cache.prefix_cache_dir, namespace, block_bytes, cache.prefix_cache_disk)
    except OSError as exc:
        raise ValueError(f"the prefix cache's folder {cache.prefix_cache_dir!r} cannot be used: {exc}") from None
    tier = DiskTier(store, runner.kv_caches)
    atexit.register(store.close)  # what is still queued reaches the disk on a clean exit
    return tier


class DiskTier:
    """The disk store bound to one KV cache's tensors (a single group of layers, no sliding window)."""

    def __init__(self, store: DiskPrefixStore, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        k0 = kv_caches[0][0]
        self.block_shape = (len(kv_caches), 2, *k0.shape[1:])
        self.dtype = k0.dtype
        block_bytes = k0[0].nbytes * 2 * len(kv_caches)
        if store.block_bytes != block_bytes:
            raise ValueError(f"the store holds blocks of {store.block_bytes} bytes, the cache's are {block_bytes}")
        self.store = store
        self.kv_caches = kv_caches

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.store

    def save(self, blocks: Sequence[tuple[int, BlockHash, BlockHash | None, Sequence[int]]]) -> None:
        """Queue (block id, hash, parent hash, tokens) blocks for the disk, copied out of the cache now."""
        todo = [b for b in blocks if b[1] not in self.store]
        if not todo:
            return
        ids = torch.tensor([b[0] for b in todo], device=self.kv_caches[0][0].device)
        # [blocks, layers, 2, block_size, heads, dim]: one block's bytes are contiguous
        data = torch.stack([torch.stack((k.index_select(0, ids), v.index_select(0, ids)), dim=1)
                            for k, v in self.kv_caches], dim=1).cpu().contiguous()
        raw = data.view(torch.uint8).reshape(len(todo), -1).numpy()
        for (_, block_hash, parent, tokens), row in zip(todo, raw):
            self.store.put(block_hash, parent, tokens, row.tobytes())

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int],
             token_ids: Sequence[Sequence[int]]) -> int:
        """Read blocks into the cache at block_ids, in order, stopping at the first one the store cannot
        serve (absent, refused, or holding other tokens). Returns how many were loaded."""
        payloads = []
        for block_hash, tokens in zip(hashes, token_ids):
            block = self.store.get(block_hash)
            if block is None or block.token_ids != tuple(tokens):
                break
            payloads.append(block.payload)
        if not payloads:
            return 0
        n = len(payloads)
        raw = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
        data = raw.view(self.dtype).view(n, *self.block_shape)
        device = self.kv_caches[0][0].device
        ids = torch.tensor(list(block_ids[:n]), device=device)
        data = data.to(device)
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, ids, data[:, layer, 0])
            v.index_copy_(0, ids, data[:, layer, 1])
        return n
