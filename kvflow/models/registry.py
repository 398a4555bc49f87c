"""Which Hugging Face architecture names kvflow runs, and with which class."""

from __future__ import annotations

from torch import nn

from kvflow.errors import UnsupportedModelError
from kvflow.models.arch import ArchConfig
from kvflow.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from kvflow.models.gpt_oss import GptOssForCausalLM
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.mixtral import MixtralForCausalLM
from kvflow.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

# Families that are one of these classes with other config values: Mistral (Llama), Phi-3/4 (Llama with
# fused checkpoint tensors and partial rotary), Qwen3-MoE (Qwen3 with experts: its layers read the config).
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3ForCausalLM,
}


def check_architecture_name(hf_config: dict) -> None:
    names = hf_config.get("architectures") or [hf_config.get("model_type", "unknown")]
    if names[0] not in MODEL_CLASSES:
        raise UnsupportedModelError(
            f"architecture {names[0]!r} is not supported; supported: {', '.join(MODEL_CLASSES)}"
        )


def model_class_for(arch: ArchConfig) -> type[nn.Module]:
    check_architecture_name({"architectures": [arch.architecture]})
    return MODEL_CLASSES[arch.architecture]
