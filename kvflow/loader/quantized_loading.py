"""`--quantization`: weights that stay packed integers in memory, on CPU.

gguf       a GGUF file's Q4_0 / Q4_1 / Q8_0 weights become packed layers straight from the file's bytes,
           before any float tensor is read (`pack_gguf`); the rest (norms, K-quants, F16) loads as float.
           A tied Q8_0 token embedding is ONE packed copy: lm_head multiplies by it and the embedding
           looks rows up through it.
int8/int4  float checkpoints: after the float load, every decoder Linear (and lm_head for int8) is
           quantized in place (`quantize_linears`).

The model around the packed layers stays float32 (norms, rotary, attention); a packed layer rounds its
input to bfloat16 and returns float32.

Batch invariance: every packed layer uses the packed-integer kernel whatever the row count. That kernel's
result for a row is bitwise independent of the other rows (and of the thread count), so greedy outputs do
not depend on what else is in the batch or on the prefill chunk size. The dequantize + AMX path that
QuantLinear takes above 32 rows rounds the weights to bfloat16 and is not even row-independent across row
counts, so exact mode (dtype float32) keeps it off. The default fast mode turns it on for prefill speed,
and runs steps of up to 16 rows as one fused C++ call (kernels/decoder_step); tests/engine/test_invariance
checks that its greedy outputs hold across batches and chunk sizes all the same.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import nn

from kvflow.errors import ModelLoadError
from kvflow.layers.linear import Linear
from kvflow.layers.quant import (
    QuantLinear,
    build_quant_linear,
    gguf_linear,
    quantize_weight,
    unpermute_rope_index,
)
from kvflow.loader import gguf_file

SCHEMES = ("gguf", "int8", "int4")
_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}


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
    moves by up to 0.04, which swaps SmolLM2's top two tokens about once in 50 steps); kvflow's own kernel
    quantizes its input (a bound it states, PackedLinear.error_bound). There, every token whose logit is
    within two bounds of the row's best is recomputed in C++ (PackedLinear.exact_top): the greedy choice
    is then the exact product's. Elsewhere, the k best are recomputed."""

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


def pick_quantization(option: str | None, model_kind: str, fast_cpu: bool) -> str | None:
    """The scheme to load with. Unset means automatic: a GGUF file in the default fast mode on CPU keeps
    its packed weights (a quarter of float32's bytes per decode step); anything else loads as float."""
    if option == "none":
        return None
    if option is None:
        return "gguf" if fast_cpu and model_kind == "gguf" else None
    return option


def check_quantization(quantization: str | None, model_kind: str, device: torch.device) -> None:
    """Refuse what cannot run, before any weight is read."""
    if quantization is None:
        return
    if quantization not in SCHEMES:
        raise ModelLoadError(f"unknown quantization {quantization!r} (use {', '.join(SCHEMES)})")
    if device.type != "cpu":
        raise ModelLoadError(
            f"--quantization {quantization} runs on CPU only (its packed kernels are CPU kernels), but the "
            f"device is {device}; use --device cpu, or drop --quantization to run float weights on {device}"
        )
    if quantization == "gguf" and model_kind != "gguf":
        raise ModelLoadError("--quantization gguf keeps a GGUF file's own packed weights; this model is not a "
                             "GGUF file (use int8 or int4 to quantize a float checkpoint)")


def pack_gguf(model: nn.Module, raw_tensors: Iterable[gguf_file.RawTensor], dtype: torch.dtype) -> set[str]:
    """Swap every Linear (and the token embedding) whose GGUF weights are packed types for packed layers.

    Returns the GGUF names consumed, for the float loader to skip. A fused layer (q/k/v, gate/up) is packed
    only when all of its parts are packed types of one bit width; otherwise it loads as float."""
    raws = {r.hf_name.removeprefix("model."): r for r in raw_tensors}
    tied = model.arch.tie_word_embeddings
    consumed: set[str] = set()
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear):
            continue
        sources = ["embed_tokens.weight"] if name == "lm_head" and tied else _weight_sources(model, name)
        parts = [raws.get(s) for s in sources]
        if None in parts or len({_BITS[p.qtype] for p in parts}) != 1:
            continue
        layer = gguf_linear(
            [(p.data, p.qtype) for p in parts],
            row_orders=[None if p.rope_heads is None else unpermute_rope_index(p.data.shape[0], p.rope_heads)
                        for p in parts],
            bias=module.bias,  # uninitialised here; the float pass fills it (Qwen2's q/k/v bias)
            exact_rows=name == "lm_head",  # rows read back exactly: the embedding, ExactTopLogits
        )
        _install(model, name, layer)
        consumed |= {p.gguf_name for p in parts}
    embed = raws.get("embed_tokens.weight")
    if tied and isinstance(model.lm_head, ExactTopLogits):
        model.embed_tokens = PackedEmbedding(model.lm_head.packed, dtype)
    elif not tied and embed is not None:
        model.embed_tokens = PackedEmbedding(gguf_linear([(embed.data, embed.qtype)], exact_rows=True), dtype)
        consumed.add(embed.gguf_name)
    return consumed


def _install(model: nn.Module, name: str, layer: QuantLinear) -> None:
    layer.max_kernel_rows = sys.maxsize  # the kernel for every row count: batch invariance (module doc)
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
        if isinstance(module, Linear) and (name.startswith("layers.") or (name == "lm_head" and scheme == "int8")):
            _install(model, name, build_quant_linear(quantize_weight(module.weight, scheme), bias=module.bias))
    if scheme == "int8" and model.arch.tie_word_embeddings:
        model.embed_tokens = PackedEmbedding(model.lm_head.packed, model.embed_tokens.weight.dtype)


def weight_nbytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy: packed layers by their own count, float parameters by size."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, QuantLinear) and id(module) not in seen:
            seen.add(id(module))
            total += module.nbytes()
    for p in model.parameters():  # deduplicated by PyTorch; includes packed layers' float bias
        total += p.numel() * p.element_size()
    return total
