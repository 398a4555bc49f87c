"""The vocabulary's two ends on packed weights: the token embedding and the output head.

A GGUF file usually ties them (one Q8_0 table): the head multiplies by it and the embedding looks rows up
through it, so one packed copy serves both.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.layers.quant.base import QuantLinear


class PackedEmbedding(nn.Module):
    """Token embedding whose rows are read from a packed layer (a tied embedding shares lm_head's bytes)."""

    def __init__(self, source: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.source = source
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.source.embedding(ids).to(self.dtype)


class ExactTopLogits(nn.Module):
    """A packed output projection whose best logits per row are recomputed in float64 from the exact rows.

    The packed kernels approximate: PyTorch's int4 kernel rounds its output to bfloat16 (a logit of 20
    moves by up to 0.04, enough to swap two near-tied tokens now and then); kvflow's own kernel quantizes
    its input (a bound it states, PackedLinear.error_bound). There, every token whose logit is within two
    bounds of the row's best is recomputed in C++ (PackedLinear.exact_top): the greedy choice is then the
    exact product's. Elsewhere, the k best are recomputed."""

    def __init__(self, packed: QuantLinear, k: int = 16) -> None:
        super().__init__()
        self.packed = packed
        self.k = min(k, packed.out_features)
        if hasattr(packed, "prepare_error_bound"):
            packed.prepare_error_bound()  # now, not in the first request's time to first token

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        exact_top = getattr(self.packed, "exact_top", None)
        logits = exact_top(hidden) if exact_top is not None else None
        if logits is not None:
            return logits.to(hidden.dtype)
        logits = self.packed(hidden)
        top = logits.topk(self.k, dim=-1).indices
        emb = self.packed.embedding(top)  # [T, k, in] float32
        exact = (emb.double() * hidden.double().unsqueeze(-2)).sum(-1)  # per row: independent of the batch
        return logits.scatter(-1, top, exact.to(logits.dtype))
