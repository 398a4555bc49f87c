"""gpt-oss: a mixture-of-experts Llama-family decoder with OpenAI's changes.

- Attention has biases on q, k, v and o, and a learned "sink" logit per query head that joins every
  softmax's denominator without adding a value, so a head may attend to almost nothing.
- Layers alternate between a 128-token sliding window and full attention (ArchConfig.layer_types); the
  rotary table is YaRN-scaled.
- Each MLP is a mixture of experts. The router has a bias; a token's weights are the softmax of its top-k
  logits (the same as the full softmax's top-k renormalised, which models/moe.py computes). The experts
  have biases, and their activation is SwiGLU with the gate capped, the up projection clamped and
  shifted by one ("swiglu_oai" in layers/activation.py).

Checkpoints store each layer's experts stacked, with gate and up interleaved column by column
([experts, hidden, 2 * width], transposed against nn.Linear), or as MXFP4 blocks and scales
(`*_blocks`, `*_scales`, rows in nn.Linear's order). Loading splits them into kvflow's per-expert layers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvflow.models.arch import ArchConfig
from kvflow.models.llama import LlamaForCausalLM

# The 16 values of a 4-bit E2M1 float (MXFP4's elements), by their code.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class GptOssForCausalLM(LlamaForCausalLM):
    renamed_params = ((".mlp.router.", ".mlp.gate."),)

    def __init__(self, arch: ArchConfig, max_positions: int | None = None) -> None:
        arch.attention_bias = arch.o_proj_bias = arch.attention_sinks = True
        arch.router_bias = arch.expert_bias = True
        arch.hidden_act = "swiglu_oai"
        super().__init__(arch, max_positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_experts(weights))


def split_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors with every stacked expert tensor replaced by per-expert gate_proj, up_proj
    and down_proj weights and biases ([out, in], as nn.Linear keeps them); the rest passed through."""
    pending: dict[str, torch.Tensor] = {}  # MXFP4 blocks or scales waiting for their other half
    for name, tensor in weights:
        prefix, sep, kind = name.partition(".mlp.experts.")
        if not sep or "." in kind:  # not stacked (or already per expert)
            yield name, tensor
            continue
        if kind.endswith(("_blocks", "_scales")):
            base = kind.rsplit("_", 1)[0]
            other = f"{prefix}.mlp.experts.{base}_{'scales' if kind.endswith('_blocks') else 'blocks'}"
            if other not in pending:
                pending[name] = tensor
                continue
            blocks, scales = (tensor, pending.pop(other)) if kind.endswith("_blocks") else (pending.pop(other), tensor)
            yield from _per_expert(prefix, base, dequantize_mxfp4(blocks, scales), rows_out=True)
        elif kind.endswith("_bias"):
            yield from _per_expert(prefix, kind.removesuffix("_bias"), tensor, rows_out=True, part="bias")
        else:
            yield from _per_expert(prefix, kind, tensor, rows_out=False)
    if pending:
        raise ValueError(f"checkpoint has MXFP4 blocks or scales without their pair: {sorted(pending)[:3]}")


def _per_expert(prefix: str, kind: str, stacked: torch.Tensor, rows_out: bool,
                part: str = "weight") -> Iterator[tuple[str, torch.Tensor]]:
    """stacked: [experts, out, in] (rows_out) or [experts, in, out]; biases [experts, out]. gate_up's
    outputs interleave gate and up."""
    if kind not in ("gate_up_proj", "down_proj"):
        raise KeyError(f"checkpoint tensor {prefix}.mlp.experts.{kind} has no place in gpt-oss")
    for e in range(stacked.shape[0]):
        t = stacked[e] if rows_out else stacked[e].transpose(0, 1)
        base = f"{prefix}.mlp.experts.{e}"
        if kind == "down_proj":
            yield f"{base}.down_proj.{part}", t.contiguous()
        else:
            yield f"{base}.gate_proj.{part}", t[0::2].contiguous()
            yield f"{base}.up_proj.{part}", t[1::2].contiguous()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 as Hugging Face checkpoints store it: blocks uint8 [..., groups, 16] (two E2M1 codes a byte, the
    low nibble first), scales uint8 [..., groups] (E8M0: 2^(s - 127) per group of 32) -> float32 [..., groups * 32]."""
    values = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., groups, 32]
    out = values[codes] * torch.exp2(scales.float() - 127.0).unsqueeze(-1)
    return out.flatten(-2)
