"""GGUF block decoding into BlockQuant: bit-exact against gguf's own dequantization."""

import gguf
import numpy as np
import pytest
import torch

from kvflow.layers.quant import concat_rows, from_gguf, permute_rows, unpermute_rope_index
from kvflow.layers.quant.packing import round_scales_to_f16
from kvflow.loader.gguf_file import unpermute_rope

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")  # the packed types gguf can quantize


def gguf_bytes(w: np.ndarray, qtype: str) -> np.ndarray:
    return gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qtype))


def gguf_dequant(raw: np.ndarray, qtype: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype))


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_bit_exact(qtype):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((96, 256)) * rng.uniform(0.01, 3, (96, 1))).astype(np.float32)
    raw = gguf_bytes(w, qtype)
    bq = from_gguf(raw, qtype)
    assert bq.shape == (96, 256) and bq.group_size == 32
    np.testing.assert_array_equal(bq.dequantize().numpy(), gguf_dequant(raw, qtype))


def test_iq4_nl_random_blocks_are_bit_exact():
    """IQ4_NL (gguf has no quantizer for it): random blocks, finite float16 scales, every index."""
    rng = np.random.default_rng(2)
    rows, blocks = 16, 8
    d = rng.uniform(-2, 2, (rows, blocks, 1)).astype(np.float16).view(np.uint8)
    qs = rng.integers(0, 256, (rows, blocks, 16), dtype=np.uint8)
    raw = np.concatenate([d, qs], axis=-1).reshape(rows, -1)
    bq = from_gguf(raw, "IQ4_NL")
    assert bq.bits == 8 and bq.shape == (rows, blocks * 32)
    np.testing.assert_array_equal(bq.dequantize().numpy(), gguf_dequant(raw, "IQ4_NL"))


# type: (super-block bytes, where its float16 d (and dmin) sit, inputs per scale)
K_QUANTS = {"Q4_K": (144, slice(0, 4), 32), "Q5_K": (176, slice(0, 4), 32), "Q6_K": (210, slice(208, 210), 16),
            "Q3_K": (110, slice(108, 110), 16), "Q2_K": (84, slice(80, 84), 16), "IQ4_XS": (136, slice(0, 2), 32)}


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_k_quant_random_super_blocks_are_bit_exact(qtype):
    """Random super-blocks (finite float16 d and dmin; every scale, min and code pattern): the decoded
    float32 scales reproduce gguf's dequantization exactly; rounded to float16 for the packed kernel, each
    weight moves by at most 2^-11 of its block's |scale| * largest code + |offset|."""
    size, halves, group = K_QUANTS[qtype]
    rng = np.random.default_rng(3)
    rows, supers = 8, 3
    raw = rng.integers(0, 256, (rows, supers, size), dtype=np.uint8)
    raw[..., halves] = rng.uniform(-1, 1, (rows, supers, (halves.stop - halves.start) // 2)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    bq = from_gguf(raw, qtype)
    assert bq.shape == (rows, supers * 256) and bq.group_size == group
    expected = gguf_dequant(raw, qtype)
    np.testing.assert_array_equal(bq.dequantize().numpy(), expected)
    rounded = round_scales_to_f16(bq).dequantize().numpy()
    largest = 2**bq.bits - 1
    bound = (np.abs(bq.scale.numpy()) * largest + np.abs(bq.offset.numpy())) * (2.0**-11 + 2.0**-22) + group * 2.0**-25
    assert (np.abs(rounded - expected).reshape(rows, -1, group) <= bound[..., None]).all()


def test_group_16_codes_run_on_the_packed_kernel_as_stored():
    """A Q6_K tensor packs with blocks of 16: the kernel's weights are the rounded codes', and its products
    match them within the input quantization's bound."""
    from kvflow.kernels import packed_matmul, packed_weight

    if not packed_matmul.available():  # every CPU tier builds it; only a machine without a C++ compiler lacks it
        pytest.skip("needs a C++ compiler (the packed kernel)")
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, (40, 2, 210), dtype=np.uint8)
    raw[..., 208:210] = rng.uniform(-0.01, 0.01, (40, 2, 1)).astype(np.float16).view(np.uint8)
    bq = round_scales_to_f16(from_gguf(raw.reshape(40, -1), "Q6_K"))
    pw = packed_weight.pack(bq.q, bq.scale, bq.offset, bq.group_size, bq.bits)
    assert pw.group == 16
    torch.testing.assert_close(packed_weight.dequantize(pw), bq.dequantize(), rtol=0, atol=0)
    x = torch.randn(3, 512)
    w = bq.dequantize().double()
    error = (packed_matmul.matmul(x, pw).double() - x.double() @ w.T).abs()
    # Half an input step per block of 16 (max|x| / 32639) times the block's sum of |w|, plus float32 sums.
    steps = x.double().view(3, -1, 16).abs().amax(-1) / (2 * packed_weight.INPUT_STEPS)  # [3, blocks]
    bound = steps @ w.abs().view(40, -1, 16).sum(-1).T + 1e-6 * x.abs().double() @ w.abs().T
    assert (error <= bound).all() and error.max() > 0


def test_hand_built_q5_0_block_fifth_bits():
    # d = 1; element j's fifth bit is bit j of the little-endian word after d.
    q5 = np.arange(32, dtype=np.uint8)
    qh = np.packbits(q5 >> 4, bitorder="little")
    qs = (q5[:16] & 0x0F) | ((q5[16:] & 0x0F) << 4)
    block = np.concatenate([np.array([1.0], dtype=np.float16).view(np.uint8), qh, qs])
    assert torch.equal(from_gguf(block[None, :], "Q5_0").dequantize()[0], torch.arange(32.0) - 16)


def test_hand_built_q4_1_block_nibble_order():
    # d = 0.5, m = -1; byte j holds element j (low nibble) and element 16 + j (high nibble).
    lows, highs = np.arange(16, dtype=np.uint8), np.full(16, 15, dtype=np.uint8) - np.arange(16, dtype=np.uint8)
    block = np.concatenate([np.array([0.5, -1.0], dtype=np.float16).view(np.uint8), lows | (highs << 4)])
    w = from_gguf(block[None, :], "Q4_1").dequantize()[0]
    expected = 0.5 * torch.cat([torch.arange(16.0), 15 - torch.arange(16.0)]) - 1.0
    assert torch.equal(w, expected)


def test_hand_built_q8_0_block():
    q8 = np.arange(-16, 16, dtype=np.int8)
    block = np.concatenate([np.array([0.25], dtype=np.float16).view(np.uint8), q8.view(np.uint8)])
    assert torch.equal(from_gguf(block[None, :], "Q8_0").dequantize()[0], 0.25 * torch.arange(-16.0, 16.0))


def test_concat_and_permute_rows_match_dequantized_ops():
    rng = np.random.default_rng(1)
    q_raw = gguf_bytes(rng.standard_normal((128, 64)).astype(np.float32), "Q4_1")
    k_raw = gguf_bytes(rng.standard_normal((64, 64)).astype(np.float32), "Q4_0")
    q_ref = unpermute_rope(torch.from_numpy(gguf_dequant(q_raw, "Q4_1")), 4)
    k_ref = unpermute_rope(torch.from_numpy(gguf_dequant(k_raw, "Q4_0")), 2)
    fused = concat_rows([
        permute_rows(from_gguf(q_raw, "Q4_1"), unpermute_rope_index(128, 4)),
        permute_rows(from_gguf(k_raw, "Q4_0"), unpermute_rope_index(64, 2)),
    ])
    assert torch.equal(fused.dequantize(), torch.cat([q_ref, k_ref]))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="no packed kernel"):
        from_gguf(np.zeros((2, 66), np.uint8), "IQ2_XXS")
    with pytest.raises(ValueError, match="whole super-blocks"):
        from_gguf(np.zeros((2, 209), np.uint8), "Q6_K")
    with pytest.raises(ValueError, match="whole blocks"):
        from_gguf(np.zeros((2, 35), np.uint8), "Q8_0")
    a = from_gguf(np.zeros((2, 34), np.uint8), "Q8_0")
    b = from_gguf(np.zeros((2, 18), np.uint8), "Q4_0")
    with pytest.raises(ValueError, match="must share"):
        concat_rows([a, b])
