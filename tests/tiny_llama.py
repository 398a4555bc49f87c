"""A tiny random-weight kvflow Llama with a bound paged KV cache, for backend and CUDA-graph tests."""

from __future__ import annotations

import torch

from kvflow.layers.attention.metadata import AttentionMetadata
from kvflow.models.arch import ArchConfig
from kvflow.models.llama import LlamaForCausalLM

BLOCK_SIZE = 8


def tiny_arch(head_dim: int = 64, num_heads: int = 4, num_kv_heads: int = 2) -> ArchConfig:
    return ArchConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=num_heads * head_dim, intermediate_size=128,
        num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=True,
    )


def tiny_model(arch: ArchConfig, backend, dtype: torch.dtype, device: torch.device,
               num_blocks: int = 24) -> LlamaForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(arch).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    shape = (num_blocks, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    for layer in model.attention_layers:
        layer.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        layer.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        layer.backend = backend
    return model.eval()


def set_backend(model: LlamaForCausalLM, backend) -> None:
    for layer in model.attention_layers:
        layer.backend = backend


def step_inputs(starts: list[int], counts: list[int], tables: list[list[int]], device: torch.device):
    """input_ids, positions and metadata for sequences computing positions start..start+count-1."""
    ids, positions, slots = [], [], []
    for b, (start, count) in enumerate(zip(starts, counts)):
        for p in range(start, start + count):
            ids.append((7 * p + 3 * b) % 64)
            positions.append(p)
            slots.append(tables[b][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query_start = [0]
    for c in counts:
        query_start.append(query_start[-1] + c)
    seq_lens = [s + c for s, c in zip(starts, counts)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_lens_cpu=list(counts),
        seq_lens_cpu=seq_lens,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=table.to(device),
    )
    return torch.tensor(ids, device=device), torch.tensor(positions, device=device), meta


def caches(model: LlamaForCausalLM) -> list[torch.Tensor]:
    return [t.clone() for layer in model.attention_layers for t in (layer.k_cache, layer.v_cache)]
