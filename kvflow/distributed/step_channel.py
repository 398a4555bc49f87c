"""What rank 0 tells the other ranks: the KV cache's size once, then each step, then stop.

Rank 0 schedules; the others hold a shard of the weights and of the KV cache and must run exactly the steps
rank 0 runs, in the same order, or their all_reduce calls would pair with the wrong step's. A message is one
broadcast from rank 0 (torch.distributed.broadcast_object_list: pickled, tensors included): a step's block
copies (copy-on-write of forked sequences) and its StepInputs, which carry block tables and slots, so every
rank writes its share of each token's K/V into the same cache slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from kvflow.distributed.group import TensorParallelError, first_sentence


@dataclass
class CacheLayout:
    """What a rank other than 0 needs to build a KV cache whose block ids mean what rank 0's mean."""

    group_blocks: list[int]
    block_size: int
    kv_cache_dtype: str
    attention_backend: str
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass
class StepMessage:
    kind: str  # "layout" | "step" | "stop"
    layout: CacheLayout | None = None
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    inputs: Any = None  # engine.runner.StepInputs, or None where the step only copies blocks


class Driver:
    """Rank 0's side: every message goes to all other ranks before rank 0 runs the step itself."""

    def __init__(self, ranks) -> None:
        self.ranks = ranks  # launch.Ranks

    def send_layout(self, layout: CacheLayout) -> None:
        self._send(StepMessage("layout", layout=layout))

    def send_step(self, block_copies: list[tuple[int, int]], inputs) -> None:
        self._send(StepMessage("step", block_copies=list(block_copies), inputs=inputs))

    def _send(self, message: StepMessage) -> None:
        if self.ranks.failure is not None:
            raise TensorParallelError(self.ranks.failure)
        try:
            send(message)
        except TensorParallelError as exc:
            raise TensorParallelError(self.ranks.fail(str(exc))) from None


def send(message: StepMessage) -> None:
    """Rank 0: hand a message to every other rank."""
    _broadcast([message])


def receive() -> StepMessage:
    """Ranks other than 0: wait for rank 0's next message."""
    box = [None]
    _broadcast(box)
    return box[0]


def _broadcast(box: list) -> None:
    try:
        dist.broadcast_object_list(box, src=0)
    except RuntimeError as exc:
        raise TensorParallelError(f"a tensor-parallel rank is gone: {first_sentence(exc)}") from None
