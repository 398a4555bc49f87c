"""Attention backends: how one layer's attention runs over a flat batch, with or without the paged cache.

A backend builds its own view of a step's metadata once per step (`build_metadata`, from the shared
AttentionMetadata: the kernel arguments it needs, in the form it needs them), then, for each layer, gets
the step's q/k/v ([T, heads, head_dim]) and, when a KV cache is bound, stores k/v into their slots and
attends over everything cached. Backends differ per device and mode; models do not. The executor picks
the backend (kvflow/executors).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kvflow.layers.attention import reference
from kvflow.layers.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def build_metadata(self, meta: AttentionMetadata) -> Any:
        """This backend's metadata for the step (built once per step, read by every layer)."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor | None,
        v_cache: torch.Tensor | None,
        meta: Any,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """window > 0: a sliding-window layer (each query sees its last `window` positions); softcap > 0:
        scores capped as softcap * tanh(score / softcap); sinks [Hq]: each head's logit that joins the
        softmax's denominator and adds no value (gpt-oss)."""
        ...


class ReferenceBackend:
    """Plain PyTorch, any device: obviously right, slow."""

    name = "reference"

    def build_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window=0, softcap=0.0, sinks=None):  # noqa: D102 - see AttentionBackend
        starts = meta.query_start_loc.tolist()
        if k_cache is None or meta.slot_mapping is None:  # no cache bound, or a one-shot forward
            out = torch.empty_like(q)
            for b in range(meta.num_seqs):
                s, e = starts[b], starts[b + 1]
                out[s:e] = reference.causal_attention(q[s:e], k[s:e], v[s:e], scale, window, softcap, sinks)
            return out
        reference.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return reference.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens_cpu, starts, scale, window, softcap, sinks
        )
