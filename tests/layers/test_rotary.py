"""The scaled rotary tables (kvflow/layers/rotary.py) against transformers' own frequencies: LongRoPE's short
factors up to the original context and long ones after it, YaRN's ramp; both scaled by their attention factor."""

from __future__ import annotations

import math

import torch

from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.arch import ArchConfig


def test_longrope_rows_past_the_original_context_use_the_long_factors():
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [1.0, 2.0, 4.0, 8.0]}
    config = transformers.Phi3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                                     max_position_embeddings=2048, original_max_position_embeddings=128,
                                     rope_scaling=scaling, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     vocab_size=64)
    arch = ArchConfig.from_hf_config(config.to_dict())
    ours = RotaryEmbedding(arch.rotary_dim, 512, arch.rope_theta, arch.rope_scaling)
    positions = torch.arange(512, dtype=torch.float32)
    for seq_len, rows in ((100, slice(0, 128)), (1000, slice(128, 512))):
        inv_freq, gain = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=seq_len)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        torch.testing.assert_close(ours.cos[rows], (emb.cos() * gain)[rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.sin[rows], (emb.sin() * gain)[rows], rtol=1e-5, atol=1e-5)
    assert gain > 1.0  # sqrt(1 + log(16) / log(128)): the factor binds


def test_yarn_table_matches_transformers_with_and_without_truncation():
    import pytest
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for truncate, extra in ((False, {}), (True, {}), (True, {"mscale": 1.0, "mscale_all_dim": 0.5})):
        scaling = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
                   "original_max_position_embeddings": 256, "rope_theta": 150000.0, **extra}
        config = transformers.GptOssConfig(hidden_size=64, head_dim=32, num_attention_heads=4, num_key_value_heads=2,
                                           num_hidden_layers=2, num_local_experts=4, vocab_size=64,
                                           rope_parameters=scaling)
        arch = ArchConfig.from_hf_config(config.to_dict())
        assert arch.rope_scaling["rope_type"] == "yarn"
        ours = RotaryEmbedding(arch.rotary_dim, 512, arch.rope_theta, arch.rope_scaling)
        inv_freq, gain = ROPE_INIT_FUNCTIONS["yarn"](config)
        emb = torch.outer(torch.arange(512, dtype=torch.float32), inv_freq).repeat(1, 2)
        torch.testing.assert_close(ours.cos, emb.cos() * gain, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours.sin, emb.sin() * gain, rtol=1e-6, atol=1e-6)
        # The temperature binds: 0.1 ln(32) + 1, or its ratio to the mscale_all_dim one.
        expected = (1 + 0.1 * math.log(32.0)) / (1 + 0.05 * math.log(32.0) if extra else 1.0)
        assert gain == pytest.approx(expected) and gain != 1.0
