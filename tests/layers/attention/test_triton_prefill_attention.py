"""Varlen prefill attention against the plain-PyTorch reference: fresh prompts, prefix-cached context
plus a new chunk, ragged lengths across block edges, GQA."""

from __future__ import annotations

import pytest
import torch

# Triton comes with CUDA builds of torch; the CPU build CI installs has none, so these skip there.
# benchmarks/gpu_check.sh runs them where a GPU is lent.
pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from paged_batch import DEVICE, assert_close, make_paged_batch  # noqa: E402

from kvflow.layers.attention.triton_kernels import prefill_attention, store_kv  # noqa: E402

# (dtype, GQA group, head_dim, block_size); bf16 only on a GPU (the interpreter cannot compute in it).
CASES = [
    (torch.float32, 1, 64, 16), (torch.float16, 3, 128, 8), (torch.float16, 8, 64, 16), (torch.float32, 3, 64, 8),
]
if torch.cuda.is_available():
    CASES += [(torch.bfloat16, 1, 128, 16), (torch.bfloat16, 8, 128, 16), (torch.bfloat16, 3, 64, 8)]


def run_prefill(batch, scale, block_m=16, block_n=16):
    store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.slot_mapping)
    return prefill_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
        max(batch.query_lens_cpu), scale, block_m=block_m, block_n=block_n,
    )


@pytest.mark.parametrize(("dtype", "group", "head_dim", "block_size"), CASES)
def test_fresh_prompts_of_ragged_lengths(dtype, group, head_dim, block_size):
    lens = [1, 15, 16, 17, 33]
    batch = make_paged_batch(lens, lens, num_kv_heads=1, group=group, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, device=DEVICE)
    scale = head_dim**-0.5
    assert_close(run_prefill(batch, scale), batch.reference_output(scale), dtype)


@pytest.mark.parametrize(("dtype", "group", "head_dim", "block_size"), CASES[:2])
def test_cached_prefix_plus_new_chunk_mixed_with_decode_and_fresh_prompt(dtype, group, head_dim, block_size):
    # (seq_len, query_len): a prefix hit of 32 + 17 new, a chunk of 16 after 24 cached (unaligned),
    # a decode token, a fresh prompt.
    seq_lens, query_lens = [49, 40, 18, 9], [17, 16, 1, 9]
    batch = make_paged_batch(seq_lens, query_lens, num_kv_heads=2, group=group, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, device=DEVICE, seed=5)
    scale = head_dim**-0.5
    assert_close(run_prefill(batch, scale), batch.reference_output(scale), dtype)


@pytest.mark.parametrize(("block_m", "block_n"), [(16, 32), (32, 16)])
def test_tile_shapes_do_not_change_the_answer(block_m, block_n):
    # Query tiles wider and narrower than key tiles: the unmasked/causal split must line up either way.
    batch = make_paged_batch([50, 7], [30, 7], num_kv_heads=1, group=2, head_dim=64, block_size=16,
                             dtype=torch.float32, device=DEVICE, seed=6)
    assert_close(run_prefill(batch, 0.125, block_m, block_n), batch.reference_output(0.125), torch.float32)


def test_cache_stored_in_another_dtype_than_the_model():
    # kv_cache_dtype may differ from the model dtype: float32 queries over a float16 cache.
    batch = make_paged_batch([40, 9], [20, 9], num_kv_heads=1, group=3, head_dim=64, block_size=16,
                             dtype=torch.float32, device=DEVICE, cache_dtype=torch.float16, seed=8)
    assert_close(run_prefill(batch, 0.125), batch.reference_output(0.125), torch.float16)
