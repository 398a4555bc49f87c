"""Huge-page buffers (kernels/huge_pages): the KV cache and packed weights a decode step streams sit on 2 MiB
pages where Linux grants them, with the same values as ordinary buffers."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvflow.engine.kv_cache_alloc import allocate_kv_cache
from kvflow.kernels import huge_pages, packed_matmul
from kvflow.kernels.packed_weight import PackedWeight
from kvflow.layers.quant.packed_linear import PackedLinear
from kvflow.models.arch import ArchConfig

MIB = 1 << 20


def thp_mode() -> str | None:
    """The bracketed mode of /sys/kernel/mm/transparent_hugepage/enabled (always, madvise, never)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


# Where the advice can take effect; elsewhere the buffers are ordinary ones (checked for values only).
HUGE_PAGES_EXPECTED = hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping that holds ``address``, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_huge_page_zeros_are_zero_aligned_and_backed_by_huge_pages():
    buf = huge_pages.huge_page_zeros(6 * MIB + 123)
    assert buf.dtype == torch.uint8 and buf.numel() == 6 * MIB + 123
    assert int(buf.count_nonzero()) == 0
    buf.fill_(5)  # first touch: the OS maps the pages now
    assert int(buf[-1]) == 5 and int(buf.sum()) == 5 * buf.numel()
    if HUGE_PAGES_EXPECTED:
        assert buf.data_ptr() % huge_pages.HUGE_PAGE == 0
        assert anon_huge_kib(buf.data_ptr()) >= 4 * 1024, "MADV_HUGEPAGE did not give huge pages"


def test_small_or_disabled_buffers_are_ordinary_zeros(monkeypatch):
    small = huge_pages.huge_page_zeros(4096)
    assert small.numel() == 4096 and int(small.count_nonzero()) == 0
    monkeypatch.setattr(huge_pages, "enabled", False)
    off = huge_pages.huge_page_zeros(4 * MIB)
    assert off.numel() == 4 * MIB and int(off.count_nonzero()) == 0
    t = [torch.arange(MIB, dtype=torch.float32)] * 2
    assert huge_pages.onto_huge_pages(t)[0] is t[0]


def test_arena_cuts_small_buffers_side_by_side_and_leaves_large_ones(monkeypatch):
    arena = huge_pages.HugePageArena(chunk=2 * MIB)
    a, b = arena.zeros(1000), arena.zeros(MIB)
    assert a.numel() == 1000 and b.numel() == MIB and int(b.count_nonzero()) == 0
    assert b.data_ptr() == a.data_ptr() + 1024  # 64-byte aligned, right after a
    c = arena.zeros(MIB + MIB // 2)  # past the chunk's end: a new chunk
    assert c.data_ptr() != b.data_ptr() + MIB
    assert arena.zeros(huge_pages.MIN_BYTES) is None  # a huge page or more: its own buffer
    monkeypatch.setattr(huge_pages, "enabled", False)
    assert arena.zeros(1000) is None


def test_onto_huge_pages_copies_side_by_side_aligned():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(300, 1001, generator=gen), torch.randint(0, 255, (3, 7777), dtype=torch.uint8),
               torch.randn(2 * MIB // 4, generator=gen).half()]
    copies = huge_pages.onto_huge_pages(tensors)
    for t, c in zip(tensors, copies):
        assert c is not t and c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
        assert torch.equal(c, t)
        assert c.data_ptr() % 64 == 0
    ends = [c.data_ptr() + c.numel() * c.element_size() for c in copies]
    assert all(ends[i] <= copies[i + 1].data_ptr() for i in range(len(copies) - 1))  # in order, no overlap
    assert copies[-1].data_ptr() - copies[0].data_ptr() < 8 * MIB  # one buffer
    copies[0].fill_(0)  # copies, not views of the originals
    assert tensors[0].abs().sum() > 0


def test_kv_cache_starts_untouched_and_on_huge_pages():
    arch = ArchConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                      rope_theta=1e4, rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=False)
    caches = allocate_kv_cache(arch, num_blocks=4096, block_size=16, dtype=torch.float16, device=torch.device("cpu"))
    assert len(caches) == 2
    for k, v in caches:
        assert k.shape == (4096, 16, 2, 16) and k.dtype == torch.float16
        assert int(k.count_nonzero()) == 0 and int(v.count_nonzero()) == 0
        if HUGE_PAGES_EXPECTED:
            assert k.data_ptr() % huge_pages.HUGE_PAGE == 0 and v.data_ptr() % huge_pages.HUGE_PAGE == 0


# Skipped only where Linux grants no transparent huge pages (THP "never", or not Linux): there the weights
# stay where packing put them, as intended. CI's machines, like this one, run THP in "madvise" mode.
@pytest.mark.skipif(not HUGE_PAGES_EXPECTED, reason="the machine grants no transparent huge pages (CI's does)")
# The GGUF's layers load as PackedLinear wherever the kernel library builds (every CPU tier); without a
# C++ compiler they are PyTorch's int4 layers, which this move does not take.
@pytest.mark.skipif(not packed_matmul.available(), reason="needs a C++ compiler to build the kernels")
def test_loaded_packed_weights_are_on_huge_pages():
    """A weight of a huge page or more is packed straight into a huge-page buffer of its own; the smaller
    ones are packed side by side, in the order a step reads them, into one shared buffer (the load's
    arena), so none is copied afterwards. (A load that maps its weights from the packed-weight cache
    keeps them on the file's pages instead: tests/loader/test_packed_cache.py.)"""
    from kvflow.config import ModelConfig
    from kvflow.executors.model_setup import load_model

    loaded = load_model(ModelConfig(device="cpu", max_model_len=512, packed_cache="off"))
    packed = [m.packed for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * loaded.arch.num_layers + 1  # every layer's projections and the output head
    small = [pw for pw in packed if pw.nbytes() < huge_pages.MIN_BYTES]
    large = [pw for pw in packed if pw.nbytes() >= huge_pages.MIN_BYTES]
    assert small and large  # the default model's projections, and its output head
    assert all(pw.on_huge_pages for pw in small)
    starts = [pw.data.data_ptr() for pw in small]
    assert starts == sorted(starts), "weights are laid out in the order a step reads them"
    assert starts[0] % huge_pages.HUGE_PAGE == 0
    total = sum(pw.nbytes() for pw in small)
    assert starts[-1] + small[-1].nbytes() - starts[0] < total + 64 * len(small)  # side by side
    assert anon_huge_kib(starts[0]) * 1024 >= total // 2
    for pw in large:
        assert pw.on_huge_pages and pw.data.data_ptr() % huge_pages.HUGE_PAGE == 0
        assert anon_huge_kib(pw.data.data_ptr()) * 1024 >= pw.nbytes() // 2
    for pw in packed:  # the structs the C++ kernels read point at the bytes where they are now
        assert isinstance(pw, PackedWeight) and pw.struct.data == pw.data.data_ptr()


def test_env_switch_turns_huge_pages_off():
    code = ("from kvflow.kernels import huge_pages as h; import torch; b = h.huge_page_zeros(8 << 20); "
            "t = [torch.ones(1 << 20)]; print(h.enabled, h.onto_huge_pages(t)[0] is t[0], b._base is None)")
    env = {**os.environ, "KVFLOW_HUGE_PAGES": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "True"]  # off, nothing moved, a plain (calloc) buffer
