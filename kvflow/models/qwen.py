"""Qwen2/Qwen2.5 (bias on q, k, v) and Qwen3 (per-head RMSNorm on q and k): Llama with one change each."""

from kvflow.models.arch import ArchConfig
from kvflow.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ArchConfig, max_positions: int | None = None) -> None:
        arch.attention_bias = True
        super().__init__(arch, max_positions)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ArchConfig, max_positions: int | None = None) -> None:
        arch.qk_norm = True
        super().__init__(arch, max_positions)
