"""Figures of a loaded model that rooflines need: the bytes a decode step reads, and what prefill multiplies on.

Used by `kvflow bench latency` and by the server's page (through LoadedModel.summary()).
"""

from __future__ import annotations

import torch


def weight_bytes_read_per_step(model: torch.nn.Module) -> int:
    """Bytes of every weight a decode step of one sequence reads: all parameters and packed buffers except
    the embedding table, which is only indexed (when it is tied, the output projection reads it and it is
    counted), and of a mixture of experts the share of its experts one token runs (top_k of them)."""
    from kvflow.models.moe import SparseMoE

    seen: set[int] = set()
    total = 0
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        total += _weight_bytes(moe.experts, seen) * moe.top_k // len(moe.experts)
    return total + _weight_bytes(model, seen)


def _weight_bytes(model: torch.nn.Module, seen: set[int]) -> int:
    """Bytes of the weights under `model` not in `seen` (which then holds them); see above."""
    embed = getattr(model, "embed_tokens", None)
    skip = set() if embed is None else {id(t) for t in embed.parameters()} | {id(t) for t in embed.buffers()}
    tied = getattr(getattr(model, "arch", None), "tie_word_embeddings", False)
    # An untied packed embedding (a GGUF file's token_embd) is a packed layer of its own, only indexed.
    skip_layers = set() if embed is None or tied else {id(m) for m in embed.modules()}
    from kvflow.layers.quant.base import outermost_quant_layers

    total = 0
    for module in outermost_quant_layers(model):  # packed layers keep their bytes outside parameters and buffers
        if id(module) not in seen and id(module) not in skip_layers:
            seen.add(id(module))
            total += module.nbytes()
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        if id(t) in seen or name.endswith(("cos", "sin", "layer_id")):  # tables and indices, not weights
            continue
        seen.add(id(t))
        if id(t) in skip and not tied:
            continue
        total += t.numel() * t.element_size()
    return total


def prefill_matmul_kind(loaded) -> str:
    """What a prefill chunk's matmuls run on: "bf16" (copies, or the packed weights on AMX bfloat16 tiles),
    the "packed" kernel, or "f32" weights."""
    has_bf16 = any(getattr(m, "weight_bf16", None) is not None or getattr(m, "dense_bf16", None) is not None
                   or getattr(m, "dense_from_packed", False) for m in loaded.model.modules())
    if loaded.dtype != torch.float32 or has_bf16:
        return "bf16"
    return "packed" if loaded.native is not None else "f32"
