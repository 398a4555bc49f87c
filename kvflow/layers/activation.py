"""Gated MLP activations, by the name a config gives (hidden_act): act(gate) * up."""

from collections.abc import Callable

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


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma 2's soft-capping of attention scores and final logits."""
    return cap * torch.tanh(x / cap)


GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
}


def gated_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in GATED_ACTIVATIONS:
        raise UnsupportedModelError(f"activation {name!r} is not supported (supported: {', '.join(GATED_ACTIVATIONS)})")
    return GATED_ACTIVATIONS[name]
