"""The fast mode's forward for steps of many rows (prefill chunks): oneDNN bfloat16 matmuls (AMX) on the
layers' dense copies, with everything between them in C++ (csrc/many_rows.cpp) and attention through the
paged kernel for every row.

Between two matmuls PyTorch would run several ops, each a pass over the rows and often a float32 copy
(bfloat16 output to float32, norm, back to bfloat16); here each gap is one pass, split across threads.
Attention (kernels/many_rows_attention) runs prompt chunks through PyTorch's bfloat16 flash kernel and
one-token queries through the paged C++ kernel, as in decode.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvflow.kernels import build, many_rows_attention
from kvflow.layers.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from kvflow.kernels.decoder_step import FusedDecoderStep

# From here on oneDNN's bfloat16 matmul beats the packed kernel (benchmarks/bench_quant_linear.py); fewer
# rows go to the fused decoder step (kernels/decoder_step), which reads the packed weights.
MIN_ROWS = 64

_ptr, _i32, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float


@functools.cache  # resolved once: called on the per-step path
def _ops():
    add_norm = build.function("kvflow_add_rms_norm", (_ptr, _ptr, _ptr, _i32, _i32, _f32, _ptr, _ptr, _i32),
                              restype=None)
    if add_norm is None:
        return None
    qkv_rotary = build.function("kvflow_qkv_rotary", (_ptr, _i32, _ptr, _i32, _ptr, _ptr, _i32))
    silu_mul = build.function("kvflow_silu_mul_rows", (_ptr, _i32, _i32, _ptr, _i32), restype=None)
    return add_norm, qkv_rotary, silu_mul


def supports(model: torch.nn.Module) -> bool:
    """Every projection has its bfloat16 copy (the fast mode's enable_amx_prefill made them)."""
    for layer in model.layers:
        a, mlp = layer.self_attn, layer.mlp
        if any(p.dense_bf16 is None for p in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return False
    return _ops() is not None


def forward(fused: FusedDecoderStep, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor | None:
    """Final-norm hidden states [T, hidden] float32 of a step whose structs `fused` has bound, or None for
    a step whose metadata does not give every row a query (attention would leave such rows unset)."""
    if sum(meta.query_lens_cpu) != input_ids.shape[0]:
        return None
    add_norm, qkv_rotary, silu_mul = _ops()
    model, threads = fused.model, torch.get_num_threads()
    arch = model.arch
    rows, width, eps = input_ids.shape[0], arch.hidden_size, arch.rms_norm_eps
    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    hidden = model.embed_tokens(input_ids).float().contiguous()
    normed = torch.empty(rows, width, dtype=torch.bfloat16)
    qkv = torch.empty(rows, q_size + 2 * kv_size)
    one_token_out = torch.empty(rows, arch.num_heads, arch.head_dim)  # the C++ kernel's one-token queries
    attn = torch.empty(rows, q_size, dtype=torch.bfloat16)
    act = torch.empty(rows, arch.intermediate_size, dtype=torch.bfloat16)
    delta = None  # the last matmul's output, not yet added to hidden
    struct = ctypes.byref(fused.struct)  # bound by the caller for this step's cache
    for i, layer in enumerate(model.layers):
        a, mlp = layer.self_attn, layer.mlp
        add_norm(hidden.data_ptr(), None if delta is None else delta.data_ptr(), layer.input_layernorm.weight.data_ptr(),
                 rows, width, eps, normed.data_ptr(), None, threads)
        projected = F.linear(normed, a.qkv_proj.dense_bf16)
        if qkv_rotary(struct, i, projected.data_ptr(), rows, positions.data_ptr(), qkv.data_ptr(), threads) == -2:
            raise ValueError(f"a position is past the model's context ({fused.struct.max_positions} positions)")
        many_rows_attention.store_and_attend(qkv, arch.num_heads, arch.num_kv_heads, a, meta, one_token_out, attn)
        delta = F.linear(attn, a.o_proj.dense_bf16)
        add_norm(hidden.data_ptr(), delta.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(), rows, width,
                 eps, normed.data_ptr(), None, threads)
        gate_up = F.linear(normed, mlp.gate_up_proj.dense_bf16)
        silu_mul(gate_up.data_ptr(), rows, arch.intermediate_size, act.data_ptr(), threads)
        delta = F.linear(act, mlp.down_proj.dense_bf16)
    add_norm(hidden.data_ptr(), delta.data_ptr(), model.norm.weight.data_ptr(), rows, width, eps, None,
             hidden.data_ptr(), threads)
    return hidden
