"""Mixture-of-experts MLPs (Mixtral, Qwen3-MoE): a router picks each token's top experts, and the token's
MLP output is their outputs weighted by the router's probabilities.

Each expert is a gated MLP of its own (models/llama.MLP), so expert weights load, pack and run like any
other layer's. A step runs each expert once, on the rows routed to it: decode reads only the experts its
tokens chose. The routing is float32 (as transformers computes it) and a row's sum over its experts runs
in expert order, so a token's result does not depend on the other tokens in its step.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.layers.linear import Linear
from kvflow.models.arch import ArchConfig


class SparseMoE(nn.Module):
    def __init__(self, arch: ArchConfig, expert: type[nn.Module]) -> None:
        super().__init__()
        self.top_k, self.normalize = arch.num_experts_per_tok, arch.norm_topk_prob
        self.gate = Linear(arch.hidden_size, arch.num_experts)  # the router
        self.experts = nn.ModuleList(expert(arch, arch.moe_intermediate_size) for _ in range(arch.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen experts [T, k] and their weights [T, k] (float32)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.route(x)
        out = torch.zeros_like(x)
        # One pass over the chosen experts, ascending: the only sync is reading which experts were hit.
        for e in torch.unique(chosen).tolist():
            rows, slot = torch.where(chosen == e)
            y = self.experts[e](x[rows]) * weights[rows, slot, None].to(x.dtype)
            out.index_add_(0, rows, y)
        return out
