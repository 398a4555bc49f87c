"""The CPU attention path (SDPABackend) against the plain-PyTorch reference on paged batches."""

from __future__ import annotations

import pytest
import torch
from paged_batch import make_paged_batch

from kvflow.kernels import paged_attention
from kvflow.layers.attention.metadata import AttentionMetadata
from kvflow.layers.attention.sdpa import SDPABackend

CASES = {
    "one decode": ([37], [1]),
    "decodes of mixed lengths (one loop)": ([1, 16, 17, 40], [1, 1, 1, 1]),
    "decodes of similar lengths (one padded batch)": ([20, 21, 22, 23], [1, 1, 1, 1]),
    "fresh prompt": ([33], [33]),
    "prefix hit + chunk, decode, fresh prompt": ([40, 21, 9], [7, 1, 9]),
}


@pytest.fixture(params=["cpp kernel", "cpp kernel, all rows", "pytorch ops"], autouse=True)
def decode_path(request, monkeypatch):
    """Every test runs three times: one-token queries through the C++ kernel; every row through it (the
    exact mode); everything through PyTorch ops (the path taken where no compiler is available)."""
    if request.param == "pytorch ops":
        monkeypatch.setattr(paged_attention, "available", lambda: False)
    elif not paged_attention.available():
        # Only on machines without g++ (CI has one): the PyTorch-ops run of the same test still checks them.
        pytest.skip("needs a C++ compiler (g++) to build the kernel")
    return request.param


def attend(decode_path: str, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The backend as a model layer runs it: its own metadata built once, then forward."""
    backend = SDPABackend(exact=decode_path == "cpp kernel, all rows")
    return backend.forward(q, k, v, k_cache, v_cache, backend.build_metadata(meta), scale)


def metadata(batch, contiguous: list[int] | None = None) -> AttentionMetadata:
    return AttentionMetadata(
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, query_lens_cpu=batch.query_lens_cpu,
        seq_lens_cpu=batch.seq_lens_cpu, slot_mapping=batch.slot_mapping, block_tables=batch.block_tables,
        contiguous_first_block=contiguous,
    )


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("group", [1, 3])
def test_matches_reference_on_shuffled_blocks(case, group, decode_path):
    seq_lens, query_lens = CASES[case]
    batch = make_paged_batch(seq_lens, query_lens, num_kv_heads=2, group=group, head_dim=64, block_size=16,
                             dtype=torch.float32, device=torch.device("cpu"))
    expected = batch.reference_output(scale=0.125)
    out = attend(decode_path, batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, metadata(batch), 0.125)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_consecutive_blocks_are_read_in_place(decode_path):
    """A sequence whose blocks are consecutive is attended through a slice of the cache, same result."""
    torch.manual_seed(0)
    block, hkv, group, d, seq_len = 8, 3, 3, 64, 29
    n_blocks = -(-seq_len // block)
    k_cache, v_cache = torch.randn(n_blocks + 5, block, hkv, d), torch.randn(n_blocks + 5, block, hkv, d)
    first = 2
    q, k, v = torch.randn(1, hkv * group, d), torch.randn(1, hkv, d), torch.randn(1, hkv, d)
    slot = (first * block + seq_len - 1)
    common = dict(query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                  seq_lens=torch.tensor([seq_len], dtype=torch.int32), query_lens_cpu=[1], seq_lens_cpu=[seq_len],
                  slot_mapping=torch.tensor([slot]),
                  block_tables=torch.arange(first, first + n_blocks, dtype=torch.int32)[None])
    kc, vc = k_cache.clone(), v_cache.clone()
    sliced = attend(decode_path, q, k, v, k_cache, v_cache, AttentionMetadata(**common,
                                   contiguous_first_block=[first]), 0.125)
    gathered = attend(decode_path, q, k, v, kc, vc, AttentionMetadata(**common), 0.125)
    torch.testing.assert_close(sliced, gathered, rtol=0, atol=0)
