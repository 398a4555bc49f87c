"""Every kernel tier this CPU can run (its own and each lower one, as KVFLOW_ISA would force them), each
through its own library, against the reference:

- the packed matmul: bitwise equal on every tier with a fused multiply-add (the same exact integer sums and
  float epilogue); the generic x86 tier, which has none, within two roundings a block of them;
- paged attention: every tier within float32 accuracy of the plain-PyTorch reference, and each tier's
  result for a row independent of the rows beside it and of the thread count;
- the native decoder: the default model's logits through every tier's library agree closely (attention
  and norms sum lanes in a tier-dependent order) and give the same greedy tokens.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import tempfile
from pathlib import Path

import pytest
import torch
from engine_helpers import make_llm
from paged_batch import at_slots, make_paged_batch

from kvflow import SamplingParams
from kvflow.executors.thresholds import ROW_THRESHOLDS
from kvflow.kernels import abi, build, cpu_features, kv_int8, packed_matmul, packed_weight, paged_attention
from kvflow.layers.attention import reference
from kvflow.layers.quant import quantize_weight

# Every tier's library is built here from the same sources: only a machine without a C++ compiler skips.
pytestmark = pytest.mark.skipif(not packed_matmul.available(), reason="needs a C++ compiler")
TIERS = cpu_features.runnable_tiers()
# The generic tier on x86 has no FMA (an x86 CPU without AVX2 rarely has one; int_vectors.h): its epilogue
# rounds each multiply-add twice. Every other tier rounds it once.
FUSED = [t for t in TIERS if not (t == "generic" and platform.machine() in ("x86_64", "AMD64"))]


def library(tier: str):
    lib = abi.native(tier)
    lib.kvflow_set_tuning(tuning=ROW_THRESHOLDS.kernel_tuning())
    return lib


def other_avx2_flags() -> tuple[str, ...] | None:
    """Flags for the AVX2 tier's packed-matmul path that this CPU's own avx2 library does not take: plain
    AVX2 where the CPU has AVX-VNNI (its library takes packed_avx2_vnni.h), else the VNNI path in its
    AVX512-VNNI form where that runs (build.avx2_vnni_evex_runs). None: neither."""
    if "avx2" not in TIERS:
        return None
    if "avx_vnni" in cpu_features.cpu_flags():
        return ("-mno-avxvnni",)
    return build.AVX2_VNNI_EVEX_FLAGS if build.avx2_vnni_evex_runs(build.compiler()) else None


@functools.cache
def other_avx2_library():
    """The avx2 library built with other_avx2_flags (None where there is no other path here)."""
    extra = other_avx2_flags()
    if extra is None:
        return None
    out = Path(tempfile.mkdtemp(prefix="kvflow-avx2-")) / "libkvflow_cpu-avx2-other.so"
    build.compile_library(build.compiler(), "avx2", build.CSRC, out, extra_flags=extra)
    lib = abi.bind(ctypes.CDLL(str(out)))
    lib.kvflow_set_tuning(tuning=ROW_THRESHOLDS.kernel_tuning())
    return lib


def test_both_avx2_paths_are_built_where_the_cpu_runs_them():
    """The AVX2 tier's two packed-matmul paths, plain and VNNI, each really taken by one of the libraries
    the tests compare (test_packed_matmul_...), wherever this CPU can run both."""
    other = other_avx2_library()
    if other is None:  # an AVX2 CPU without VNNI in either form (or a compiler without the EVEX flags):
        # its one path is the avx2 library every other test here compares
        pytest.skip("this CPU runs one AVX2 path only (no AVX-VNNI, nor AVX512-VNNI with VL and GCC)")
    paths = {packed_matmul.PATHS[lib.kvflow_packed_matmul_path()] for lib in (library("avx2"), other)}
    assert paths == {"AVX2", "AVX2 and AVX-VNNI"}


def matmul(lib, pw, x: torch.Tensor, threads: int = 2, input_bits: int = 16) -> torch.Tensor:
    y = torch.empty(x.shape[0], pw.n)
    assert lib.kvflow_packed_matmul(w=ctypes.byref(pw.struct), x=x.data_ptr(), x_stride=x.stride(0), m=x.shape[0],
                                    y=y.data_ptr(), y_stride=y.stride(0), input_bits=input_bits,
                                    num_threads=threads) == 0
    return y


@pytest.mark.parametrize(("bits", "codebook"), [(4, 0), (6, 0), (8, 0), (4, 1), (4, 2)])
@pytest.mark.parametrize(("n", "k"), [(200, 64), (960, 576), (3072, 576), (576, 1536)])
def test_packed_matmul_is_bitwise_equal_on_every_fused_tier(bits, codebook, n, k):
    g = torch.Generator().manual_seed(n + bits + codebook)
    bq = quantize_weight(torch.randn(n, k, generator=g) * 0.1, "int4" if bits == 4 else "int8", 32)
    q = bq.q >> 2 if bits == 6 else bq.q  # 6-bit codes: the 8-bit ones' top six bits
    bq.scale = bq.scale.half().float()
    bq.offset = bq.offset.half().float() if bits == 4 else -128.0 * bq.scale
    if codebook:  # random entries of the codebook (IQ4_NL's, MXFP4's), held as 4-bit indices
        q = packed_weight.CODEBOOKS[codebook][torch.randint(0, 16, (n, k), generator=g)]
        bq.offset = -128.0 * bq.scale
    pw = packed_weight.pack(q, bq.scale, bq.offset, bq.group_size, 8 if codebook else bits, 128 if codebook else 0,
                            codebook)
    assert pw.bits == bits
    # What any block's terms and partial sums can reach: |x| times |code x scale| + |offset|, summed
    per_input = q.float().abs() * bq.scale.repeat_interleave(32, 1) + bq.offset.abs().repeat_interleave(32, 1)
    for m in (1, 3, 8, 17, 40):  # VNNI, AMX 8- and 16-row tiles where the CPU has them
        x = torch.randn(m, k, generator=g) * 2
        for input_bits in (8, 16):
            outs = {tier: matmul(library(tier), pw, x, input_bits=input_bits) for tier in TIERS}
            if other_avx2_library() is not None:  # the AVX2 tier's other path (plain, or with VNNI)
                outs["avx2, other path"] = matmul(other_avx2_library(), pw, x, input_bits=input_bits)
            fused = outs[FUSED[0]]
            for tier, y in outs.items():
                if tier in FUSED or tier == "avx2, other path":
                    assert torch.equal(y, fused), (tier, m, input_bits)
                else:  # each of k / 32 blocks rounds 4 times here (2 products, 2 sums) and twice on a fused
                    # tier, half an ulp each of at most what the block's terms can reach
                    bound = 6 * (k // 32) * 2.0**-24 * (x.abs() @ per_input.T)
                    assert ((y - fused).abs() <= bound).all(), (tier, m, input_bits)
    for tier in (TIERS[-1], TIERS[0]):  # nor on the thread count
        assert torch.equal(matmul(library(tier), pw, x, threads=1), outs[tier])


def test_input_widths_other_than_8_and_16_bits_are_refused_on_every_tier():
    bq = quantize_weight(torch.randn(64, 64) * 0.1, "int4", 32)
    pw = packed_weight.pack(bq.q, bq.scale.half().float(), bq.offset.half().float(), bq.group_size, bq.bits)
    x, y = torch.randn(2, 64), torch.full((2, 64), 7.0)
    for tier in TIERS:
        for input_bits in (0, 4, 12, 32):
            assert library(tier).kvflow_packed_matmul(
                w=ctypes.byref(pw.struct), x=x.data_ptr(), x_stride=64, m=2, y=y.data_ptr(), y_stride=64,
                input_bits=input_bits, num_threads=2) != 0, (tier, input_bits)
    assert torch.equal(y, torch.full((2, 64), 7.0))  # nothing written
    with pytest.raises(RuntimeError, match="8- or 16-bit inputs"):
        packed_matmul.matmul(x, pw, input_bits=12)


def attend(lib, batch, all_rows: bool, threads: int) -> torch.Tensor:
    out = torch.zeros(batch.q.shape)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    step = paged_attention.step_struct(batch.slot_mapping, batch.query_start_loc, batch.seq_lens, batch.block_tables)
    layer = paged_attention.layer_struct(k_cache, v_cache, batch.q.shape[1], 0.125)
    rows = abi.KvflowRows(q=batch.q.data_ptr(), q_stride=batch.q.stride(0), k=batch.k.data_ptr(),
                          k_stride=batch.k.stride(0), v=batch.v.data_ptr(), v_stride=batch.v.stride(0))
    assert lib.kvflow_paged_attention(layer=ctypes.byref(layer), step=ctypes.byref(step), rows=ctypes.byref(rows),
                                      out=out.data_ptr(), out_stride=out.stride(0), all_rows=int(all_rows),
                                      num_threads=threads) == 0
    return out


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # the fixed-size paths and the plain loops
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_paged_attention_on_every_tier(tier, head_dim, cache_dtype):
    lib = library(tier)
    batch = make_paged_batch([40, 21, 9, 300, 2049], [7, 1, 9, 130, 1], num_kv_heads=2, group=3,
                             head_dim=head_dim, block_size=16, dtype=torch.float32, device=torch.device("cpu"),
                             cache_dtype=cache_dtype)
    new_k, new_v = batch.k, batch.v
    if cache_dtype == torch.int8:  # as stored: the kernel quantizes this step's rows as kv_int8.py does
        batch.k, batch.v = kv_int8.dequantize(kv_int8.quantize(new_k)), kv_int8.dequantize(kv_int8.quantize(new_v))
    else:
        batch.k, batch.v = batch.k.to(cache_dtype).float(), batch.v.to(cache_dtype).float()
    expected = batch.reference_output(scale=0.125)
    batch.k, batch.v = new_k, new_v
    out = attend(lib, batch, all_rows=True, threads=2)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)
    assert torch.equal(attend(lib, batch, all_rows=True, threads=1), out)  # nor on the thread count
    # A decode row alone gives the same bits as beside the others (row 7 is sequence 1's only query).
    alone = make_paged_batch([21], [1], num_kv_heads=2, group=3, head_dim=head_dim, block_size=16,
                             dtype=torch.float32, device=torch.device("cpu"), cache_dtype=cache_dtype)
    alone.q, alone.k, alone.v = batch.q[7:8], batch.k[7:8], batch.v[7:8]
    for p in range(20):
        src = batch.block_tables[1, p // 16] * 16 + p % 16
        dst = alone.block_tables[0, p // 16] * 16 + p % 16
        alone.k_cache[at_slots(alone.k_cache, dst)] = batch.k_cache[at_slots(batch.k_cache, src)]
        alone.v_cache[at_slots(alone.v_cache, dst)] = batch.v_cache[at_slots(batch.v_cache, src)]
    assert torch.equal(attend(lib, alone, all_rows=True, threads=2)[0], out[7])


# Prompt rows deep into a long context (a chunk at 32K, where an agent's prompt ends), beside a decode row
# at 9K: plain, with a sliding window, with capped scores, and with gpt-oss's sinks and a window.
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize(("window", "softcap", "sinks"), [(0, 0.0, False), (4096, 0.0, False), (0, 1.0, False),
                                                          (1000, 0.0, True)], ids=["plain", "window", "softcap", "sinks"])
def test_prompt_rows_at_a_depth_of_32k_on_every_tier(tier, window, softcap, sinks):
    batch = make_paged_batch([32768, 9000], [40, 1], num_kv_heads=2, group=3, head_dim=64, block_size=16,
                             dtype=torch.float32, device=torch.device("cpu"), cache_dtype=torch.float16)
    sink_logits = torch.tensor([4.0, -3.0, 0.5, 1.0, 8.0, -1.0]) if sinks else None
    batch.k, batch.v = batch.k.half().float(), batch.v.half().float()  # as the float16 cache stores them
    expected = batch.reference_output(scale=0.125, window=window, softcap=softcap, sinks=sink_logits)
    out = torch.zeros(batch.q.shape)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    step = paged_attention.step_struct(batch.slot_mapping, batch.query_start_loc, batch.seq_lens, batch.block_tables)
    layer = paged_attention.layer_struct(k_cache, v_cache, 6, 0.125, window, softcap, sink_logits)
    rows = abi.KvflowRows(q=batch.q.data_ptr(), q_stride=batch.q.stride(0), k=batch.k.data_ptr(),
                          k_stride=batch.k.stride(0), v=batch.v.data_ptr(), v_stride=batch.v.stride(0))
    assert library(tier).kvflow_paged_attention(
        layer=ctypes.byref(layer), step=ctypes.byref(step), rows=ctypes.byref(rows), out=out.data_ptr(),
        out_stride=out.stride(0), all_rows=1, num_threads=2) == 0
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)
    if window or softcap or sinks:  # the variant really changes the result at this depth
        assert not torch.allclose(expected, batch.reference_output(scale=0.125), atol=1e-3)


def test_an_8_bit_cache_is_stored_as_kv_int8_writes_it():
    """The kernel's quantization of new rows is bitwise kv_int8.quantize's (either side reads the other's)."""
    batch = make_paged_batch([30, 5], [30, 5], num_kv_heads=2, group=3, head_dim=64, block_size=16,
                             dtype=torch.float32, device=torch.device("cpu"), cache_dtype=torch.int8)
    batch.k[0, 0] = 0.0  # an all-zero row: scale 0, values 0
    for tier in TIERS:
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        reference.store_kv(batch.k, batch.v, k_cache, v_cache, batch.slot_mapping)
        step = paged_attention.step_struct(batch.slot_mapping, batch.query_start_loc, batch.seq_lens,
                                           batch.block_tables)
        kernel_k, kernel_v = batch.k_cache.clone(), batch.v_cache.clone()
        layer = paged_attention.layer_struct(kernel_k, kernel_v, 6, 0.125)
        rows = abi.KvflowRows(q=batch.q.data_ptr(), q_stride=batch.q.stride(0), k=batch.k.data_ptr(),
                              k_stride=batch.k.stride(0), v=batch.v.data_ptr(), v_stride=batch.v.stride(0))
        out = torch.zeros(batch.q.shape)
        assert library(tier).kvflow_paged_attention(
            layer=ctypes.byref(layer), step=ctypes.byref(step), rows=ctypes.byref(rows), out=out.data_ptr(),
            out_stride=out.stride(0), all_rows=1, num_threads=2) == 0
        assert torch.equal(kernel_k, k_cache) and torch.equal(kernel_v, v_cache), tier
        assert torch.all(kv_int8.dequantize(k_cache[at_slots(k_cache, batch.slot_mapping[0])])[0] == 0)


def test_native_decoder_agrees_on_every_tier(fast_loaded):
    """One prefill of 20 rows and four decode steps of 3 rows through each tier's kvflow_decoder_forward,
    over the same structs and a fresh cache each, with 16-bit inputs: the same greedy tokens, logprobs within 5e-3 nats of the
    first tier's (a last-bit difference in a sum can flip a K/V value's float16 rounding; measured up to
    1.4e-3 on this test). Not with 8-bit inputs: such a difference before a matmul can move an input by a
    whole 8-bit step (2^-8 of its block's largest), and on random-token prompts flip a token (seen on
    Zen 4); the 8-bit kernels are bitwise equal across tiers (test_packed_matmul_...)."""
    llm = make_llm(fast_loaded, enable_prefix_caching=False)
    executor = llm.engine.runner.executor
    executor.eight_bit_min_rows = 0
    executor.prompt_tiles = False  # the prefill's attention row by row on every tier (AMX alone has tiles)
    prompts = [list(range(300, 320)), list(range(900, 907)), [5, 6, 7]]
    results = {}
    libraries = {tier: library(tier) for tier in TIERS}
    if other_avx2_library() is not None:  # the AVX2 tier's other packed-matmul path, through the whole decoder
        libraries["avx2, other path"] = other_avx2_library()
    for tier, lib in libraries.items():
        executor.forward_native = lib.kvflow_decoder_forward
        for k_cache, v_cache in executor.kv_caches:
            k_cache.zero_()
            v_cache.zero_()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=5, logprobs=5))
        results[tier] = outs
    first = results[TIERS[0]]
    for tier, outs in results.items():
        for a, b in zip(outs, first):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, tier
            for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                shared = lp_a.keys() & lp_b.keys()
                assert max(abs(lp_a[t].logprob - lp_b[t].logprob) for t in shared) < 5e-3, tier
