"""Which Hugging Face architecture names kvflow runs, and with which class."""

from __future__ import annotations

from torch import nn

from kvflow.errors import UnsupportedModelError
from kvflow.models.arch import ArchConfig
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def check_architecture_name(hf_config: dict) -> None:
    names = hf_config.get("architectures") or [hf_config.get("model_type", "unknown")]
    if names[0] not in MODEL_CLASSES:
        raise UnsupportedModelError(
            f"architecture {names[0]!r} is not supported; supported: {', '.join(MODEL_CLASSES)}"
        )


def model_class_for(arch: ArchConfig) -> type[nn.Module]:
    check_architecture_name({"architectures": [arch.architecture]})
    cls = MODEL_CLASSES[arch.architecture]
    if arch.architecture == "MistralForCausalLM" and arch.raw.get("sliding_window"):
        window = arch.raw["sliding_window"]
        if window < arch.max_position_embeddings:
            raise UnsupportedModelError(
                f"MistralForCausalLM with a sliding window ({window} tokens) is not supported"
            )
    return cls
