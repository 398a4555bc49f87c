"""The packed-weight cache (kvflow/loader/packed_cache.py): a GGUF model's packed bytes written on its first
load and mapped on the next ones, refused when damaged, replayed only while the pack calls match."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.executors.model_setup import load_model
from kvflow.kernels import packed_matmul
from kvflow.layers.quant.packed_linear import PackedLinear
from kvflow.loader.packed_cache import MAGIC, SUFFIX, PackedCache

# The cache holds what the C++ packer writes; without a C++ compiler (CI has g++) nothing is packed or cached.
pytestmark = pytest.mark.skipif(not packed_matmul.available(), reason="the packed kernels need a C++ compiler")

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


def _load(model, folder):
    loaded = load_model(ModelConfig(model=str(model), device="cpu", max_model_len=512, quantization="gguf",
                                    dtype="float32", packed_cache=str(folder)))
    if loaded.packed_cache.writer is not None:
        loaded.packed_cache.writer.join()
    return loaded


def _packed_bytes(loaded) -> list[torch.Tensor]:
    return [m.packed.data for m in loaded.model.modules() if isinstance(m, PackedLinear)]


def _greedy(loaded) -> list[list[int]]:
    outs = LLM(loaded_model=loaded).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    return [o.outputs[0].token_ids for o in outs]


def _cache_file(folder):
    files = list(folder.glob(f"*{SUFFIX}"))
    assert len(files) == 1, files
    return files[0]


def test_a_second_load_maps_the_bytes_the_first_packed_and_answers_the_same(default_gguf, tmp_path):
    off = load_model(ModelConfig(device="cpu", max_model_len=512, quantization="gguf", dtype="float32",
                                 packed_cache="off"))
    assert off.packed_cache is None
    first = _load(default_gguf, tmp_path)
    calls = first.packed_cache.stats.packed
    assert calls > 0 and first.packed_cache.stats.hits == 0
    path = _cache_file(tmp_path)
    second = _load(default_gguf, tmp_path)
    assert second.packed_cache.stats.hits == calls and second.packed_cache.stats.packed == 0
    assert second.packed_cache.writer is None  # replayed whole: nothing rewritten
    mapped = _packed_bytes(second)
    for a, b, c in zip(_packed_bytes(off), _packed_bytes(first), mapped, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    # The second load's weights are the file's pages, not a copy of them.
    size = path.stat().st_size
    with open("/proc/self/maps") as f:
        regions = [line.split() for line in f if line.rstrip().endswith(str(path))]
    spans = [tuple(int(x, 16) for x in r[0].split("-")) for r in regions]
    assert spans and all(any(lo <= t.data_ptr() < hi for lo, hi in spans) for t in mapped)
    assert max(hi - lo for lo, hi in spans) >= size - 4096
    assert _greedy(second) == _greedy(off)


@pytest.mark.parametrize("damage", ["truncated", "header", "foreign"])
def test_a_damaged_or_foreign_file_is_refused_and_packed_afresh(default_gguf, tmp_path, damage):
    first = _load(default_gguf, tmp_path)
    calls = first.packed_cache.stats.packed
    path = _cache_file(tmp_path)
    good = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "header":  # one entry's shape changed, the digest left as it was
        (header_len,) = struct.unpack("<Q", good[len(MAGIC):len(MAGIC) + 8])
        start = len(MAGIC) + 8
        header = json.loads(good[start:start + header_len])
        header["entries"][0]["data"][1] += 1
        text = json.dumps(header).encode().ljust(header_len)
        assert len(text) == header_len
        path.write_bytes(good[:start] + text + good[start + header_len:])
    else:  # another model's file under this one's name
        header_len = struct.unpack("<Q", good[len(MAGIC):len(MAGIC) + 8])[0]
        start = len(MAGIC) + 8
        header = json.loads(good[start:start + header_len])
        header["key"] = "0" * 32
        path.write_bytes(good[:start] + json.dumps(header).encode().ljust(header_len) + good[start + header_len:])
    again = _load(default_gguf, tmp_path)
    stats = again.packed_cache.stats
    assert stats.refused and stats.hits == 0 and stats.packed == calls
    assert path.read_bytes() == good  # written anew, whole
    for a, b in zip(_packed_bytes(first), _packed_bytes(again), strict=True):
        assert torch.equal(a, b)


def test_a_changed_model_file_is_never_served_its_old_bytes(default_gguf, tmp_path):
    model = tmp_path / "model.gguf"
    shutil.copy(default_gguf, model)
    folder = tmp_path / "cache"
    _load(model, folder)
    old = _cache_file(folder)
    os.utime(model, ns=(model.stat().st_atime_ns, model.stat().st_mtime_ns + 10**9))  # "edited"
    again = _load(model, folder)
    assert again.packed_cache.stats.hits == 0 and again.packed_cache.stats.packed > 0
    assert again.packed_cache.path != old and old.exists() and again.packed_cache.path.exists()


def _record(folder, key, signatures, max_bytes=None, size=1000):
    cache = PackedCache(folder, key, max_bytes)
    for i, sig in enumerate(signatures):
        cache.add(sig, True, torch.full((size,), i, dtype=torch.uint8), None)
    cache.finish()
    if cache.writer is not None:
        cache.writer.join()
    return cache


def test_replay_stops_at_the_first_call_that_differs(tmp_path):
    _record(tmp_path, "k", [["a"], ["b"], ["c"]])
    cache = PackedCache(tmp_path, "k")
    assert cache.take(["a"]).data.tolist() == [0] * 1000
    assert cache.take(["B"]) is None  # differs: packed by the caller from here on
    cache.add(["B"], True, torch.full((10,), 7, dtype=torch.uint8), None)
    assert cache.take(["c"]) is None  # the file's later entries are no longer trusted
    cache.add(["c"], False, None, None)  # a call the packer refused is recorded as refused
    cache.finish()
    cache.writer.join()
    again = PackedCache(tmp_path, "k")
    entries = [again.take(s) for s in (["a"], ["B"], ["c"])]
    assert [e.ok for e in entries] == [True, True, False]
    assert entries[1].data.tolist() == [7] * 10 and entries[2].data is None
    again.finish()
    assert again.writer is None and again.stats.hits == 3


def test_the_folder_stays_under_its_bound_least_recently_used_first(tmp_path):
    bound = 5 << 20  # each file is a 2 MiB header page and 1,000 bytes: two fit, three do not
    for key in ("one", "two"):
        _record(tmp_path, key, [["x"]], max_bytes=bound)
    assert sorted(p.stem for p in tmp_path.glob(f"*{SUFFIX}")) == ["one", "two"]
    os.utime(tmp_path / f"one{SUFFIX}", ns=(0, 0))
    reused = PackedCache(tmp_path, "one")
    assert reused.take(["x"]) is not None
    reused.finish()  # a whole replay: "one" is now the most recently used, "two" the least
    _record(tmp_path, "three", [["x"]], max_bytes=bound)
    assert sorted(p.stem for p in tmp_path.glob(f"*{SUFFIX}")) == ["one", "three"]
    _record(tmp_path, "huge", [["x"]], max_bytes=1 << 20)  # larger than the whole bound: not written
    assert not (tmp_path / f"huge{SUFFIX}").exists()
    (tmp_path / f"one{SUFFIX}.999999999.tmp").write_bytes(b"partial")  # a writer killed mid-file
    _record(tmp_path, "four", [["x"]], max_bytes=bound)
    assert not (tmp_path / f"one{SUFFIX}.999999999.tmp").exists()
