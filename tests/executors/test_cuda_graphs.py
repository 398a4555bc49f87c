"""CUDA-graph decode: the size ladder, padding that does no harm, and (on a GPU) replay equal to eager."""

from __future__ import annotations

import pytest
import torch

# Triton comes with CUDA builds of torch; the CPU build CI installs has none, so these skip there.
# benchmarks/gpu_check.sh runs them where a GPU is lent.
pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from paged_batch import DEVICE  # noqa: E402
from tiny_llama import caches, step_inputs, tiny_arch, tiny_model  # noqa: E402

from kvflow.executors.cuda_graphs import (  # noqa: E402
    CudaGraphRunner,
    StaticDecodeInputs,
    capture_sizes,
    graph_size_for,
)
from kvflow.layers.attention.backend import ReferenceBackend  # noqa: E402
from kvflow.layers.attention.triton_backend import TritonBackend  # noqa: E402

TABLES = [[3, 7, 1], [0, 5], [9, 2, 4]]
PREFILL = ([0, 0, 0], [17, 6, 18])
DECODE = ([17, 6, 18], [1, 1, 1])


def test_capture_sizes_climb_the_ladder_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert capture_sizes(300)[-2:] == [256, 300]


def test_graph_size_is_the_smallest_that_holds_the_batch():
    sizes = capture_sizes(100)
    assert [graph_size_for(sizes, b) for b in (1, 3, 4, 5, 64, 65, 100)] == [1, 4, 4, 8, 64, 100, 100]
    assert graph_size_for(sizes, 101) is None


def test_padded_static_batch_gives_the_same_rows_and_writes_nothing_extra():
    # What a replay computes, run eagerly: the decode batch of 3 copied into static buffers of 4 rows.
    model = tiny_model(tiny_arch(), TritonBackend(), torch.float32, DEVICE)
    with torch.inference_mode():
        model(*step_inputs(*PREFILL, TABLES, DEVICE))
        before = caches(model)
        ids, pos, meta = step_inputs(*DECODE, TABLES, DEVICE)
        expected = model(ids, pos, meta)
        expected_cache = caches(model)
        for layer, (k, v) in zip(model.attention_layers, zip(before[::2], before[1::2])):
            layer.k_cache.copy_(k)
            layer.v_cache.copy_(v)

        static = StaticDecodeInputs(max_num_seqs=8, max_blocks_per_seq=6, device=DEVICE)
        static.input_ids.fill_(5)  # stale values from an earlier, larger batch
        static.positions.fill_(40)
        static.seq_lens.fill_(33)
        static.slot_mapping.fill_(3)
        static.fill(ids, pos, meta, size=4)
        hidden = model(static.input_ids[:4], static.positions[:4], static.meta(4))

    torch.testing.assert_close(hidden[:3], expected, rtol=1e-5, atol=1e-5)
    # Nothing extra: every slot outside the batch's own is untouched, bit for bit. The batch's own slots
    # hold its K/V: bitwise the unpadded run's on a GPU; on the CPU (Triton's interpreter) the float32
    # projections round by the call's row count (3 against 4 here), so there they agree closely.
    written = torch.zeros(before[0].shape[:2], dtype=torch.bool).view(-1)
    written[meta.slot_mapping.cpu()] = True
    for ours, ref, old in zip(caches(model), expected_cache, before):
        flat_ours, flat_ref, flat_old = (t.view(-1, *t.shape[2:]).cpu() for t in (ours, ref, old))
        assert torch.equal(flat_ours[~written], flat_old[~written])
        if DEVICE.type == "cuda":
            assert torch.equal(flat_ours[written], flat_ref[written])
        else:
            torch.testing.assert_close(flat_ours[written], flat_ref[written], rtol=1e-5, atol=1e-5)


def test_backend_without_graph_support_is_refused():
    with pytest.raises(ValueError, match="cannot run in a CUDA graph"):
        CudaGraphRunner(torch.nn.Identity(), ReferenceBackend(), 4, 4, "cpu")


# Graph capture exists only on CUDA; the padded static batch is checked on CPU above.
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_graph_replay_matches_eager_for_successive_batches(dtype):
    model = tiny_model(tiny_arch(head_dim=128, num_heads=8, num_kv_heads=1), TritonBackend(), dtype, DEVICE)
    graphs = CudaGraphRunner(model, model.attention_layers[0].backend, max_num_seqs=8, max_blocks_per_seq=6,
                             device=DEVICE)
    graphs.capture()
    with torch.inference_mode():
        model(*step_inputs(*PREFILL, TABLES, DEVICE))
        start = caches(model)
        # Eager reference: three decode steps, the last with only two sequences (replays a smaller graph).
        steps = [([17, 6, 18], [1, 1, 1]), ([18, 7, 19], [1, 1, 1]), ([19, 8], [1, 1])]
        eager = []
        for starts, counts in steps:
            inputs = step_inputs(starts, counts, TABLES[: len(starts)], DEVICE)
            assert graphs.can_run(inputs[2])
            eager.append(model(*inputs).clone())
        eager_cache = caches(model)
        for layer, (k, v) in zip(model.attention_layers, zip(start[::2], start[1::2])):
            layer.k_cache.copy_(k)
            layer.v_cache.copy_(v)
        replayed = [graphs.run(*step_inputs(s, c, TABLES[: len(s)], DEVICE)).clone() for s, c in steps]
    # Same attention kernels and split count; only cuBLAS may pick other algorithms for 4 rows than for 3.
    for ours, ref in zip(replayed, eager):
        torch.testing.assert_close(ours, ref)
    for ours, ref in zip(caches(model), eager_cache):
        torch.testing.assert_close(ours, ref)


# Graph capture exists only on CUDA; the padded static batch is checked on CPU above.
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_prefill_batches_are_not_for_graphs():
    model = tiny_model(tiny_arch(), TritonBackend(), torch.bfloat16, DEVICE)
    graphs = CudaGraphRunner(model, model.attention_layers[0].backend, 4, 6, DEVICE)
    graphs.capture()
    assert not graphs.can_run(step_inputs(*PREFILL, TABLES, DEVICE)[2])
    assert not graphs.can_run(step_inputs([1] * 5, [1] * 5, [[0]] * 5, DEVICE)[2])  # more than max_num_seqs
