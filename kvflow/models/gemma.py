"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's changes.

- RMSNorm scales by (1 + weight): the checkpoint stores weight - 1, so loading adds 1 once and the
  shared RMSNorm runs unchanged. Each layer has four norms: before and after attention, before and after
  the MLP (the "post" norms apply to the sublayer's output before the residual add).
- The token embedding is multiplied by sqrt(hidden_size) (in the activations' dtype, as transformers does).
- GeGLU MLP (gelu_pytorch_tanh), attention scaled by query_pre_attn_scalar ** -0.5.
- Interleaved sliding-window and global attention layers (ArchConfig.layer_types); Gemma 3's sliding
  layers have their own rotary base (rope_local_base_freq) and its global ones the config's scaling.
- Gemma 2 caps attention scores (attn_logit_softcapping) and the final logits (final_logit_softcapping)
  as cap * tanh(x / cap). Gemma 3 caps neither, and norms each head's q and k (as Qwen3 does).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvflow.layers.activation import soft_cap
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.arch import ArchConfig
from kvflow.models.llama import MLP, Attention, LlamaForCausalLM


class GemmaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_index: int) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(arch, layer_index)
        self.self_attn.scale = float(arch.raw.get("query_pre_attn_scalar") or arch.head_dim) ** -0.5
        self.self_attn.softcap = float(arch.raw.get("attn_logit_softcapping") or 0.0)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(arch)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, cos_sin: tuple) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos_sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def norms(self) -> tuple[nn.Module, nn.Module, nn.Module | None, nn.Module | None]:
        """As DecoderLayer.norms: Gemma's four."""
        return (self.input_layernorm, self.pre_feedforward_layernorm, self.post_attention_layernorm,
                self.post_feedforward_layernorm)


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_layer = GemmaDecoderLayer

    def __init__(self, arch: ArchConfig, max_positions: int | None = None) -> None:
        super().__init__(arch, max_positions)
        self.embed_scale = arch.hidden_size**0.5
        self.final_softcap = float(arch.raw.get("final_logit_softcapping") or 0.0)
        # The sliding layers' rotary, where it differs from the global layers' (Gemma 3).
        local = _local_rope(arch)
        self.local_rotary = None if local is None else RotaryEmbedding(
            arch.rotary_dim, max_positions or arch.max_position_embeddings, local, None)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        local = cos_sin if self.local_rotary is None else self.local_rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, local if layer.self_attn.window else cos_sin)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap:
            logits = soft_cap(logits, self.final_softcap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        for module in self.modules():  # Gemma's norms scale by 1 + weight
            if isinstance(module, RMSNorm):
                module.weight.data.add_(1.0)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    # Gemma 3 4B and up ship as image-text checkpoints: their text model's tensors sit under language_model
    # (model.language_model in newer ones), beside a vision tower kvflow does not run.
    renamed_params = (("language_model.model.", ""), ("language_model.lm_head.", "lm_head."),
                      ("language_model.", ""))
    skipped_params = ("vision_tower.", "multi_modal_projector.")

    def __init__(self, arch: ArchConfig, max_positions: int | None = None) -> None:
        arch.qk_norm = True
        super().__init__(arch, max_positions)


def _local_rope(arch: ArchConfig) -> float | None:
    """The rotary base of Gemma 3's sliding-window layers (None: they share the global layers' rotary)."""
    params = arch.raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        return float(params["sliding_attention"].get("rope_theta", 10000.0))
    local = arch.raw.get("rope_local_base_freq")
    return None if local is None else float(local)
