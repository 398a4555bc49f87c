"""The C++ paged-attention kernel (kvflow/kernels/paged_attention) against the plain-PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from paged_batch import at_slots, make_paged_batch

from kvflow.kernels import paged_attention
from kvflow.layers.attention.metadata import AttentionMetadata

CPU = torch.device("cpu")

# Only machines without g++ skip (CI has one); there kvflow falls back to PyTorch ops, tested elsewhere.
pytestmark = pytest.mark.skipif(not paged_attention.available(), reason="needs a C++ compiler (g++) to build")


def metadata(batch) -> AttentionMetadata:
    return AttentionMetadata(
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, query_lens_cpu=batch.query_lens_cpu,
        seq_lens_cpu=batch.seq_lens_cpu, slot_mapping=batch.slot_mapping, block_tables=batch.block_tables,
    )


def store_and_attend(q, k, v, k_cache, v_cache, meta, scale, out, all_rows=False, window=0, softcap=0.0,
                     sinks=None) -> None:
    step = paged_attention.step_struct(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables)
    layer = paged_attention.layer_struct(k_cache, v_cache, q.shape[1], scale, window, softcap, sinks)
    paged_attention.store_and_attend(layer, step, q, k, v, out, all_rows=all_rows)


def run_kernel(batch, scale=0.125):
    out = torch.zeros(batch.q.shape)
    assert paged_attention.supports(batch.q, batch.k, batch.v, batch.k_cache)
    store_and_attend(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, metadata(batch), scale, out)
    return out


# 2047 and 2048: each side of where contexts switch from 128- to 256-position chunks.
@pytest.mark.parametrize("seq_lens", [[1], [37], [128], [129], [1000, 3, 513], [2047, 2048, 2600]])
@pytest.mark.parametrize("group", [1, 3, 8, 16])
# 64 and 128: the fixed-size paths (positions scored in fours / pairs, value heads in passes of 4 / 2);
# 40: not a multiple of the vector width, the plain loops.
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_decode_matches_reference(seq_lens, group, head_dim):
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), num_kv_heads=2, group=group, head_dim=head_dim,
                             block_size=16, dtype=torch.float32, device=CPU)
    expected = batch.reference_output(scale=0.125)
    torch.testing.assert_close(run_kernel(batch), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_half_cache_matches_reference_on_rounded_values(cache_dtype, head_dim):
    """A 16-bit cache: the kernel widens stored values exactly, so the reference on the same rounded values
    agrees to float32 accuracy; new k/v are rounded on store exactly as torch's copy rounds them."""
    batch = make_paged_batch([300, 21], [1, 1], num_kv_heads=3, group=3, head_dim=head_dim, block_size=16,
                             dtype=torch.float32, device=CPU, cache_dtype=cache_dtype)
    new_k = batch.k.clone()
    batch.k, batch.v = batch.k.to(cache_dtype).float(), batch.v.to(cache_dtype).float()
    expected = batch.reference_output(scale=0.125)
    batch.k = new_k  # the kernel gets the unrounded rows and must round them itself
    torch.testing.assert_close(run_kernel(batch), expected, rtol=1e-5, atol=1e-5)
    stored = batch.k_cache[at_slots(batch.k_cache, batch.slot_mapping)]
    assert torch.equal(stored, new_k.to(cache_dtype))


def test_stores_every_token_and_skips_prefill_rows():
    """In a mixed step the kernel writes all new k/v (prefill rows too) but leaves prefill outputs alone."""
    batch = make_paged_batch([40, 21, 9], [7, 1, 9], num_kv_heads=2, group=3, head_dim=64, block_size=16,
                             dtype=torch.float32, device=CPU)
    expected = batch.reference_output(scale=0.125)
    out = run_kernel(batch)
    decode_row = 7
    torch.testing.assert_close(out[decode_row], expected[decode_row], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(out[:7]) == 0 and torch.count_nonzero(out[8:]) == 0
    assert torch.equal(batch.k_cache[at_slots(batch.k_cache, batch.slot_mapping)], batch.k)


def test_strided_value_rows():
    """v arrives as a column slice of the fused qkv projection: rows strided, heads contiguous."""
    batch = make_paged_batch([50, 70], [1, 1], num_kv_heads=2, group=3, head_dim=64, block_size=16,
                             dtype=torch.float32, device=CPU)
    fused = torch.cat([batch.k.flatten(1), batch.v.flatten(1)], dim=1)
    batch.v = fused[:, 128:].view(-1, 2, 64)
    assert not batch.v.is_contiguous()
    expected = batch.reference_output(scale=0.125)
    torch.testing.assert_close(run_kernel(batch), expected, rtol=1e-5, atol=1e-5)


def test_a_sequence_result_is_bitwise_independent_of_batch_and_threads():
    long = make_paged_batch([900], [1], num_kv_heads=2, group=3, head_dim=64, block_size=16,
                            dtype=torch.float32, device=CPU, seed=3)
    alone = run_kernel(long)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = run_kernel(make_paged_batch([900], [1], num_kv_heads=2, group=3, head_dim=64,
                                                 block_size=16, dtype=torch.float32, device=CPU, seed=3))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, one_thread)
    # The same sequence as the second of three: same q and context, other sequences around it.
    batch = make_paged_batch([30, 900, 500], [1, 1, 1], num_kv_heads=2, group=3, head_dim=64, block_size=16,
                             dtype=torch.float32, device=CPU, seed=4)
    batch.q[1], batch.k[1], batch.v[1] = long.q[0], long.k[0], long.v[0]
    for p in range(899):  # copy the long sequence's cached context into this batch's blocks
        src = long.block_tables[0, p // 16] * 16 + p % 16
        dst = batch.block_tables[1, p // 16] * 16 + p % 16
        batch.k_cache[at_slots(batch.k_cache, dst)] = long.k_cache[at_slots(long.k_cache, src)]
        batch.v_cache[at_slots(batch.v_cache, dst)] = long.v_cache[at_slots(long.v_cache, src)]
    assert torch.equal(run_kernel(batch)[1], alone[0])


def test_refuses_what_it_cannot_take():
    batch = make_paged_batch([10], [1], num_kv_heads=2, group=3, head_dim=64, block_size=16,
                             dtype=torch.float32, device=CPU, cache_dtype=torch.float64)
    assert not paged_attention.supports(batch.q, batch.k, batch.v, batch.k_cache)
    batch = make_paged_batch([10], [1], num_kv_heads=2, group=3, head_dim=64, block_size=16,
                             dtype=torch.bfloat16, device=CPU)  # bf16 activations: not this kernel's
    assert not paged_attention.supports(batch.q, batch.k, batch.v, batch.k_cache)


# The second set: a chunk whose rows' contexts cross 2048 (128- then 256-position chunks).
@pytest.mark.parametrize(("seq_lens", "query_lens"), [([40, 21, 9, 300], [7, 1, 9, 130]), ([2080, 5], [60, 1])])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_all_rows_match_reference_in_a_mixed_step(head_dim, seq_lens, query_lens):
    """all_rows: prefill rows (a fresh prompt, a chunk after cached context) and decode rows alike."""
    batch = make_paged_batch(seq_lens, query_lens, num_kv_heads=2, group=3, head_dim=head_dim,
                             block_size=16, dtype=torch.float32, device=CPU)
    expected = batch.reference_output(scale=0.125)
    out = torch.zeros(batch.q.shape)
    store_and_attend(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, metadata(batch), 0.125, out,
                     all_rows=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# 2060 tokens: the later rows' contexts cross 2048, where a row's positions go in longer chunks. With a
# sliding window (and capped scores), rows of one block start their windows at different chunks.
@pytest.mark.parametrize(("head_dim", "n", "window", "softcap"), [
    (64, 300, 0, 0.0), (128, 300, 0, 0.0), (40, 300, 0, 0.0), (64, 2060, 0, 0.0),
    (64, 300, 100, 0.0), (128, 300, 7, 2.0), (40, 300, 130, 0.0), (64, 2060, 1500, 3.0)])
def test_all_rows_result_does_not_depend_on_chunking(head_dim, n, window, softcap):
    """A prompt attended in one step, or as chunks of a third and two thirds (the second over the cached
    first part), or one token at a time, on 2 threads or 1: every row bitwise equal. Rows are grouped 16
    at a time per chunk of positions, but each row's arithmetic is its own."""
    torch.manual_seed(0)
    hkv, group, d, block = 2, 3, head_dim, 16
    q, k, v = torch.randn(n, hkv * group, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    blocks = -(-n // block)
    table = torch.randperm(blocks + 4)[:blocks].to(torch.int32)[None]
    slots = (table[0].long()[torch.arange(n) // block] * block + torch.arange(n) % block)

    def step(lo, hi, k_cache, v_cache):
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, hi - lo], dtype=torch.int32),
            seq_lens=torch.tensor([hi], dtype=torch.int32), query_lens_cpu=[hi - lo], seq_lens_cpu=[hi],
            slot_mapping=slots[lo:hi], block_tables=table)
        out = torch.zeros(hi - lo, hkv * group, d)
        store_and_attend(q[lo:hi], k[lo:hi], v[lo:hi], k_cache, v_cache, meta, 0.125, out, all_rows=True,
                         window=window, softcap=softcap)
        return out

    shape = (blocks + 4, block, hkv, d)
    whole = step(0, n, torch.zeros(shape, dtype=torch.float16), torch.zeros(shape, dtype=torch.float16))
    kc, vc = torch.zeros(shape, dtype=torch.float16), torch.zeros(shape, dtype=torch.float16)
    split = torch.cat([step(0, n // 3, kc, vc), step(n // 3, n, kc, vc)])
    assert torch.equal(whole, split)
    kc, vc = torch.zeros(shape, dtype=torch.float16), torch.zeros(shape, dtype=torch.float16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_by_one = torch.cat([step(i, i + 1, kc, vc) for i in range(n)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, one_by_one)


# Windows shorter than a chunk, across a chunk boundary, longer than some contexts; capped scores alone
# and with a window; contexts crossing 2048 (256-position chunks).
@pytest.mark.parametrize(("window", "softcap"), [(1, 0.0), (17, 0.0), (128, 0.0), (300, 0.0), (0, 5.0), (50, 1.0)])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_sliding_window_and_softcap_match_reference(window, softcap, head_dim):
    batch = make_paged_batch([40, 21, 9, 300, 2080], [7, 1, 9, 130, 1], num_kv_heads=2, group=3,
                             head_dim=head_dim, block_size=16, dtype=torch.float32, device=CPU)
    expected = batch.reference_output(scale=0.125, window=window, softcap=softcap)
    out = torch.zeros(batch.q.shape)
    store_and_attend(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, metadata(batch), 0.125, out,
                     all_rows=True, window=window, softcap=softcap)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    no_window = batch.reference_output(scale=0.125)
    assert not torch.allclose(expected, no_window, atol=1e-3)  # the window and cap really change the result


# gpt-oss's sinks: a head whose sink outweighs its scores (large), one where the scores win (negative),
# alone and with a window; every row (prompt rows too) and a one-token decode row.
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_sinks_match_reference(window, head_dim):
    batch = make_paged_batch([40, 21, 300, 2080], [7, 1, 130, 1], num_kv_heads=2, group=3,
                             head_dim=head_dim, block_size=16, dtype=torch.float32, device=CPU)
    sinks = torch.tensor([4.0, -3.0, 0.5, 1.0, 8.0, -1.0])
    expected = batch.reference_output(scale=0.125, window=window, sinks=sinks)
    out = torch.zeros(batch.q.shape)
    store_and_attend(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, metadata(batch), 0.125, out,
                     all_rows=True, window=window, sinks=sinks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    without = batch.reference_output(scale=0.125, window=window)
    assert not torch.allclose(expected, without, atol=1e-3)  # the sinks really change the result
    # A sink only shrinks a row: each head's output is the sink-free one times Z / (Z + e^sink) < 1.
    shrink = (expected.norm(dim=-1) / without.norm(dim=-1))
    assert bool((shrink < 1).all()) and float(shrink[:, 4].max()) < float(shrink[:, 1].min())


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_token_and_head_major_caches_give_the_same_bits(cache_dtype, head_dim):
    """The same values stored in either block layout (kvflow_cpu.h): every output row and every stored row
    is bitwise the same, decode rows and prompt rows alike (the arithmetic does not depend on addresses)."""
    outs, stored = [], []
    for layout in ("token", "head"):
        batch = make_paged_batch([40, 21, 300], [7, 1, 130], num_kv_heads=2, group=3, head_dim=head_dim,
                                 block_size=16, dtype=torch.float32, device=CPU, cache_dtype=cache_dtype,
                                 layout=layout)
        assert paged_attention.cache_layout(batch.k_cache) == layout
        out = torch.zeros(batch.q.shape)
        store_and_attend(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, metadata(batch), 0.125, out,
                         all_rows=True)
        outs.append(out)
        stored.append(batch.v_cache.contiguous())
    assert torch.equal(outs[0], outs[1]) and torch.count_nonzero(outs[0]) > 0
    assert torch.equal(stored[0], stored[1])


def test_a_cache_in_neither_layout_is_refused():
    batch = make_paged_batch([10], [1], num_kv_heads=2, group=3, head_dim=64, block_size=16,
                             dtype=torch.float32, device=CPU)
    odd = batch.k_cache.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1)  # the head's values strided
    assert paged_attention.cache_layout(odd) is None
    assert not paged_attention.supports(batch.q, batch.k, batch.v, odd)
    with pytest.raises(ValueError, match="token- or head-major"):
        paged_attention.layer_struct(odd, odd, 6, 0.125)
