"""CUDA graphs for decode steps (the CUDA executor's): capture the model forward once per batch size, replay it every step.

A decode step of a small model is mostly kernel-launch overhead; a graph replays all of a forward's
launches at once. Graphs fix every tensor address and shape, so each batch size on a ladder
(1, 2, 4, ..., up to max_num_seqs) gets its own graph reading static input buffers, and a batch of B
sequences replays the smallest graph of size >= B with the spare rows padded so they do no harm:
slot -1 (store_kv writes nothing) and seq_len 0 (attention reads nothing and outputs zeros).

The attention backend must not depend on per-step host values (TritonBackend qualifies). Graphs hold
the KV-cache addresses bound at capture, so they must be captured again if the cache is reallocated.
"""

from __future__ import annotations

import bisect

import torch

from kvflow.layers.attention.metadata import AttentionMetadata

LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The ladder up to max_num_seqs, plus max_num_seqs itself so every allowed batch has a graph."""
    sizes = [s for s in LADDER if s < max_num_seqs]
    return sizes + [max_num_seqs]


def graph_size_for(sizes: list[int], batch: int) -> int | None:
    """The smallest captured size that holds `batch` rows, or None when none does."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


class StaticDecodeInputs:
    """Preallocated decode inputs for up to max_num_seqs rows; a graph of size n reads their first n rows."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device | str) -> None:
        n = max_num_seqs
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token per row
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)

    def meta(self, size: int) -> AttentionMetadata:
        # The host lists are placeholders fixed at capture: graph-safe backends read lengths from tensors.
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[0] * size,
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
        )

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        """Copy a decode batch of B <= size rows in; rows B..size become padding that writes and reads nothing."""
        b = meta.num_seqs
        width = meta.block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.slot_mapping[b:size].fill_(-1)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.seq_lens[b:size].fill_(0)
        # Columns past `width` keep stale ids: kernels read only the blocks a row's seq_len covers.
        self.block_tables[:b, :width].copy_(meta.block_tables)


class CudaGraphRunner:
    """Captures `model` for decode-only batches and replays it; the runner falls back to eager otherwise."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device | str,
    ) -> None:
        if not getattr(backend, "supports_cuda_graphs", False):
            raise ValueError(f"attention backend {getattr(backend, 'name', backend)!r} cannot run in a CUDA graph")
        self.model = model
        self.device = torch.device(device)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.sizes = capture_sizes(max_num_seqs)
        self.inputs = StaticDecodeInputs(max_num_seqs, max_blocks_per_seq, self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, so the smaller graphs fit inside its memory pool."""
        pool = None
        for size in reversed(self.sizes):
            ids, pos, meta = self.inputs.input_ids[:size], self.inputs.positions[:size], self.inputs.meta(size)
            self.model(ids, pos, meta)  # warm-up: compiles the Triton kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(ids, pos, meta)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (
            bool(self.graphs)
            and meta.num_seqs > 0
            and meta.is_decode_only
            and meta.num_seqs <= self.sizes[-1]
            and meta.slot_mapping is not None
            and meta.slot_mapping.shape[0] == meta.num_seqs
            and meta.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode batch. The tensor lives in the graph's memory: use it
        (compute logits) before the next replay overwrites it."""
        size = graph_size_for(self.sizes, meta.num_seqs)
        self.inputs.fill(input_ids, positions, meta, size)
        self.graphs[size].replay()
        return self.outputs[size][: meta.num_seqs]
