"""Python side of the fused decoder step (csrc/decoder_step.cpp): a whole few-row forward in one call.

`FusedDecoderStep.for_model(model)` describes a Llama-family model whose projections are all
PackedLinear to the C++ code once (weight pointers, norms, rotary tables); the model then hands it every
step. Steps of at most `max_rows` rows (63) run in that one call. Steps of many_rows.MIN_ROWS rows or
more, once the fast mode has made bfloat16 copies of the weights, go to kernels/many_rows: oneDNN matmuls
on AMX (at 64 rows and more faster than the packed kernel, even on AMX int8 tiles:
benchmarks/bench_quant_linear.py) with the C++ elementwise ops between them. Steps it does not take (an
unbound cache, index dtypes the kernel does not read, many rows without the bfloat16 copies) return None
and run through the PyTorch layers.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from kvflow.kernels import build, cpu_attention, many_rows
from kvflow.kernels.packed_matmul import PackedWeightStruct
from kvflow.layers.attention.metadata import AttentionMetadata

# The packed kernel's cost grows with the rows (VNNI below 16 rows, AMX int8 from 16). Decode batches of 24, 32
# and 48 rows measured 1.1 to 1.4x faster here than through many_rows (oneDNN on the bfloat16 copies), and 64
# rows 1.15x slower: the fused step takes every step below many_rows.MIN_ROWS.
DEFAULT_MAX_ROWS = many_rows.MIN_ROWS - 1

_ptr, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class LayerStruct(ctypes.Structure):
    _fields_ = [("qkv", PackedWeightStruct), ("o", PackedWeightStruct), ("gate_up", PackedWeightStruct),
                ("down", PackedWeightStruct), ("input_norm", _ptr), ("post_norm", _ptr), ("qkv_bias", _ptr),
                ("q_norm", _ptr), ("k_norm", _ptr), ("k_cache", _ptr), ("v_cache", _ptr)]


class DecoderStruct(ctypes.Structure):
    _fields_ = [("num_layers", _i32), ("hidden", _i32), ("num_heads", _i32), ("num_kv_heads", _i32),
                ("head_dim", _i32), ("intermediate", _i32), ("eps", _f32), ("attn_scale", _f32), ("cos", _ptr),
                ("sin", _ptr), ("max_positions", _i64), ("final_norm", _ptr), ("cache_dtype", _i32),
                ("block_size", _i32), ("layers", ctypes.POINTER(LayerStruct))]


class StepStruct(ctypes.Structure):
    _fields_ = [("slots", _ptr), ("query_start", _ptr), ("seq_lens", _ptr), ("block_tables", _ptr),
                ("table_stride", _i64), ("num_seqs", _i32)]


@functools.cache  # resolved once: called on the per-step path
def _kernel():
    return build.function("kvflow_decoder_step",
                          (ctypes.POINTER(DecoderStruct), _ptr, _ptr, _i32, ctypes.POINTER(StepStruct), _i32))


def _f32_ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("fused step needs float32 contiguous CPU tensors")
    return t.data_ptr()


class FusedDecoderStep:
    def __init__(self, model: nn.Module, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        self.model = model
        self.max_rows = max_rows
        self._attn = [layer.self_attn for layer in model.layers]  # read every step by _bind
        # The first layer's k_cache the structs were built for. Held (with every bound cache, in _keep) so
        # that no freed cache's address can come back as another's while the structs point at it.
        self._bound_cache: torch.Tensor | None = None
        self._struct: DecoderStruct | None = None
        self._layers = None
        self._keep: list[torch.Tensor] = []
        self._many_rows = False  # whether many_rows can run (once the bf16 copies exist)

    @property
    def struct(self) -> DecoderStruct | None:
        """The model as the C++ code reads it, for the cache last bound (None before the first bind)."""
        return self._struct

    def _many_rows_supported(self) -> bool:
        if not self._many_rows:  # asked again until the bf16 copies exist; then kept
            self._many_rows = many_rows.supports(self.model)
        return self._many_rows

    @classmethod
    def for_model(cls, model: nn.Module) -> FusedDecoderStep | None:
        """The fused step for this model, or None where it cannot run (see `reason_unsupported`)."""
        return None if reason_unsupported(model) else cls(model)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Final-norm hidden states [T, hidden] float32, or None for a step the fused path does not take."""
        rows = input_ids.shape[0]
        many = rows > self.max_rows
        if rows == 0 or positions.dtype != torch.int64 or not positions.is_contiguous():
            return None
        if many and (rows < many_rows.MIN_ROWS or not self._many_rows_supported()):
            return None
        if meta.slot_mapping is None or meta.block_tables is None or not self._bind():
            return None  # no cache to attend through (one-shot scoring), or none bound yet
        step = cpu_attention.step_args(meta)
        if step is None:
            return None
        if many:
            return many_rows.forward(self, input_ids, positions, meta)
        slots, _, query_start, seq_lens, tables, table_stride, num_seqs = step
        hidden = self.model.embed_tokens(input_ids).float().contiguous()
        args = StepStruct(slots, query_start, seq_lens, tables, table_stride, num_seqs)
        rc = _kernel()(ctypes.byref(self._struct), hidden.data_ptr(), positions.data_ptr(), rows,
                       ctypes.byref(args), torch.get_num_threads())
        if rc == -2:
            raise ValueError(f"a position is past the model's context ({self._struct.max_positions} positions)")
        if rc != 0:
            raise RuntimeError(f"fused decoder step failed ({rc})")
        return hidden

    def _bind(self) -> bool:
        """(Re)build the structs when the KV cache the layers point at changed. False with no cache bound."""
        attn = self._attn
        if attn[0].k_cache is None:
            return False
        if self._bound_cache is attn[0].k_cache and self._struct is not None:
            return True
        k0 = attn[0].k_cache
        if k0.dtype not in cpu_attention.CACHE_DTYPES or k0.device.type != "cpu":
            return False
        arch, rotary = self.model.arch, self.model.rotary
        layers = (LayerStruct * len(attn))()
        keep = [rotary.cos, rotary.sin] + [t for a in attn for t in (a.k_cache, a.v_cache)]
        for i, layer in enumerate(self.model.layers):
            a, mlp = layer.self_attn, layer.mlp
            if not (a.k_cache.is_contiguous() and a.v_cache.is_contiguous()):
                return False
            layers[i] = LayerStruct(
                a.qkv_proj.packed.struct, a.o_proj.packed.struct, mlp.gate_up_proj.packed.struct,
                mlp.down_proj.packed.struct, _f32_ptr(layer.input_layernorm.weight),
                _f32_ptr(layer.post_attention_layernorm.weight), _f32_ptr(a.qkv_proj.bias),
                _f32_ptr(a.q_norm.weight if a.q_norm is not None else None),
                _f32_ptr(a.k_norm.weight if a.k_norm is not None else None),
                a.k_cache.data_ptr(), a.v_cache.data_ptr(),
            )
        self._struct = DecoderStruct(
            arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
            arch.intermediate_size, arch.rms_norm_eps, attn[0].scale, _f32_ptr(rotary.cos), _f32_ptr(rotary.sin),
            rotary.cos.shape[0], _f32_ptr(self.model.norm.weight), cpu_attention.CACHE_DTYPES[k0.dtype],
            k0.shape[1], layers,
        )
        self._layers, self._keep = layers, keep
        self._bound_cache = k0
        return True


def reason_unsupported(model: nn.Module) -> str | None:
    """Why the fused step cannot run this model, or None when it can."""
    from kvflow.layers.quant.packed_linear import PackedLinear

    if _kernel() is None:
        return "no C++ compiler for the CPU kernels"
    if not hasattr(model, "layers") or not hasattr(model, "rotary"):
        return "not a Llama-family decoder"
    if model.rotary.cos.dtype != torch.float32 or model.rotary.cos.device.type != "cpu":
        return "the model is not float32 on CPU"
    for layer in model.layers:
        a, mlp = layer.self_attn, layer.mlp
        projections = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(p, PackedLinear) for p in projections):
            return "some projections are not packed (PackedLinear)"
        if any(p.bias is not None for p in projections[1:]):
            return "a projection other than q/k/v has a bias"
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        norms += [n.weight for n in (a.q_norm, a.k_norm) if n is not None]
        if any(t.dtype != torch.float32 for t in norms):
            return "norm weights are not float32"
    return None
