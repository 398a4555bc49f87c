"""LongRoPE's table (kvflow/layers/rotary.py) against transformers' own LongRoPE frequencies: the short
factors up to the original context, the long ones after it, both scaled by the attention factor."""

from __future__ import annotations

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
