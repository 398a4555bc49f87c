"""The native decoder's view of a loaded model: the KvflowDecoder struct (csrc/kvflow_cpu.h) built from the
model's own layers, which the C++ forward (csrc/decoder_forward.cpp) runs in one call a step.

The struct is the architecture as the model file describes it (models/llama.py: which norms, whether
q/k/v carry a bias, whether heads are normed), pointing at the model's packed weights; nothing here
restates the forward. `reason_unsupported` says why a model cannot run natively (the PyTorch layers run
it then); a new architecture feature is either described by a struct field the C++ forward reads, or
listed there until it is.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from kvflow.kernels import abi, packed_matmul, paged_attention
from kvflow.layers.quant.packed_linear import PackedLinear
from kvflow.layers.quant.packed_parts import PackedParts
from kvflow.layers.quant.vocab import ExactTopLogits, PackedEmbedding
from kvflow.models.moe import SparseMoE

PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the order of KvflowDense's projection numbers
# The gated MLP's, as KvflowDecoder.activation numbers them (swiglu_oai: gpt-oss's clamped SwiGLU).
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "swiglu_oai": 2}


def _rotary_tables(model: nn.Module) -> list[torch.Tensor]:
    tables = [model.rotary.cos, model.rotary.sin]
    local = getattr(model, "local_rotary", None)  # Gemma 3's sliding layers
    return tables + ([local.cos, local.sin] if local is not None else [])


def _layer_rotary(model: nn.Module, layer: nn.Module) -> tuple[int | None, int | None]:
    """The layer's own rotary table (cos, sin addresses), where it is not the model's."""
    local = getattr(model, "local_rotary", None)
    if local is None or not layer.self_attn.window:
        return None, None
    return _f32(local.cos), _f32(local.sin)


def _projections(layer: nn.Module) -> tuple[nn.Module, ...]:
    """The layer's packed projections in PROJECTIONS order; a MoE layer's are q/k/v and o (its experts are
    described by KvflowMoE)."""
    a, mlp = layer.self_attn, layer.mlp
    if isinstance(mlp, SparseMoE):
        return a.qkv_proj, a.o_proj
    return a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj


def _dense_operand(p: nn.Module) -> torch.Tensor | nn.Module | None:
    """What a many-row step multiplies a projection by: its bfloat16 copy as W^T, the projection itself where
    it multiplies its packed weights on tiles (model_setup.make_bf16_copies left it without a copy), or None."""
    if getattr(p, "dense_bf16", None) is not None:
        return p.dense_bf16.t()
    return p if getattr(p, "dense_from_packed", False) else None


def _two_parts(p: nn.Module) -> bool:
    return isinstance(p, PackedParts) and len(p.parts) == 2 and all(isinstance(q, PackedLinear) for q in p.parts)


def _structs(p: nn.Module) -> tuple:
    """A projection's packed weight, and the rest of its columns where its parts come in two types."""
    if isinstance(p, PackedParts):
        return p.parts[0].packed.struct, p.parts[1].packed.struct
    return p.packed.struct, abi.KvflowPackedWeight()


def _moe_unsupported(moe: SparseMoE) -> str | None:
    experts = [p for e in moe.experts for p in (e.gate_up_proj, e.down_proj)]
    if not all(isinstance(p, PackedLinear) for p in experts):
        return "some experts are not packed (PackedLinear)"
    if len({p.bias is None for p in experts}) > 1:
        return "some experts have biases and some not"
    biases = [p.bias for p in (*experts, moe.gate) if p.bias is not None]
    if any(b.dtype != torch.float32 for b in biases):
        return "expert or router biases are not float32"
    if not isinstance(moe.gate, PackedLinear) and moe.gate.weight.dtype != torch.float32:
        return "the router is not a float32 matrix"
    return None


def _f32(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("the native decoder reads float32 contiguous CPU tensors")
    return t.data_ptr()


def reason_unsupported(model: nn.Module) -> str | None:
    """Why the native decoder cannot run this model, or None when it can."""
    if abi.native() is None:
        return "no C++ compiler for the CPU kernels"
    if not packed_matmul.available():
        return "the packed-matmul kernel is not available"
    if not hasattr(model, "layers") or not hasattr(model, "rotary"):
        return "not a Llama-family decoder"
    if model.arch.rotary_dim != model.arch.head_dim:
        return "rotary on part of each head (the native decoder rotates whole heads)"
    if model.arch.hidden_act not in ACTIVATIONS:
        return f"activation {model.arch.hidden_act!r} (the native decoder runs {', '.join(ACTIVATIONS)})"
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in _rotary_tables(model)):
        return "the model is not float32 on CPU"
    if not isinstance(model.embed_tokens, PackedEmbedding | nn.Embedding):
        return "the token embedding is neither packed nor a float table"
    if isinstance(model.embed_tokens, PackedEmbedding) and not isinstance(model.embed_tokens.source, PackedLinear):
        return "the token embedding is packed for another kernel"
    for layer in model.layers:
        projections = _projections(layer)
        if not all(isinstance(p, PackedLinear) or _two_parts(p) for p in projections):
            return "some projections are not packed (PackedLinear, or PackedParts of two)"
        if any(p.bias is not None for p in projections[2:]):
            return "the dense MLP has a bias"
        if any(p.bias is not None and p.bias.dtype != torch.float32 for p in projections[:2]):
            return "q/k/v or o has a bias that is not float32"
        if layer.self_attn.sinks is not None and layer.self_attn.sinks.dtype != torch.float32:
            return "the attention sinks are not float32"
        if isinstance(layer.mlp, SparseMoE) and (reason := _moe_unsupported(layer.mlp)):
            return reason
        a = layer.self_attn
        norms = [n.weight for n in (*layer.norms(), a.q_norm, a.k_norm) if n is not None]
        if any(t.dtype != torch.float32 for t in norms):
            return "norm weights are not float32"
    return None


class NativeModel:
    """The struct for one loaded model, re-pointed at whichever KV cache is bound (engines sharing a model
    take turns, each binding its own before its step)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        arch, rotary = model.arch, model.rotary
        self.layers = (abi.KvflowDecoderLayer * arch.num_layers)()
        self._moe: list = []  # each MoE layer's struct and expert arrays, kept alive: C holds their addresses
        for i, layer in enumerate(model.layers):
            a = layer.self_attn
            (qkv, qkv_rest), (o, _), *mlp = (_structs(p) for p in _projections(layer))
            none = (abi.KvflowPackedWeight(), abi.KvflowPackedWeight())
            (gate_up, gate_up_rest), (down, _) = mlp or (none, none)
            before_attn, before_mlp, attn_out, mlp_out = layer.norms()
            cos, sin = _layer_rotary(model, layer)
            self.layers[i] = abi.KvflowDecoderLayer(
                qkv=qkv, o=o, gate_up=gate_up, down=down, qkv_rest=qkv_rest, gate_up_rest=gate_up_rest,
                moe=self._moe_struct(layer.mlp, arch),
                input_norm=_f32(before_attn.weight), post_norm=_f32(before_mlp.weight),
                attn_out_norm=_f32(attn_out.weight if attn_out is not None else None),
                mlp_out_norm=_f32(mlp_out.weight if mlp_out is not None else None),
                cos=cos, sin=sin, kv_group=a.kv_group, qkv_bias=_f32(a.qkv_proj.bias), o_bias=_f32(a.o_proj.bias),
                q_norm=_f32(a.q_norm.weight if a.q_norm is not None else None),
                k_norm=_f32(a.k_norm.weight if a.k_norm is not None else None),
                attention=abi.KvflowAttention(num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
                                              head_dim=a.head_dim, scale=a.scale, window=a.window,
                                              softcap=a.softcap, sinks=_f32(a.sinks)),
            )
        embed = model.embed_tokens
        head = model.lm_head
        self.head_packed = isinstance(head, ExactTopLogits) and isinstance(head.packed, PackedLinear)
        if self.head_packed:
            head.packed.prepare_error_bound()
        self.struct = abi.KvflowDecoder(
            num_layers=arch.num_layers, hidden=arch.hidden_size, num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim, intermediate=arch.intermediate_size,
            vocab_size=arch.vocab_size, eps=arch.rms_norm_eps, cos=_f32(rotary.cos), sin=_f32(rotary.sin),
            max_positions=rotary.cos.shape[0], final_norm=_f32(model.norm.weight),
            embedding=embed.source.packed.struct if isinstance(embed, PackedEmbedding) else abi.KvflowPackedWeight(),
            embedding_f32=None if isinstance(embed, PackedEmbedding) else _f32(embed.weight),
            head=head.packed.packed.struct if self.head_packed else abi.KvflowPackedWeight(),
            head_abs_sum=_f32(head.packed._block_abs_sum) if self.head_packed else None,
            layers=self.layers, activation=ACTIVATIONS[arch.hidden_act],
            embed_scale=getattr(model, "embed_scale", 0.0), swiglu_alpha=arch.swiglu_alpha,
            swiglu_limit=arch.swiglu_limit,
        )
        self.final_softcap = float(getattr(model, "final_softcap", 0.0))  # Gemma 2's, on the packed head's logits
        # bfloat16 copies for many-row steps ([layer][projection] as W^T views), where the plan made them.
        # (None with experts: they run on the packed kernel alone.)
        # Or the projection itself where it multiplies its packed weights on bfloat16 tiles without a copy.
        dense = [[_dense_operand(p) for p in _projections(layer)] for layer in model.layers]
        self.dense_t = (None if self._moe or any(w is None for ws in dense for w in ws) else dense)
        self.bound: list | None = None  # the kv_caches list the structs point at
        self._held: list = []  # that list's tensors, so no freed cache's address comes back as another's

    def _moe_struct(self, mlp: nn.Module, arch) -> object:
        """A pointer to the KvflowMoE of a MoE layer's MLP, or None for a dense one."""
        if not isinstance(mlp, SparseMoE):
            return None
        count = len(mlp.experts)
        gate_up = (abi.KvflowPackedWeight * count)(*[e.gate_up_proj.packed.struct for e in mlp.experts])
        down = (abi.KvflowPackedWeight * count)(*[e.down_proj.packed.struct for e in mlp.experts])
        router = mlp.gate
        packed_router = isinstance(router, PackedLinear)
        # gpt-oss's expert biases, one contiguous table per projection (C reads expert e's row e).
        biased = mlp.experts[0].gate_up_proj.bias is not None
        biases = [torch.stack([getattr(e, p).bias for e in mlp.experts]).contiguous() if biased else None
                  for p in ("gate_up_proj", "down_proj")]
        moe = abi.KvflowMoE(num_experts=count, top_k=mlp.top_k, normalize=int(mlp.normalize),
                            intermediate=arch.moe_intermediate_size,
                            router=None if packed_router else _f32(router.weight),
                            router_packed=router.packed.struct if packed_router else abi.KvflowPackedWeight(),
                            gate_up=gate_up, down=down, router_bias=_f32(router.bias),
                            gate_up_bias=_f32(biases[0]), down_bias=_f32(biases[1]))
        self._moe.append((moe, gate_up, down, biases))
        return ctypes.pointer(moe)

    @classmethod
    def for_model(cls, model: nn.Module) -> NativeModel | None:
        return None if reason_unsupported(model) else cls(model)

    def bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point every layer's attention at these [blocks, block_size, kv_heads, head_dim] caches."""
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            a = layer.attention
            cache = paged_attention.layer_struct(k_cache, v_cache, a.num_heads, a.scale, a.window, a.softcap)
            cache.sinks = a.sinks  # the model's own, already checked
            layer.attention = cache
        self.bound, self._held = kv_caches, [t for pair in kv_caches for t in pair]
