"""What attention needs to know about a flat, varlen batch.

A step's tokens are one 1-D tensor: several sequences back to back, no padding.
Sequence b owns tokens query_start_loc[b]:query_start_loc[b+1]; they are its last
query_len tokens, so the first one sits at position seq_len - query_len and
every query attends causally to all of its sequence's earlier positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [B + 1], cumulative query lengths (cu_seqlens_q)
    seq_lens: torch.Tensor  # int32 [B], context length of each sequence including this step's tokens
    query_lens_cpu: list[int]  # host copies: CPU paths loop or branch on them without a device sync
    seq_lens_cpu: list[int]
    slot_mapping: torch.Tensor | None = None  # int64 [T], cache slot of each new token; None: no KV cache
    block_tables: torch.Tensor | None = None  # int32 [B, max_blocks], padded with 0
    # Per sequence, the first block id when its blocks are consecutive in the pool (then its context is a
    # plain slice of the cache, read without a gather), else -1. Host-side; optional: first_block() works
    # it out from host_block_tables (the block ids as the scheduler holds them) when a backend asks.
    contiguous_first_block: list[int] | None = None
    host_block_tables: list[list[int]] | None = None
    # Where the model's layers keep their KV in several groups (engine/kv_cache_groups.py: sliding-window
    # layers beside global ones), the metadata of groups 1.. (this one is group 0's): the same queries,
    # their own slots and block tables.
    group_metas: list[AttentionMetadata] | None = None

    def for_group(self, group: int) -> AttentionMetadata:
        """Group `group`'s metadata; without groups (one group, or a forward with no cache) this one."""
        return self if group == 0 or self.group_metas is None else self.group_metas[group - 1]

    def first_block(self, b: int) -> int:
        """Sequence b's first block id where its blocks are consecutive in the pool, else -1."""
        if self.contiguous_first_block is None:
            self.contiguous_first_block = [_first_if_consecutive(t) for t in self.host_block_tables or ()]
        return self.contiguous_first_block[b] if b < len(self.contiguous_first_block) else -1

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def for_prompts(cls, lengths: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
        """Metadata for whole prompts with no KV cache (used by parity tests and one-shot scoring)."""
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
            query_lens_cpu=list(lengths),
            seq_lens_cpu=list(lengths),
        )


def _first_if_consecutive(table: list[int]) -> int:
    if not table or table[-1] - table[0] != len(table) - 1:
        return -1
    return table[0] if len(table) == 1 or bool(np.all(np.diff(table) == 1)) else -1
