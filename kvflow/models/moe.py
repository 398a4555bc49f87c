"""Mixture-of-experts MLPs (Mixtral, Qwen3-MoE, gpt-oss): a router picks each token's top experts, and the
token's MLP output is their outputs weighted by the router's probabilities. gpt-oss's router and experts
have biases (ArchConfig.router_bias, expert_bias).

Each expert is a gated MLP of its own (models/llama.MLP), so expert weights load, pack and run like any
other layer's. A step runs each expert once, on the rows routed to it: decode reads only the experts its
tokens chose. The routing runs in float64 (see route) and a row's sum over its experts runs in expert
order, so a token's result does not depend on the other tokens in its step.
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
        self.gate = Linear(arch.hidden_size, arch.num_experts, bias=arch.router_bias)  # the router
        self.experts = nn.ModuleList(expert(arch, arch.moe_intermediate_size, bias=arch.expert_bias)
                                     for _ in range(arch.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen experts [T, k] and their weights [T, k] (float32). A float router runs in
        float64: PyTorch's float32 matmul rounds a row by how many rows the call has, and a last-bit change
        in the weights would make a token's output depend on its batch; rounded to float32 from float64,
        the weights do not (the packed kernel's rows never depend on it)."""
        if isinstance(self.gate, Linear):
            if getattr(self, "_router64", None) is None:
                bias = self.gate.bias
                self._router64 = (self.gate.weight.detach().double(), None if bias is None else bias.detach().double())
            logits = torch.nn.functional.linear(x.double(), *self._router64)
        else:  # a packed router (a quantized GGUF file's)
            logits = self.gate(x).double()
        # (gpt-oss takes the softmax of the top logits alone: the same as these weights renormalised.)
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.route(x)
        if x.shape[0] == 1 and self._packed_experts() is not None:
            out = self._one_token(x, chosen[0], weights[0])
            if out is not None:
                return out
        out = torch.zeros_like(x)
        # One pass over the chosen experts, ascending: the only sync is reading which experts were hit.
        for e in torch.unique(chosen).tolist():
            rows, slot = torch.where(chosen == e)
            y = self.experts[e](x[rows]) * weights[rows, slot, None].to(x.dtype)
            out.index_add_(0, rows, y)
        return out

    def _packed_experts(self) -> list | None:
        """Each expert's (gate/up, down) packed weights, where all are PackedLinear (else None)."""
        if not hasattr(self, "_packed"):
            from kvflow.layers.quant.packed_linear import PackedLinear

            layers = [(e.gate_up_proj, e.down_proj) for e in self.experts]
            ok = all(isinstance(p, PackedLinear) for pair in layers for p in pair)
            self._packed = [(g.packed, d.packed) for g, d in layers] if ok else None
        return self._packed

    def _one_token(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """A decode token's experts as two kernel calls (every chosen expert's gate/up, then every down), in
        one thread team each, where a call an expert costs as much again in start-up as the expert's bytes
        (1-2 MB). The sum runs in ascending expert order from zero, as forward's, so it is bitwise the same."""
        from kvflow.kernels import packed_matmul

        if x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        order = torch.argsort(chosen)
        experts, w = chosen[order].tolist(), weights[order].to(x.dtype)
        packed = self._packed
        gate_up = packed_matmul.matmul_many(x.contiguous(), [packed[e][0] for e in experts])
        if gate_up is None:
            return None
        gate_up = _plus_biases(gate_up, [self.experts[e].gate_up_proj.bias for e in experts])
        hidden = self.experts[experts[0]].act_and_mul(gate_up).contiguous()
        down = packed_matmul.matmul_many(hidden, [packed[e][1] for e in experts])
        if down is None:
            return None
        down = _plus_biases(down, [self.experts[e].down_proj.bias for e in experts])
        out = torch.zeros_like(x)
        for j in range(len(experts)):
            out += down[j : j + 1] * w[j]
        return out


def _plus_biases(rows: torch.Tensor, biases: list[torch.Tensor | None]) -> torch.Tensor:
    """Row j of one kernel call over several experts plus expert j's bias (experts without one: as is)."""
    if biases[0] is None:
        return rows
    return rows + torch.stack(biases)
