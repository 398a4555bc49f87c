"""Prompt chunks' attention in bfloat16 on AMX tiles (csrc/prefill_attention_amx.cpp), which the native
decoder uses for many-row steps on AMX CPUs, against the float32 reference on the same bfloat16-rounded
inputs, and no worse than PyTorch's bfloat16 flash kernel on them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from paged_batch import make_paged_batch

from kvflow.kernels import cpu_features, paged_attention
from kvflow.layers.attention import reference

CPU = torch.device("cpu")
SCALE = 0.125

# Only machines without g++ skip (CI has one).
pytestmark = pytest.mark.skipif(not paged_attention.available(), reason="needs a C++ compiler (g++) to build")
# The tile kernel needs AMX; where the CPU lacks it, the refusal is what is tested.
needs_amx = pytest.mark.skipif(cpu_features.machine_tier() != "amx", reason="needs AMX (amx_bf16)")


def tile_attention(batch) -> tuple[torch.Tensor, bool]:
    """K/V stored through the paged kernel (as the native decoder does first), then the tile kernel on
    copies of the batch's caches: ([T, Hq, D] float32 with chunk rows filled, whether it ran)."""
    rows, hq, d = batch.q.shape
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    step = paged_attention.step_struct(batch.slot_mapping, batch.query_start_loc, batch.seq_lens, batch.block_tables)
    layer = paged_attention.layer_struct(k_cache, v_cache, hq, SCALE)
    paged_attention.store_and_attend(layer, step, batch.q, batch.k, batch.v, torch.empty(rows, hq, d))
    out = torch.full((rows, hq * d), float("nan"), dtype=torch.bfloat16)
    ran = paged_attention.prompt_attention_bf16(layer, step, batch.q.reshape(rows, -1), out)
    return out.view(rows, hq, d).float(), ran


def rounded(batch) -> SimpleNamespace:
    """The values the bfloat16 products see: q, the cache, and new K/V rounded as stored, then to bfloat16."""
    r = SimpleNamespace(**vars(batch))
    cache_dtype = batch.k_cache.dtype
    r.q = batch.q.to(torch.bfloat16).float()
    r.k, r.v = (t.to(cache_dtype).to(torch.bfloat16).float() for t in (batch.k, batch.v))
    r.k_cache, r.v_cache = (t.to(torch.bfloat16).float() for t in (batch.k_cache, batch.v_cache))
    return r


def flash_bf16(r: SimpleNamespace) -> torch.Tensor:
    """PyTorch's bfloat16 flash kernel on the rounded values, per sequence, over its whole context."""
    k_cache, v_cache = r.k_cache.clone(), r.v_cache.clone()
    reference.write_kv(r.k, r.v, k_cache, v_cache, r.slot_mapping)
    out = torch.zeros(r.q.shape)
    start = 0
    for b, (lq, lk) in enumerate(zip(r.query_lens_cpu, r.seq_lens_cpu)):
        q = r.q[start:start + lq].to(torch.bfloat16)
        k = reference.gather_kv(k_cache, r.block_tables[b], lk).to(torch.bfloat16)
        v = reference.gather_kv(v_cache, r.block_tables[b], lk).to(torch.bfloat16)
        mask = torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None]
        group = q.shape[1] // k.shape[1]
        qt, kt, vt = q.transpose(0, 1)[None], k.repeat_interleave(group, 1).transpose(0, 1)[None], \
            v.repeat_interleave(group, 1).transpose(0, 1)[None]
        out[start:start + lq] = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=SCALE)[0] \
            .transpose(0, 1).float()
        start += lq
    return out


def chunk_rows(batch) -> torch.Tensor:
    """Rows of sequences whose query has two or more tokens."""
    mask = torch.zeros(batch.q.shape[0], dtype=torch.bool)
    start = 0
    for lq in batch.query_lens_cpu:
        mask[start : start + lq] = lq > 1
        start += lq
    return mask


# Fresh prompts (query = whole sequence), chunks over cached context, tails of 1 to 15 rows, a mixed
# step with decode rows, long context; GQA groups 4, 3, 2 and 1; head sizes 64 and 128. The kernel takes
# keys in blocks of 256 with a running max: chunks deep into a long context (up to 32K) cross many blocks,
# and rows of one item end in different blocks.
CASES = [
    ([512], [512], 3, 64),
    ([37, 200, 1000], [37, 64, 70], 3, 64),
    ([90, 50, 2], [1, 50, 2], 1, 128),
    ([130, 17], [129, 16], 2, 64),
    ([2100, 700], [600, 700], 4, 64),
    ([5000], [300], 1, 128),
    ([32768], [40], 3, 64),
    # Short chunks deep in a context (an agent's next turn, a speculative check): the heads' rows share
    # tiles and the keys are split among work items, the splits merged after; beside a long chunk.
    ([16384], [80], 3, 64),
    ([9000], [5], 4, 64),
    ([6000], [7], 1, 128),
    ([4100, 3000, 700], [100, 2, 600], 3, 64),
]


@needs_amx
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seq_lens,query_lens,group,head_dim", CASES)
def test_tiles_match_reference_like_pytorch_flash(seq_lens, query_lens, group, head_dim, cache_dtype):
    batch = make_paged_batch(seq_lens, query_lens, num_kv_heads=3, group=group, head_dim=head_dim, block_size=16,
                             dtype=torch.float32, device=CPU, cache_dtype=cache_dtype)
    r = rounded(batch)
    expected = type(batch).reference_output(r, scale=SCALE)
    ours, ran = tile_attention(batch)
    assert ran
    chunk = chunk_rows(batch)
    # The probabilities are rounded to bfloat16 before P V (as PyTorch's flash kernel does), and the
    # output too: an error of the same size as PyTorch's.
    torch.testing.assert_close(ours[chunk], expected[chunk], rtol=2e-2, atol=2e-2)
    ours_err = (ours[chunk] - expected[chunk]).abs().mean().item()
    flash_err = (flash_bf16(r)[chunk] - expected[chunk]).abs().mean().item()
    assert ours_err <= 1.25 * flash_err + 1e-5, (ours_err, flash_err)
    assert torch.isnan(ours[~chunk]).all()  # one-token rows are the paged kernel's, left alone here


def test_refuses_what_it_has_no_tiles_for_and_writes_nothing():
    """Head size 40 anywhere, and every shape on a CPU without AMX: False, out untouched."""
    head_dims = [40] if cpu_features.machine_tier() == "amx" else [40, 64]
    for head_dim in head_dims:
        batch = make_paged_batch([70], [70], num_kv_heads=2, group=2, head_dim=head_dim, block_size=16,
                                 dtype=torch.float32, device=CPU, cache_dtype=torch.float16)
        out, ran = tile_attention(batch)
        assert not ran
        assert torch.isnan(out).all()
