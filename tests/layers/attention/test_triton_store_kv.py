"""store_kv against reference.write_kv: every slot written, padding slots (-1) skipped, strided inputs."""

from __future__ import annotations

import pytest
import torch

# Triton comes with CUDA builds of torch; the CPU build CI installs has none, so these skip there.
# benchmarks/gpu_check.sh runs them where a GPU is lent.
pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from paged_batch import DEVICE  # noqa: E402

from kvflow.layers.attention import reference  # noqa: E402
from kvflow.layers.attention.triton_kernels import store_kv  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(2, 64, 16), (1, 128, 8), (3, 64, 16)])
def test_store_kv_matches_reference_and_skips_padding(dtype, num_kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(1)
    num_blocks, tokens = 5, 9
    # k and v as strided views into one fused projection, like the model's qkv split.
    qkv = torch.randn(tokens, 3 * num_kv_heads * head_dim, generator=g).to(dtype).to(DEVICE)
    k = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(tokens, num_kv_heads, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim :].view(tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[[2, 5]] = -1  # padding rows
    slots = slots.to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(*shape, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(*shape, generator=g).to(dtype).to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kv(k, v, k_cache, v_cache, slots)
    reference.write_kv(k, v, k_ref, v_ref, slots)

    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)
