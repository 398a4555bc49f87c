"""The C++ GGUF packer (kernels/csrc/gguf_repack.cpp, what a load uses) against the checked Python path
(packing.from_gguf, scales rounded to float16, packed_weight.pack): the same bytes for every packed type,
for fused tensors of mixed widths and groups, and for reordered rows."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvflow.kernels import packed_matmul, packed_weight
from kvflow.layers.quant import concat_rows, from_gguf, gguf_linear, permute_rows, unpermute_rope_index
from kvflow.layers.quant.packed_parts import PackedParts
from kvflow.layers.quant.packing import (
    CENTRES,
    LAYOUT_BITS,
    PACKED_BITS,
    as_8_bit,
    packed_form,
    round_scales_to_f16,
    with_group,
)

# The packer is part of the kernel library, which builds on every CPU tier: only a machine without a C++
# compiler skips (CI's machines have one), and loading there takes the Python path these tests compare with.
pytestmark = pytest.mark.skipif(not packed_matmul.available(), reason="needs a C++ compiler (the packed kernel)")

# Where each type's float16 fields sit in its block: random bytes there could be inf or NaN.
HALVES = {"Q8_0": slice(0, 2), "Q4_0": slice(0, 2), "Q4_1": slice(0, 4), "Q5_0": slice(0, 2), "Q5_1": slice(0, 4),
          "IQ4_NL": slice(0, 2), "Q4_K": slice(0, 4), "Q5_K": slice(0, 4), "Q6_K": slice(208, 210),
          "Q3_K": slice(108, 110), "Q2_K": slice(80, 84), "IQ4_XS": slice(0, 2)}
EXPONENTS = {"MXFP4": 0}  # where an E8M0 exponent sits: kept to powers of two that float16 holds


def random_tensor(qtype: str, rows: int, k: int, seed: int) -> np.ndarray:
    elements, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, k // elements, size), dtype=np.uint8)
    if qtype in EXPONENTS:
        raw[..., EXPONENTS[qtype]] = rng.integers(110, 134, (rows, k // elements))
        return raw.reshape(rows, -1)
    halves = HALVES[qtype]
    count = (halves.stop - halves.start) // 2
    raw[..., halves] = rng.uniform(-0.05, 0.05, (rows, k // elements, count)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def python_path(parts, orders, bits: int | None = None) -> packed_weight.PackedWeight:
    """packed_weight.pack of packing.from_gguf's codes, at the packer's code width unless `bits` says."""
    codes = []
    for (raw, qtype), order in zip(parts, orders):
        bq = round_scales_to_f16(from_gguf(raw, qtype))
        codes.append(bq if order is None else permute_rows(bq, order))
    if len({bq.bits for bq in codes}) > 1:
        codes = [as_8_bit(bq) for bq in codes]
    smallest = min(bq.group_size for bq in codes)
    bq = concat_rows([with_group(c, smallest) for c in codes])
    form_bits, _, _, codebook = packed_form([q for _, q in parts])
    return packed_weight.pack(bq.q, bq.scale, bq.offset, bq.group_size, 8 if codebook else bits or form_bits, bq.centre,
                              codebook if not bits else 0)


def cpp_path(parts, orders) -> packed_weight.PackedWeight:
    pw = packed_weight.pack_gguf([(raw, gguf.GGMLQuantizationType[q].value, order)
                                  for (raw, q), order in zip(parts, orders)], *packed_form([q for _, q in parts]))
    assert pw is not None
    return pw


OWN_SCALES = ("Q4_K", "Q5_K")  # packed with their own scales (packed_weight.OWN_SCALE_TYPES)


@pytest.mark.parametrize("qtype", [q for q in PACKED_BITS if q not in OWN_SCALES])
def test_each_type_packs_to_the_python_paths_bytes(qtype):
    parts = [(random_tensor(qtype, 40, 512, 1), qtype)]  # 40 rows: a partial last group of 16
    want, got = python_path(parts, [None]), cpp_path(parts, [None])
    assert (got.bits, got.group, got.has_offset, got.centre, got.codebook) == (
        want.bits, want.group, want.has_offset, want.centre, want.codebook)
    assert got.centre == CENTRES.get(qtype, 0)  # symmetric types store no offsets
    assert torch.equal(got.data, want.data)


def test_fused_symmetric_parts_of_one_centre_store_no_offsets():
    parts = [(random_tensor("Q8_0", 32, 256, 8), "Q8_0"), (random_tensor("IQ4_NL", 16, 256, 9), "IQ4_NL")]
    want, got = python_path(parts, [None, None]), cpp_path(parts, [None, None])
    assert (got.centre, got.has_offset) == (128, False)
    assert torch.equal(got.data, want.data)
    x = torch.randn(3, 256)
    assert torch.equal(packed_matmul.matmul(x, got), packed_matmul.matmul(x, want))


def test_fused_parts_of_mixed_widths_groups_and_row_orders():
    """q in Q4_K (rope-permuted rows), k in Q5_0, v in Q6_K: as a Q4_K_M file's attention can be."""
    parts = [(random_tensor("Q4_K", 64, 512, 2), "Q4_K"), (random_tensor("Q5_0", 32, 512, 3), "Q5_0"),
             (random_tensor("Q6_K", 32, 512, 4), "Q6_K")]
    orders = [unpermute_rope_index(64, 4), unpermute_rope_index(32, 2), None]
    want, got = python_path(parts, orders), cpp_path(parts, orders)
    assert (got.bits, got.group) == (6, 16)  # Q5_0's 5-bit codes in the 6-bit layout
    assert torch.equal(got.data, want.data)
    layer = gguf_linear(parts, row_orders=orders)  # three layouts: one packed weight, not three
    assert torch.equal(layer.packed.data, want.data)


@pytest.mark.parametrize("qtype", OWN_SCALES)
def test_k_quants_keep_their_own_scales_exactly_in_fewer_bytes(qtype):
    """Q4_K and Q5_K keep their 6-bit sub-block scales and mins with a float16 d and dmin per 256 inputs
    (4.625 bits a 4-bit weight, where float16 scales and offsets per 32 took 5): the weights are the file's,
    bit for bit (no float16 rounding of d * sc), and every tier multiplies by them alike."""
    parts = [(random_tensor(qtype, 40, 512, 15), qtype)]
    own, rounded = cpp_path(parts, [None]), python_path(parts, [None])
    bits = own.bits  # per weight: bits + 0.625 (sc, m, and d, dmin per 256), not bits + 1 (two float16 per 32)
    assert own.super_scales is not None and own.nbytes() / rounded.nbytes() == pytest.approx((bits + 0.625) / (bits + 1))
    exact = from_gguf(*parts[0]).dequantize()
    assert torch.equal(packed_weight.dequantize(own), exact)
    assert torch.equal(packed_matmul.rows(own, torch.tensor([0, 17, 39])), exact[[0, 17, 39]])
    x = torch.randn(9, 512)
    ref = x.double() @ exact.double().t()
    for m in (1, 2, 9):
        y = packed_matmul.matmul(x[:m], own)
        assert ((y.double() - ref[:m]).abs().max() / ref.abs().max()).item() < 1e-4
    layer = gguf_linear(parts)  # the loader's layer, and its exact greedy head path
    assert layer.packed.super_scales is not None
    assert torch.equal(layer.exact_top(x).argmax(-1), ref.argmax(-1))
    stacked = cpp_path([(random_tensor(qtype, 64, 512, 16), qtype)], [None])  # a MoE's experts, cut from one
    experts = packed_weight.split_rows(stacked, 32)
    assert torch.equal(torch.cat([packed_weight.dequantize(e) for e in experts]), packed_weight.dequantize(stacked))


@pytest.mark.parametrize("qtype", [q for q in PACKED_BITS if LAYOUT_BITS[q] == 6 and q not in OWN_SCALES])
def test_six_bit_codes_multiply_as_the_same_codes_in_eight_bits(qtype):
    """Q6_K, Q5_K and Q5_1 are kept at 6 bits a code (7 a weight with scales, not 9): the same integer
    sums, so every output is bitwise what the 8-bit layout gives, in fewer bytes."""
    parts = [(random_tensor(qtype, 40, 512, 11), qtype)]
    six, eight = cpp_path(parts, [None]), python_path(parts, [None], bits=8)
    assert six.bits == 6 and six.data.numel() < eight.data.numel() * 0.8
    assert torch.equal(packed_weight.dequantize(six), packed_weight.dequantize(eight))
    x = torch.randn(9, 512)
    for input_bits in (8, 16):
        for m in (1, 2, 9):  # one row, a few, and past a tile
            assert torch.equal(packed_matmul.matmul(x[:m], six, input_bits=input_bits),
                               packed_matmul.matmul(x[:m], eight, input_bits=input_bits))


def test_a_q4_k_m_attention_of_four_and_six_bit_parts_packs_at_six_bits():
    """q, k in Q4_K and v in Q6_K (a Q4_K_M file's attention in its Q6_K layers): 6-bit codes in blocks of 16."""
    parts = [(random_tensor("Q4_K", 64, 512, 12), "Q4_K"), (random_tensor("Q4_K", 32, 512, 13), "Q4_K"),
             (random_tensor("Q6_K", 32, 512, 14), "Q6_K")]
    orders = [unpermute_rope_index(64, 4), unpermute_rope_index(32, 2), None]
    want, got = python_path(parts, orders), cpp_path(parts, orders)
    assert (got.bits, got.group, got.has_offset) == (6, 16, True)
    assert torch.equal(got.data, want.data)


def test_a_scale_beyond_float16_and_a_size_that_disagrees_are_refused():
    raw = random_tensor("Q8_0", 16, 64, 5)
    raw[0, 0:2] = np.array([60000.0], dtype=np.float16).view(np.uint8)  # offset -128 d overflows float16
    assert packed_weight.pack_gguf([(raw, gguf.GGMLQuantizationType.Q8_0.value, None)], 8, 32) is None
    centred = packed_weight.pack_gguf([(raw, gguf.GGMLQuantizationType.Q8_0.value, None)], 8, 32, centre=128)
    assert centred is not None  # no stored offset to overflow: the kernel derives -128 d in float32
    short = random_tensor("Q4_0", 16, 64, 6)[:, :-1]
    assert packed_weight.pack_gguf([(short, gguf.GGMLQuantizationType.Q4_0.value, None)], 4, 32) is None
    eight = random_tensor("Q8_0", 16, 64, 7)
    assert packed_weight.pack_gguf([(eight, gguf.GGMLQuantizationType.Q8_0.value, None)], 4, 32) is None
    assert packed_weight.pack_gguf([(eight, gguf.GGMLQuantizationType.Q8_0.value, None)], 8, 32, centre=8) is None
    six = random_tensor("Q6_K", 16, 256, 10)  # 6-bit codes into 4 bits; 8-bit ones into 6
    assert packed_weight.pack_gguf([(six, gguf.GGMLQuantizationType.Q6_K.value, None)], 4, 16) is None
    assert packed_weight.pack_gguf([(eight, gguf.GGMLQuantizationType.Q8_0.value, None)], 6, 32) is None


def test_a_q4_k_m_attention_runs_as_two_packed_parts_in_their_own_bytes():
    """The same attention as gguf_linear loads it: q/k in Q4_K's own layout, v in Q6_K's, side by side
    (layers/quant/packed_parts.py): each part's columns bitwise its own layer's, and the weights of the one
    widened layer above in fewer bytes."""
    parts = [(random_tensor("Q4_K", 64, 512, 12), "Q4_K"), (random_tensor("Q4_K", 32, 512, 13), "Q4_K"),
             (random_tensor("Q6_K", 32, 512, 14), "Q6_K")]
    orders = [unpermute_rope_index(64, 4), unpermute_rope_index(32, 2), None]
    layer = gguf_linear(parts, row_orders=orders)
    assert isinstance(layer, PackedParts) and [p.out_features for p in layer.parts] == [96, 32]
    qk, v = gguf_linear(parts[:2], row_orders=orders[:2]), gguf_linear(parts[2:])
    x = torch.randn(5, 512)
    with torch.inference_mode():
        assert torch.equal(layer(x), torch.cat([qk(x), v(x)], dim=-1))
    assert torch.equal(layer.dequantize(), torch.cat([qk.dequantize(), v.dequantize()]))
    # The widened layer holds the same weights, Q4_K's scales rounded to float16 (the parts keep them exact).
    widened = cpp_path(parts, orders)
    torch.testing.assert_close(layer.dequantize(), packed_weight.dequantize(widened), rtol=2e-3, atol=2e-3)
    assert layer.nbytes() < 0.8 * widened.nbytes()
    layer.cache_dense_bf16()
    assert torch.equal(layer.dense_bf16, layer.dequantize().to(torch.bfloat16))
    assert all(p.dense_bf16 is None for p in layer.parts)  # one copy, the layer's


def test_a_model_with_two_part_projections_counts_their_bytes_once():
    """The roofline's bytes a step (executors/model_figures) and the loaded size count a PackedParts once,
    not again through its parts."""
    from torch import nn

    from kvflow.executors.model_figures import weight_bytes_read_per_step
    from kvflow.loader.quantized_loading import weight_nbytes

    parts = [(random_tensor("Q4_K", 64, 512, 12), "Q4_K"), (random_tensor("Q6_K", 32, 512, 14), "Q6_K")]
    layer = gguf_linear(parts)
    model = nn.Sequential(layer)
    assert weight_bytes_read_per_step(model) == weight_nbytes(model) == layer.nbytes()
    assert layer.nbytes() == sum(p.packed.nbytes() for p in layer.parts)


def test_q5_0_is_held_in_six_bits_centred_on_16():
    """Q5_0 (w = d (q5 - 16)): its 5-bit codes in the 6-bit layout with the centre 16, 6.5 bits a weight
    where 8-bit codes took 8.5, and exactly the gguf package's weights."""
    raw = random_tensor("Q5_0", 48, 512, 21)
    pw = cpp_path([(raw, "Q5_0")], [None])
    assert (pw.bits, pw.group, pw.centre, pw.has_offset) == (6, 32, 16, False)
    assert pw.nbytes() * 8 / (48 * 512) <= 6.5 * 1.1  # (48 rows: a partial last group of 16)
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_0))
    assert torch.equal(packed_weight.dequantize(pw), want)
