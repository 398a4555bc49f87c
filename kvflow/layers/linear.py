"""Linear layers. Weights are stored [out_features, in_features], as in PyTorch and Hugging Face."""

import torch
import torch.nn.functional as F
from torch import nn

# Below this many rows a bf16 matmul on CPU costs more in fixed overhead than it saves (decode steps);
# above it, AMX tiles make bf16 several times faster than float32 (prefill chunks, big batches).
AMX_MIN_ROWS = 32


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.weight_bf16: torch.Tensor | None = None  # set by enable_amx_prefill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_bf16 is not None and x.shape[0] >= AMX_MIN_ROWS:
            y = F.linear(x.to(torch.bfloat16), self.weight_bf16)
            y = y.to(x.dtype)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def enable_amx_prefill(model: nn.Module) -> int:
    """Give every float32 Linear a bf16 copy of its weight for many-row matmuls. Returns the bytes added.

    Decode steps (few rows) keep reading float32; prefill chunks and large batches run on AMX. The cost is
    numerical: a token's result then depends on how many rows its step had, so float32 mode (bit-stable
    across batches) leaves this off. Packed layers (QuantLinear) likewise get a dense bf16 copy and
    switch to it above AMX_MIN_ROWS; their packed kernel keeps serving decode. The output projection is
    left alone: it only ever sees the rows being sampled."""
    added = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.weight.dtype == torch.float32:
            module.weight_bf16 = module.weight.detach().to(torch.bfloat16)
            added += module.weight_bf16.numel() * 2
        elif hasattr(module, "cache_dense_bf16") and not name.startswith("lm_head"):
            module.cache_dense_bf16()
            module.max_kernel_rows = AMX_MIN_ROWS
            added += module.dense_bf16.numel() * 2
    return added
