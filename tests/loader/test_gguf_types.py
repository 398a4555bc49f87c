"""Every GGUF tensor type the `gguf` package knows loads; the packed ones stay packed.

The 5-bit types matter most: llama.cpp's Q4_K_M and Q5_K_M files store every tensor whose rows are not a
multiple of 256 (most of SmolLM2's) as Q5_0, Q5_1 or Q8_0.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_files import requantize, write_gguf

from kvflow import LLM, SamplingParams
from kvflow.layers.quant.packed_linear import PackedLinear
from kvflow.loader import gguf_file


# Types without a packed kernel: loaded through the gguf package's dequantizer, exactly as it decodes them.
@pytest.mark.parametrize("qtype", ["IQ2_XS", "IQ3_S", "IQ1_M", "TQ1_0"])
def test_a_type_without_a_packed_kernel_loads_dequantized(qtype, tmp_path, caplog):
    path = write_gguf(tmp_path / f"{qtype}.gguf", "llama", qtype, random_bytes=True)
    reader = gguf_file.open_gguf(path)
    tensor = reader.tensors[0]
    with caplog.at_level("INFO", logger="kvflow"):
        cfg = gguf_file.hf_config_from_gguf(reader, path)
    assert any(qtype in r.getMessage() and "dequantized" in r.getMessage() for r in caplog.records)
    (name, weight), = list(gguf_file.iter_gguf_weights(reader, cfg))
    assert name == "model.layers.0.self_attn.q_proj.weight" and weight.dtype == torch.float32
    expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
    np.testing.assert_array_equal(weight.numpy(), gguf_file.unpermute_rope(expected, 2).numpy())  # llama q rows


@pytest.fixture(scope="module")
def five_bit_gguf(tmp_path_factory, default_gguf):
    """The default model with its attention weights in Q5_0 and its MLP weights in Q5_1."""
    def pick(name: str) -> str | None:
        return "Q5_0" if ".attn_" in name else ("Q5_1" if ".ffn_" in name else None)

    return requantize(default_gguf, tmp_path_factory.mktemp("q5") / "smollm2-q5.gguf", pick)


def test_five_bit_weights_stay_packed_and_answer(five_bit_gguf):
    llm = LLM(str(five_bit_gguf), threads=2, max_model_len=1024)
    model = llm.engine.runner.model
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear) and isinstance(layer.mlp.gate_up_proj, PackedLinear)
    # Q5_1's and Q5_0's codes both run as 6-bit ones (Q5_0's centred on 16, its offsets not stored)
    assert (layer.mlp.down_proj.packed.bits, layer.self_attn.qkv_proj.packed.bits) == (6, 6)
    assert layer.self_attn.qkv_proj.packed.centre == 16
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert "Paris" in answer, answer


def test_q6_k_encoder_round_trips_through_gguf():
    """The test encoder (gguf_files.quantize_q6_k) writes bytes the gguf package decodes to within half a
    step of each weight: the layout is ggml's."""
    from gguf_files import quantize_q6_k

    w = np.random.default_rng(1).standard_normal((4, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_q6_k(w), gguf.GGMLQuantizationType.Q6_K)
    step = np.abs(w).reshape(4, -1, 16).max(-1, keepdims=True) / 31
    assert (np.abs(back - w).reshape(4, -1, 16) <= step * 0.51 + 1e-3 * step).all()


@pytest.fixture(scope="module")
def q6_k_gguf(tmp_path_factory, default_gguf):
    """The default model with its MLP down projections in Q6_K (its only rows that are whole super-blocks)."""
    return requantize(default_gguf, tmp_path_factory.mktemp("q6k") / "smollm2-q6k.gguf",
                      lambda name: "Q6_K" if ".ffn_down" in name else None)


def test_q6_k_weights_stay_packed_in_blocks_of_16_and_answer(q6_k_gguf):
    llm = LLM(str(q6_k_gguf), threads=2, max_model_len=1024)
    down = llm.engine.runner.model.layers[0].mlp.down_proj
    assert isinstance(down, PackedLinear) and (down.packed.group, down.packed.bits) == (16, 6)
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert "Paris" in answer, answer


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS"])
def test_iq4_encoders_round_trip_through_gguf(qtype):
    """The test encoders (gguf_files.quantize_iq4_*) write bytes the gguf package decodes to within one step
    of the table's spacing: the layouts are ggml's."""
    from gguf_files import quantize_iq4_nl, quantize_iq4_xs

    w = np.random.default_rng(2).standard_normal((4, 512)).astype(np.float32)
    raw = (quantize_iq4_nl if qtype == "IQ4_NL" else quantize_iq4_xs)(w)
    back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    largest_gap = 24 / 127  # of the table's values, in units of a block's largest |w|
    blocks = np.abs(w).reshape(4, -1, 32).max(-1, keepdims=True)
    assert (np.abs(back - w).reshape(4, -1, 32) <= blocks * largest_gap * 1.3).all()


@pytest.fixture(scope="module")
def table_gguf(tmp_path_factory, default_gguf):
    """The default model with its attention and gate/up weights in IQ4_NL, down projections in IQ4_XS (the
    only rows that are whole super-blocks of 256) and nothing else changed."""
    def pick(name: str) -> str | None:
        return "IQ4_XS" if ".ffn_down" in name else ("IQ4_NL" if ".attn_" in name or ".ffn_" in name else None)

    return requantize(default_gguf, tmp_path_factory.mktemp("iq4") / "smollm2-iq4.gguf", pick)


def test_iq4_weights_stay_packed_as_four_bit_indices_and_answer(table_gguf):
    """IQ4_NL and IQ4_XS run as 4-bit indices into their codebook (4.5 bits a weight read, not 8.5; the
    kernels' sums are checked bitwise on every tier in tests/kernels), and the model still answers."""
    llm = LLM(str(table_gguf), threads=2, max_model_len=1024)
    layer = llm.engine.runner.model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(proj, PackedLinear) and (proj.packed.bits, proj.packed.codebook) == (4, 1)
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert "Paris" in answer, answer
