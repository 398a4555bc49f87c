"""SwiGLU: the gated MLP activation of Llama and Qwen."""

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up holds [gate | up] on its last dimension; returns silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
