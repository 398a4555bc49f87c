"""Split-K decode attention against the plain-PyTorch reference, over ragged lengths and block edges."""

from __future__ import annotations

import pytest
import torch

# Triton comes with CUDA builds of torch; the CPU build CI installs has none, so these skip there.
# benchmarks/gpu_check.sh runs them where a GPU is lent.
pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from paged_batch import DEVICE, assert_close, make_paged_batch  # noqa: E402

from kvflow.layers.attention.triton_kernels import choose_num_splits, decode_attention, store_kv  # noqa: E402

# (dtype, GQA group, head_dim, block_size): each value of each axis appears, without the full product,
# to keep the interpreter run short. The interpreter cannot do arithmetic on bfloat16 (numpy has no
# such type), so bf16 cases run on a GPU only.
CASES = [
    (torch.float32, 1, 64, 16), (torch.float16, 3, 128, 16), (torch.float16, 8, 64, 8),
    (torch.float32, 3, 64, 8), (torch.float16, 1, 128, 8), (torch.float32, 8, 128, 16),
]
if torch.cuda.is_available():
    CASES += [(torch.bfloat16, 1, 128, 16), (torch.bfloat16, 8, 128, 16), (torch.bfloat16, 3, 64, 8)]


def run_decode(batch, scale, num_splits, block_n=16):
    store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.slot_mapping)
    return decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale,
                            num_splits=num_splits, block_n=block_n)


@pytest.mark.parametrize(("dtype", "group", "head_dim", "block_size"), CASES)
def test_decode_ragged_lengths_at_block_edges(dtype, group, head_dim, block_size):
    seq_lens = [1, 15, 16, 17, 33]
    num_kv_heads = 2 if group == 1 else 1
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, device=DEVICE)
    scale = head_dim**-0.5
    expected = batch.reference_output(scale)
    assert_close(run_decode(batch, scale, num_splits=1), expected, dtype)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_decode_split_into_partitions_merges_exactly(num_splits):
    # 70 tokens in 16-token tiles: splits of 32, 32, 16 (3 splits) or several empty partitions (7).
    batch = make_paged_batch([70, 5, 1], [1, 1, 1], num_kv_heads=1, group=4, head_dim=64, block_size=16,
                             dtype=torch.float32, device=DEVICE, seed=3)
    expected = batch.reference_output(0.125)
    assert_close(run_decode(batch, 0.125, num_splits=num_splits), expected, torch.float32)


def test_padding_rows_with_zero_length_output_zeros_and_leave_others_alone():
    batch = make_paged_batch([20, 9], [1, 1], num_kv_heads=1, group=3, head_dim=64, block_size=8,
                             dtype=torch.float32, device=DEVICE, seed=4)
    expected = batch.reference_output(0.125)
    # Pad to 4 rows as a CUDA graph would: seq_len 0, slot -1, block table row of zeros.
    batch.q = torch.cat([batch.q, torch.randn_like(batch.q)])
    batch.k = torch.cat([batch.k, torch.randn_like(batch.k)])
    batch.v = torch.cat([batch.v, torch.randn_like(batch.v)])
    batch.slot_mapping = torch.cat([batch.slot_mapping, torch.full_like(batch.slot_mapping, -1)])
    batch.seq_lens = torch.cat([batch.seq_lens, torch.zeros_like(batch.seq_lens)])
    batch.block_tables = torch.cat([batch.block_tables, torch.zeros_like(batch.block_tables)])
    out = run_decode(batch, 0.125, num_splits=3)
    assert_close(out[:2], expected, torch.float32)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))


def test_choose_num_splits_fills_the_gpu_only_when_the_batch_does_not():
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=8192, num_sms=132) == 32  # 8192 / 256
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=100_000, num_sms=132) == 33  # 2 * 132 / 8
    assert choose_num_splits(batch=256, num_kv_heads=8, max_context=8192, num_sms=132) == 1
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=16, num_sms=132) == 1


def test_cache_stored_in_another_dtype_than_the_model():
    # kv_cache_dtype may differ from the model dtype: float32 queries over a float16 cache.
    batch = make_paged_batch([17, 40], [1, 1], num_kv_heads=1, group=3, head_dim=64, block_size=16,
                             dtype=torch.float32, device=DEVICE, cache_dtype=torch.float16, seed=7)
    expected = batch.reference_output(0.125)
    assert_close(run_decode(batch, 0.125, num_splits=2), expected, torch.float16)
