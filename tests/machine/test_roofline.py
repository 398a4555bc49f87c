"""Roofline figures for SmolLM2-135M's shape, each checked against arithmetic written out by hand."""

import math

import pytest

from kvflow.machine.roofline import (
    BYTES_PER_PARAM,
    ModelShape,
    decode_roofline_tokens_per_s,
    fraction_of_roofline,
    gguf_q4_1_format,
    prefill_roofline_tokens_per_s,
)

SMOLLM2_CONFIG = {
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}

# Hand computation for SmolLM2-135M:
EMBEDDING = 49152 * 576  # 28,311,552
Q_PROJ = 576 * (9 * 64)  # 331,776
K_PROJ = V_PROJ = 576 * (3 * 64)  # 110,592 each
O_PROJ = (9 * 64) * 576  # 331,776
ATTENTION = Q_PROJ + K_PROJ + V_PROJ + O_PROJ  # 884,736
MLP = 3 * 576 * 1536  # gate + up + down = 2,654,208
LAYERS = 30 * (ATTENTION + MLP)  # 106,168,320
NORMS = (2 * 30 + 1) * 576  # 35,136
TOTAL = EMBEDDING + LAYERS + NORMS  # 134,515,008 (tied: no separate lm_head)
MATMUL = LAYERS + EMBEDDING  # the tied embedding doubles as the output projection: 134,479,872


@pytest.fixture
def shape() -> ModelShape:
    return ModelShape.from_hf_config(SMOLLM2_CONFIG)


def test_shape_from_config_fills_defaults(shape):
    assert shape == ModelShape(30, 576, 1536, 9, 3, 64, 49152, True)
    untied = ModelShape.from_hf_config({**SMOLLM2_CONFIG, "tie_word_embeddings": False, "num_key_value_heads": None})
    assert untied.num_kv_heads == 9 and not untied.tied_embeddings


def test_parameter_counts(shape):
    assert EMBEDDING == 28_311_552
    assert ATTENTION == 884_736 and MLP == 2_654_208
    assert shape.attention_params_per_layer == ATTENTION
    assert shape.mlp_params_per_layer == MLP
    assert shape.layer_matmul_params == LAYERS == 106_168_320
    assert shape.norm_params == NORMS == 35_136
    assert shape.num_params == TOTAL == 134_515_008
    assert round(shape.num_params / 1e6, 1) == 134.5
    assert shape.matmul_params == MATMUL == 134_479_872


def test_untied_model_counts_its_lm_head_separately(shape):
    untied = ModelShape.from_hf_config({**SMOLLM2_CONFIG, "tie_word_embeddings": False})
    assert untied.num_params == TOTAL + EMBEDDING
    assert untied.matmul_params == MATMUL  # the same matmuls run either way
    # Decode reads the lm_head whole but only indexes the embedding table.
    assert untied.decode_weight_bytes(2.0) == (LAYERS + EMBEDDING + NORMS) * 2


def test_weight_bytes_per_format(shape):
    assert shape.weight_bytes(BYTES_PER_PARAM["f32"]) == TOTAL * 4  # 538,060,032: "538 MB in fp32"
    assert shape.weight_bytes({"embedding": "bf16", "layers": "bf16", "norms": "bf16"}) == TOTAL * 2
    # The default GGUF: embedding Q8_0 (34 bytes per 32), layers Q4_1 (20 bytes per 32), norms f32.
    q4_1 = EMBEDDING * 34 / 32 + LAYERS * 20 / 32 + NORMS * 4
    assert q4_1 == 30_081_024 + 66_355_200 + 140_544 == 96_576_768
    assert shape.weight_bytes(gguf_q4_1_format()) == q4_1
    assert shape.weight_bytes({"embedding": "q8_0", "layers": "q4_1"}) == q4_1  # names and f32 norms default
    assert round(q4_1 / 2**20) == 92  # "92 MiB"
    assert shape.decode_weight_bytes(gguf_q4_1_format()) == q4_1  # tied: the embedding is read whole


def test_kv_bytes_per_token(shape):
    assert shape.kv_bytes_per_token(2) == 30 * 2 * 3 * 64 * 2 == 23_040
    assert shape.kv_bytes_per_token(4) == 46_080


def test_flops(shape):
    assert shape.flops_per_token(context=0) == 2 * MATMUL == 268_959_744
    attention_512 = 4 * 30 * 9 * 64 * 512  # QK^T and PV: 35,389,440
    assert shape.flops_per_token(context=512) == 2 * MATMUL + attention_512
    # Prefill of 4 tokens after 10 cached: contexts 11, 12, 13, 14.
    expected = 4 * 2 * MATMUL + 4 * 30 * 9 * 64 * (11 + 12 + 13 + 14)
    assert shape.prefill_flops(4, depth=10) == expected
    last_only = expected - 3 * 2 * EMBEDDING
    assert shape.prefill_flops(4, depth=10, all_logits=False) == last_only


def test_prefill_roofline(shape):
    # 1.88 TFLOP/s of bf16 matmul at 2 x 134.48 M FLOP per token: "about 7,000 tokens/s".
    rate = prefill_roofline_tokens_per_s(shape, 1.88e12)
    assert rate == pytest.approx(1.88e12 / 268_959_744)
    assert 6_980 < rate < 7_000
    pp512 = prefill_roofline_tokens_per_s(shape, 1.88e12, n_prompt=512)
    assert pp512 == pytest.approx(1.88e12 * 512 / shape.prefill_flops(512))
    assert pp512 < rate


def test_decode_roofline(shape):
    q4_1 = 96_576_768
    # Batch 1, empty cache, 17 GB/s: 17e9 / 96,576,768 bytes = 176 tokens/s.
    assert decode_roofline_tokens_per_s(shape, 17e9, gguf_q4_1_format()) == pytest.approx(17e9 / q4_1)
    # Depth 4096 in f16: 23,040 * 4096 = 94,371,840 more bytes per step: "a ceiling of about 90".
    deep = decode_roofline_tokens_per_s(shape, 17e9, gguf_q4_1_format(), depth=4096)
    assert deep == pytest.approx(17e9 / (q4_1 + 94_371_840))
    assert 88 < deep < 90
    # Batch 8 at depth 100: weights once, KV of 8 sequences, 8 tokens per step.
    b8 = decode_roofline_tokens_per_s(shape, 1e10, gguf_q4_1_format(), depth=100, batch=8)
    assert b8 == pytest.approx(1e10 / (q4_1 + 23_040 * 100 * 8) * 8)


def test_fraction_of_roofline():
    assert fraction_of_roofline(50, 200) == 0.25
    assert math.isnan(fraction_of_roofline(1, 0))


def test_moe_decode_reads_only_routed_experts():
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B active per token (Qwen's figures, the embedding included).
    config = {"num_hidden_layers": 48, "hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 32,
              "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
              "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}
    shape = ModelShape.from_hf_config(config)
    assert shape.num_params == pytest.approx(30.5e9, rel=0.01)
    active = shape.active_layer_matmul_params + shape.embedding_params + shape.lm_head_params
    assert active == pytest.approx(3.3e9, rel=0.03)
    assert shape.decode_weight_bytes(1.0) == pytest.approx(active - shape.embedding_params + shape.norm_params)
    dense = ModelShape.from_hf_config({k: v for k, v in config.items() if "expert" not in k})
    assert dense.num_experts == 0 and dense.active_layer_matmul_params == dense.layer_matmul_params
