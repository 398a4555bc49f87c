"""The prefix cache's disk store on its own: files round-trip, every kind of damage is refused (and the file
deleted), another model's files are never served, the bound evicts the least recently used, and a new
store over the same folder finds what the last one wrote."""

from __future__ import annotations

import os
import shutil

import pytest

from kvflow.engine.block_pool import hash_block_tokens
from kvflow.engine.prefix_store import DiskPrefixStore

BLOCK_BYTES = 64


def chain(n: int, first: int = 0) -> list[tuple[int, int | None, tuple[int, ...], bytes]]:
    """n consecutive blocks of 4 tokens: (hash, parent hash, tokens, payload)."""
    blocks, parent = [], None
    for i in range(n):
        tokens = tuple(range(first + 4 * i, first + 4 * i + 4))
        h = hash_block_tokens(parent, tokens)
        blocks.append((h, parent, tokens, bytes([(i + first) % 251]) * BLOCK_BYTES))
        parent = h
    return blocks


def written(tmp_path, n: int = 3, **kw) -> tuple[DiskPrefixStore, list]:
    store = DiskPrefixStore(tmp_path, "model-a", BLOCK_BYTES, **kw)
    blocks = chain(n)
    for b in blocks:
        assert store.put(*b)
    store.flush()
    return store, blocks


def test_round_trip_and_restart(tmp_path):
    store, blocks = written(tmp_path)
    assert not store.put(*blocks[0])  # already there
    for h, parent, tokens, payload in blocks:
        got = store.get(h)
        assert got is not None and (got.parent, got.token_ids, got.payload) == (parent, tokens, payload)
    store.close()
    again = DiskPrefixStore(tmp_path, "model-a", BLOCK_BYTES)
    assert len(again) == 3 and all(b[0] in again for b in blocks)
    assert again.get(blocks[2][0]).payload == blocks[2][3]
    assert again.get(chain(1, first=100)[0][0]) is None
    again.close()


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "empty", "renamed"])
def test_damaged_files_are_refused_and_deleted(tmp_path, damage):
    store, blocks = written(tmp_path)
    target = blocks[1][0]
    path = store.path(target)
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":
        data[-20] ^= 1
    elif damage == "flip_header":
        data[30] ^= 1
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))
    if damage == "renamed":  # a sound file under another block's name
        shutil.copy(store.path(blocks[0][0]), path)
    store.close()
    again = DiskPrefixStore(tmp_path, "model-a", BLOCK_BYTES)
    assert again.get(target) is None
    assert again.stats.refused == 1 and not path.exists() and target not in again
    assert again.get(blocks[0][0]) is not None and again.get(blocks[2][0]) is not None
    again.close()


def test_another_models_files_are_not_served(tmp_path):
    store, blocks = written(tmp_path)
    store.close()
    other = DiskPrefixStore(tmp_path, "model-b", BLOCK_BYTES)
    assert len(other) == 0 and other.get(blocks[0][0]) is None
    # The same file copied into model-b's folder: its header names model-a, so it is refused.
    src = DiskPrefixStore(tmp_path, "model-a", BLOCK_BYTES)
    dst = other.path(blocks[0][0])
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src.path(blocks[0][0]), dst)
    other.close()
    other = DiskPrefixStore(tmp_path, "model-b", BLOCK_BYTES)
    assert blocks[0][0] in other and other.get(blocks[0][0]) is None and other.stats.refused == 1
    assert src.get(blocks[0][0]) is not None  # model-a's own copy is untouched
    src.close()
    other.close()


def test_bound_evicts_least_recently_used(tmp_path):
    store, blocks = written(tmp_path, n=3)
    bound = store.size_bytes  # three files (the first one's header is the shortest: it has no parent)
    store.close()
    store = DiskPrefixStore(tmp_path, "model-a", BLOCK_BYTES, max_bytes=bound)
    assert store.get(blocks[0][0]) is not None  # block 0 is now the most recently used
    (extra,) = chain(1, first=50)
    assert store.put(*extra)
    store.flush()
    assert blocks[1][0] not in store and blocks[0][0] in store and extra[0] in store
    assert store.stats.evicted == 1 and store.size_bytes <= bound
    assert not store.path(blocks[1][0]).exists()
    store.close()


def test_interrupted_writes_are_cleaned_up_and_bad_sizes_rejected(tmp_path):
    store, blocks = written(tmp_path, n=1)
    leftover = store.path(blocks[0][0]).with_name("junk.123.tmp")
    leftover.write_bytes(b"partial")
    with pytest.raises(ValueError, match="64 bytes"):
        store.put(blocks[0][0], None, blocks[0][2], b"short")
    store.close()
    assert not store.put(*chain(1, first=9)[0])  # closed: nothing more is queued
    DiskPrefixStore(tmp_path, "model-a", BLOCK_BYTES).close()
    assert not leftover.exists()
    assert sorted(os.listdir(store.folder)) == [f"{blocks[0][0]:032x}"[:2]]


def test_a_file_removed_by_another_process_is_a_plain_miss(tmp_path):
    store, blocks = written(tmp_path)
    store.path(blocks[1][0]).unlink()  # as another server sharing the folder would, evicting it
    assert store.get(blocks[1][0]) is None and blocks[1][0] not in store
    assert store.stats.refused == 0 and store.get(blocks[0][0]) is not None
    store.close()
