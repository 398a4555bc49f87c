"""Rotary position embedding (the "rotate half" / NeoX layout Hugging Face checkpoints use).

cos/sin are precomputed for every position up to the context length and indexed by each token's
position, so a flat batch of tokens from many sequences needs no special handling.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvflow.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "longrope", "yarn")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "freq_factors":  # from GGUF files: one divisor per frequency, precomputed
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if rope_type == "longrope":  # the short factors; RotaryEmbedding takes the long ones past the original length
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32)
    raise UnsupportedModelError(
        f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (gpt-oss, Qwen long-context): frequencies that turn fewer than beta_slow times over the original
    context are slowed by `factor`, those turning more than beta_fast times are kept, a linear ramp between."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns this many times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(float(scaling.get("beta_fast") or 32)), dim_of(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the frequency is kept, 0: slowed by factor
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def yarn_gain(scaling: dict) -> float:
    """The factor YaRN scales cos and sin by (its attention temperature)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        gain = 1.0
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if rope_type == "longrope":
            freqs, gain = _longrope(freqs, head_dim, theta, scaling)
        elif rope_type == "yarn":
            gain = yarn_gain(scaling)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * gain, persistent=False)
        self.register_buffer("sin", emb.sin() * gain, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's cos/sin rows, [T, 1, D]: looked up once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def _longrope(freqs: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """Phi-3.5 / Phi-4-mini's LongRoPE: positions past the original context rotate by the long factors
    (earlier ones keep the short ones, as a transformers KV cache that grew past it holds them), and cos
    and sin are scaled by the attention factor."""
    original = int(scaling["original_max_position_embeddings"])
    if freqs.shape[0] > original:
        long_freq = rope_inv_freq(head_dim, theta, None) / torch.tensor(scaling["long_factor"], dtype=torch.float32)
        freqs[original:] = torch.outer(torch.arange(original, freqs.shape[0], dtype=torch.float32), long_freq)
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    gain = scaling.get("attention_factor")
    if gain is None:
        gain = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return freqs, float(gain)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D]; cos/sin: [T, 1, R]. With R < D (partial rotary: Phi-3/4) only the
    first R values of each head rotate; the rest pass through."""
    cos, sin = cos_sin
    r = cos.shape[-1]
    if r < q.shape[-1]:
        (q_rot, q_pass), (k_rot, k_pass) = q.split([r, q.shape[-1] - r], -1), k.split([r, k.shape[-1] - r], -1)
        q_rot, k_rot = apply_rotary(q_rot, k_rot, cos_sin)
        return torch.cat((q_rot, q_pass), -1), torch.cat((k_rot, k_pass), -1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)
