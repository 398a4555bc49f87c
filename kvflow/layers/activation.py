"""Gated MLP activations, by the name a config gives (hidden_act): act(gate) * up."""

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from kvflow.errors import UnsupportedModelError


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up holds [gate | up] on its last dimension; returns silu(gate) * up (SwiGLU: Llama, Qwen)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU (Gemma's gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def swiglu_oai_and_mul(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts: the gate capped at limit, up clamped to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma 2's soft-capping of attention scores and final logits."""
    return cap * torch.tanh(x / cap)


GATED_ACTIVATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "silu": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
    "swiglu_oai": swiglu_oai_and_mul,  # takes alpha and limit (ArchConfig.swiglu_alpha, swiglu_limit)
}


def gated_activation(name: str, **params: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation by its config name; params (alpha, limit) are bound for those that take them."""
    if name not in GATED_ACTIVATIONS:
        raise UnsupportedModelError(f"activation {name!r} is not supported (supported: {', '.join(GATED_ACTIVATIONS)})")
    act = GATED_ACTIVATIONS[name]
    return partial(act, **params) if params else act
