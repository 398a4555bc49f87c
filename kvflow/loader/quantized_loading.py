"""`--quantization`: weights that stay packed integers in memory, on CPU.

gguf       a GGUF file's weights of the packed types (packing.PACKED_BITS: Q4_x, Q5_x, Q8_0, Q2_K..Q6_K,
           IQ4_NL, IQ4_XS) become packed layers straight from the file's bytes, before any float tensor is
           read (`pack_gguf`); the rest (norms, F16, the other types) loads as float.
           A tied Q8_0 token embedding is ONE packed copy: lm_head multiplies by it and the embedding
           looks rows up through it.
int8/int4  float checkpoints: after the float load, every decoder Linear (and lm_head for int8) is
           quantized in place (`quantize_linears`).

The model around the packed layers stays float32 (norms, rotary, attention). Which scheme a load uses,
and how its layers then run, is the executor's plan (kvflow/executors/plan.py), not this module's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvflow.kernels import packed_weight
from kvflow.layers.linear import Linear
from kvflow.layers.quant import (
    QuantLinear,
    build_quant_linear,
    gguf_linear,
    quantize_weight,
    unpermute_rope_index,
)
from kvflow.layers.quant.base import outermost_quant_layers
from kvflow.layers.quant.factory import UnpackableCodes
from kvflow.layers.quant.packed_linear import PackedLinear
from kvflow.layers.quant.vocab import ExactTopLogits, PackedEmbedding
from kvflow.loader import gguf_file
from kvflow.loader.gguf_reader import release_pages
from kvflow.loader.packed_cache import PackedCache
from kvflow.models.moe import SparseMoE


def pack_gguf(model: nn.Module, raw_tensors: Iterable[gguf_file.RawTensor], dtype: torch.dtype,
              cache: PackedCache | None = None) -> set[str]:
    """Swap every Linear (and the token embedding) whose GGUF weights are packed types for packed layers.

    Returns the GGUF names consumed, for the float loader to skip. A fused layer (q/k/v, gate/up) is packed
    when all of its parts are packed types (as 8-bit codes where their widths differ); otherwise it loads as
    float. With a cache (loader/packed_cache.py), packed bytes an earlier load wrote are mapped, not rebuilt."""
    with packed_weight.packing_through(cache):
        consumed = _pack_all(model, raw_tensors, dtype)
    if cache is not None:
        cache.finish()
    return consumed


def _pack_all(model: nn.Module, raw_tensors: Iterable[gguf_file.RawTensor], dtype: torch.dtype) -> set[str]:
    raws = {r.hf_name.removeprefix("model."): r for r in raw_tensors}
    packed_weight.start_arena()
    tied = model.arch.tie_word_embeddings
    consumed: set[str] = set()
    for name, module in list(model.named_modules()):
        if isinstance(module, SparseMoE):
            consumed |= _pack_experts(model, name, module, raws)
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear):
            continue
        sources = ["embed_tokens.weight"] if name == "lm_head" and tied else _weight_sources(model, name)
        if f"{name}.weight" in raws:  # a fused layer the file stores fused (Phi-3's q/k/v and gate/up)
            sources = [f"{name}.weight"]
        parts = [raws.get(s) for s in sources]
        if None in parts:
            continue
        try:
            layer = gguf_linear(
                [(p.data, p.qtype) for p in parts],
                row_orders=[None if p.rope_heads is None else unpermute_rope_index(p.data.shape[0], p.rope_heads)
                            for p in parts],
                bias=module.bias,  # uninitialised here; the float pass fills it (Qwen2's q/k/v bias)
                exact_rows=name == "lm_head",  # rows read back exactly: the embedding, ExactTopLogits
            )
        except UnpackableCodes:  # Q5_1 or blocks of 16 without kvflow's kernel: load as float
            continue
        _install(model, name, layer)
        consumed |= {p.gguf_name for p in parts}
        for p in parts:
            release_pages(p.data)
    embed = raws.get("embed_tokens.weight")
    if tied and isinstance(model.lm_head, ExactTopLogits):
        model.embed_tokens = PackedEmbedding(model.lm_head.packed, dtype)
    elif not tied and embed is not None:
        model.embed_tokens = PackedEmbedding(gguf_linear([(embed.data, embed.qtype)], exact_rows=True), dtype)
        consumed.add(embed.gguf_name)
    return consumed


def _pack_experts(model: nn.Module, name: str, moe: SparseMoE, raws: dict) -> set[str]:
    """Each projection of a MoE layer's experts (gate/up, down) packed in one call for all of them, from
    the file's stacked tensor, then cut into one packed layer per expert: one pass over the tensor's
    bytes, where a call per expert cost its own start-up thousands of times. Returns the GGUF names
    consumed; a projection the packer does not take is left to the per-layer pass."""
    consumed: set[str] = set()
    for proj in ("gate_up_proj", "down_proj"):
        per_expert = [[raws.get(s) for s in _weight_sources(model, f"{name}.experts.{e}.{proj}")]
                      for e in range(len(moe.experts))]
        parts = [p for expert in per_expert for p in expert]
        if None in parts or len({p.qtype for p in parts}) != 1:
            continue
        try:
            layer = gguf_linear([(p.data, p.qtype) for p in parts])
        except UnpackableCodes:
            continue
        views = (packed_weight.split_rows(layer.packed, layer.out_features // len(moe.experts))
                 if isinstance(layer, PackedLinear) else None)
        if views is None:
            continue
        for e, view in enumerate(views):
            bias = getattr(moe.experts[e], proj).bias  # gpt-oss's; the float pass fills it
            model.set_submodule(f"{name}.experts.{e}.{proj}", PackedLinear(view, bias=bias))
        consumed |= {p.gguf_name for p in parts}
        for p in parts:
            release_pages(p.data)
    return consumed


def _install(model: nn.Module, name: str, layer: QuantLinear) -> None:
    model.set_submodule(name, ExactTopLogits(layer) if name == "lm_head" else layer)


def _weight_sources(model: nn.Module, module_name: str) -> list[str]:
    """Checkpoint weight names (without "model.") that make up a module, in fused order."""
    stem, _, leaf = module_name.rpartition(".")
    parts = sorted((index, part) for fused, part, index in model.stacked_params if fused == leaf)
    if not parts:
        return [f"{module_name}.weight"]
    return [f"{stem}.{part}.weight" for _, part in parts]


def quantize_linears(model: nn.Module, scheme: str | None) -> None:
    """int8 / int4: replace the decoder layers' float Linears (and lm_head for int8) by packed ones.

    lm_head stays float under int4 (4-bit logits cost too much accuracy for a small share of the bytes).
    A tied int8 lm_head also serves the embedding, so the float table is dropped."""
    if scheme not in ("int8", "int4"):
        return
    for name, module in list(model.named_modules()):
        if name.endswith(".mlp.gate"):  # a MoE router: small, and its rounding would move tokens between experts
            continue
        if isinstance(module, Linear) and (name.startswith("layers.") or (name == "lm_head" and scheme == "int8")):
            _install(model, name, build_quant_linear(quantize_weight(module.weight, scheme), bias=module.bias))
    if scheme == "int8" and model.arch.tie_word_embeddings:
        model.embed_tokens = PackedEmbedding(model.lm_head.packed, model.embed_tokens.weight.dtype)


def weight_nbytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy: packed layers by their own count, float parameters by size."""
    total = sum(module.nbytes() for module in outermost_quant_layers(model))
    for p in model.parameters():  # deduplicated by PyTorch; includes packed layers' float bias
        total += p.numel() * p.element_size()
    return total
