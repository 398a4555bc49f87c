"""GGUF block decoding into BlockQuant: bit-exact against gguf's own dequantization."""

import gguf
import numpy as np
import pytest
import torch

from kvflow.layers.quant import concat_rows, from_gguf, permute_rows, unpermute_rope_index
from kvflow.loader.gguf_file import unpermute_rope

TYPES = ("Q4_0", "Q4_1", "Q8_0")


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
        from_gguf(np.zeros((2, 36), np.uint8), "Q5_0")
    with pytest.raises(ValueError, match="whole blocks"):
        from_gguf(np.zeros((2, 35), np.uint8), "Q8_0")
    a = from_gguf(np.zeros((2, 34), np.uint8), "Q8_0")
    b = from_gguf(np.zeros((2, 18), np.uint8), "Q4_0")
    with pytest.raises(ValueError, match="must share"):
        concat_rows([a, b])
