"""The vocabulary split across tensor-parallel ranks: each keeps a contiguous share of the embedding's rows
and of the output head's, so a 128K-token vocabulary's two tables (a gigabyte each at 4096 wide in 16 bits)
are not held whole by every rank.

  embedding   each rank looks up the ids in its share (the others give zeros); one all_reduce sums them.
  head        each rank computes its share of the logits; one all_gather joins them in rank order.

Megatron's vocabulary-parallel layers, as vLLM makes them. Used where the vocabulary divides evenly by the
ranks (sharding.shard_arch); otherwise every rank keeps both tables whole.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.distributed.group import TensorParallelGroup


class VocabParallelEmbedding(nn.Module):
    """Wraps the rank's embedding (float or packed) of rows [start, start + rows)."""

    def __init__(self, inner: nn.Module, start: int, rows: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner, self.start, self.rows, self.group = inner, start, rows, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = self.inner(local.clamp(0, self.rows - 1))
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(x)


class VocabParallelHead(nn.Module):
    """Wraps the rank's output head (its rows of the vocabulary); every rank returns the whole logits."""

    def __init__(self, inner: nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(self.inner(hidden))
