"""TritonBackend through a whole (tiny) model: same hidden states and KV cache as the reference backend
for a prefill step, a mixed prefill+decode step and a decode-only step."""

from __future__ import annotations

import pytest
import torch

# Triton comes with CUDA builds of torch; the CPU build CI installs has none, so these skip there.
# benchmarks/gpu_check.sh runs them where a GPU is lent.
pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from paged_batch import DEVICE  # noqa: E402
from tiny_llama import caches, set_backend, step_inputs, tiny_arch, tiny_model  # noqa: E402

from kvflow.layers.attention.backend import ReferenceBackend  # noqa: E402
from kvflow.layers.attention.metadata import AttentionMetadata  # noqa: E402
from kvflow.layers.attention.triton_backend import TritonBackend  # noqa: E402

TABLES = [[3, 7, 1], [0, 5], [9, 2, 4]]


def both_backends(model, steps):
    """Run the steps with each backend from an empty cache; return each backend's hidden states and cache."""
    results = []
    for backend in (ReferenceBackend(), TritonBackend()):
        set_backend(model, backend)
        for layer in model.attention_layers:
            layer.k_cache.zero_()
            layer.v_cache.zero_()
        with torch.inference_mode():
            hidden = [model(*step_inputs(*step, TABLES, DEVICE)) for step in steps]
        results.append((hidden, caches(model)))
    return results


def test_prefill_then_mixed_then_decode_steps_match_reference():
    model = tiny_model(tiny_arch(), ReferenceBackend(), torch.float32, DEVICE)
    steps = [
        ([0, 0, 0], [9, 5, 17]),  # fresh prompts
        ([9, 5, 17], [8, 1, 1]),  # a prefill chunk after cached context, mixed with decodes
        ([17, 6, 18], [1, 1, 1]),  # decode only (the split-K kernel)
    ]
    (ref_hidden, ref_cache), (tri_hidden, tri_cache) = both_backends(model, steps)
    for ours, ref in zip(tri_hidden, ref_hidden):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    for ours, ref in zip(tri_cache, ref_cache):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_without_a_kv_cache_falls_back_to_plain_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 2, 64, generator=g).to(DEVICE) for _ in range(3))
    meta = AttentionMetadata.for_prompts([5, 7], device=DEVICE)
    ours = TritonBackend().forward(q, k, v, None, None, meta, 0.125)
    ref = ReferenceBackend().forward(q, k, v, None, None, meta, 0.125)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_backend_module_imports_without_touching_triton():
    import subprocess
    import sys

    code = ("import sys; import kvflow.layers.attention.triton_backend, kvflow.executors.cuda_graphs; "
            "assert 'triton' not in sys.modules, 'triton was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
