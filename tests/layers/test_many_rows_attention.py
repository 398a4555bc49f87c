"""The fast mode's many-row attention (kernels/many_rows_attention): prompt chunks in bfloat16 on AMX tiles
(or PyTorch's bfloat16 flash kernel without AMX), one-token queries through the float32 paged kernel,
against the float32 reference on the same bfloat16-rounded inputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gpu.paged_batch import make_paged_batch

from kvflow.kernels import cpu_attention, many_rows_attention
from kvflow.layers.attention.metadata import AttentionMetadata
from kvflow.layers.linear import cpu_has_amx

CPU = torch.device("cpu")
SCALE = 0.125

# Only machines without g++ skip (CI has one): without the kernels the many-row path never runs.
pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="needs a C++ compiler (g++) to build")
# CI's machines have AMX; elsewhere the PyTorch fallback runs and is tested below.
needs_amx = pytest.mark.skipif(not cpu_has_amx(), reason="needs AMX (amx_bf16)")


def attend(batch, use_amx: bool, monkeypatch) -> torch.Tensor:
    """many_rows_attention.store_and_attend on a copy of the batch's caches: [T, Hq, D] float32."""
    monkeypatch.setattr(many_rows_attention, "_amx_kernel", many_rows_attention._amx_kernel if use_amx else lambda: None)
    rows, hq, d = batch.q.shape
    hkv = batch.k.shape[1]
    qkv = torch.cat([batch.q.reshape(rows, -1), batch.k.reshape(rows, -1), batch.v.reshape(rows, -1)], dim=1)
    layer = SimpleNamespace(k_cache=batch.k_cache.clone(), v_cache=batch.v_cache.clone(), scale=SCALE)
    meta = AttentionMetadata(
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, query_lens_cpu=batch.query_lens_cpu,
        seq_lens_cpu=batch.seq_lens_cpu, slot_mapping=batch.slot_mapping, block_tables=batch.block_tables)
    out = torch.full((rows, hq * d), float("nan"), dtype=torch.bfloat16)
    many_rows_attention.store_and_attend(qkv, hq, hkv, layer, meta, torch.empty(rows, hq, d), out)
    return out.view(rows, hq, d).float()


def reference_on_rounded_inputs(batch) -> torch.Tensor:
    """Float32 attention on the values the bfloat16 products see: q, the cache, and new K/V rounded as
    stored (to the cache's dtype) and then to bfloat16."""
    rounded = SimpleNamespace(**vars(batch))
    cache_dtype = batch.k_cache.dtype
    rounded.q = batch.q.to(torch.bfloat16).float()
    rounded.k, rounded.v = (t.to(cache_dtype).to(torch.bfloat16).float() for t in (batch.k, batch.v))
    rounded.k_cache, rounded.v_cache = (t.to(torch.bfloat16).float() for t in (batch.k_cache, batch.v_cache))
    return type(batch).reference_output(rounded, scale=SCALE)


def chunk_rows(batch) -> torch.Tensor:
    """Rows of sequences whose query has two or more tokens."""
    mask = torch.zeros(batch.q.shape[0], dtype=torch.bool)
    start = 0
    for lq in batch.query_lens_cpu:
        mask[start : start + lq] = lq > 1
        start += lq
    return mask


# Fresh prompts (query = whole sequence), chunks over cached context, tails of 1 to 15 rows, a mixed
# step with decode rows, long context; GQA groups 3 and 1; head sizes 64 and 128.
CASES = [
    ([512], [512], 3, 64),
    ([37, 200, 1000], [37, 64, 70], 3, 64),
    ([90, 50, 2], [1, 50, 2], 1, 128),
    ([130, 17], [129, 16], 2, 64),
]


@needs_amx
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seq_lens,query_lens,group,head_dim", CASES)
def test_amx_chunks_match_reference_like_pytorch_flash(seq_lens, query_lens, group, head_dim, cache_dtype, monkeypatch):
    batch = make_paged_batch(seq_lens, query_lens, num_kv_heads=3, group=group, head_dim=head_dim, block_size=16,
                             dtype=torch.float32, device=CPU, cache_dtype=cache_dtype)
    expected = reference_on_rounded_inputs(batch)
    ours = attend(batch, True, monkeypatch)
    flash = attend(batch, False, monkeypatch)
    chunk = chunk_rows(batch)
    # The probabilities are rounded to bfloat16 before P V (as PyTorch's flash kernel does), and the
    # output too: measured max 7e-3, mean 2e-4 on unit-normal inputs, the same as PyTorch's.
    torch.testing.assert_close(ours[chunk], expected[chunk], rtol=2e-2, atol=2e-2)
    ours_err = (ours[chunk] - expected[chunk]).abs().mean().item()
    flash_err = (flash[chunk] - expected[chunk]).abs().mean().item()
    assert ours_err <= 1.25 * flash_err + 1e-5, (ours_err, flash_err)
    # One-token queries: the float32 paged kernel's result, rounded once to bfloat16.
    assert torch.equal(ours[~chunk], flash[~chunk])


@pytest.mark.parametrize("seq_lens,query_lens,group,head_dim", CASES[1:3])
def test_pytorch_fallback_matches_reference(seq_lens, query_lens, group, head_dim, monkeypatch):
    """Where the AMX kernel cannot run (no AMX, other head sizes): PyTorch's bfloat16 flash kernel over the
    cached context gathered through the block table."""
    batch = make_paged_batch(seq_lens, query_lens, num_kv_heads=3, group=group, head_dim=head_dim, block_size=16,
                             dtype=torch.float32, device=CPU, cache_dtype=torch.float16)
    expected = reference_on_rounded_inputs(batch)
    flash = attend(batch, False, monkeypatch)
    chunk = chunk_rows(batch)
    torch.testing.assert_close(flash[chunk], expected[chunk], rtol=2e-2, atol=2e-2)
    # One-token rows: float32 on the cache as stored, then one bfloat16 rounding.
    stored = SimpleNamespace(**vars(batch))
    stored.k, stored.v = (t.to(torch.float16).float() for t in (batch.k, batch.v))
    exact = type(batch).reference_output(stored, scale=SCALE)[~chunk]
    torch.testing.assert_close(flash[~chunk], exact, rtol=8e-3, atol=1e-5)


@needs_amx
def test_amx_kernel_refuses_head_sizes_it_has_no_tiles_for(monkeypatch):
    """Head size 40: the kernel returns -1 and the PyTorch path answers instead."""
    batch = make_paged_batch([70], [70], num_kv_heads=2, group=2, head_dim=40, block_size=16,
                             dtype=torch.float32, device=CPU, cache_dtype=torch.float16)
    expected = reference_on_rounded_inputs(batch)
    torch.testing.assert_close(attend(batch, True, monkeypatch), expected, rtol=2e-2, atol=2e-2)
