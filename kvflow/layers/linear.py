"""Linear layers. Weights are stored [out_features, in_features], as in PyTorch and Hugging Face."""

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        # A bfloat16 copy for steps of at least bf16_min_rows rows: set by the executor where bfloat16
        # matmuls are native and the mode allows it (kvflow/executors/layers.py).
        self.weight_bf16: torch.Tensor | None = None
        self.bf16_min_rows: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_bf16 is not None and x.shape[0] >= self.bf16_min_rows:
            y = F.linear(x.to(torch.bfloat16), self.weight_bf16).to(x.dtype)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)
