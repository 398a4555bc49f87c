"""The execution plan: how a model will run, decided once, before any weight is read.

Two modes:
  fast   the default. On CPU: a GGUF file's packed types (Q4_x/Q5_x/Q8_0/Q2_K-Q6_K/IQ4) stay packed, the cache holds
         float16, steps run through the native decoder (one C++ call a step) where the model allows, and
         many-row steps multiply bfloat16 copies where bfloat16 is native. A token's rounding may then
         depend on what else was in its step. On CUDA: the model's dtype, Triton attention, CUDA graphs.
  exact  CPU only (asked for as mode="exact", or as dtype="float32"): float32 weights (or packed ones
         with quantization="gguf") and cache, kernels whose result for a row never depends on the batch,
         no compile: greedy outputs are the same whatever the batch, chunking, caching or preemption.

`plan_execution` turns a ModelConfig (and the kind of model file) into an ExecutionPlan; the loader
reads weights as the plan says, and `executors.model_setup.prepare_model` makes the model ready to run it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.config import ModelConfig
from kvflow.errors import ModelLoadError
from kvflow.executors.compile import COMPILE_MODES
from kvflow.executors.measured import bf16_copies_pay
from kvflow.kernels import cpu_features

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = ("auto", "fast", "exact")
QUANTIZATIONS = ("gguf", "int8", "int4")


@dataclass(frozen=True)
class ExecutionPlan:
    device: torch.device
    mode: str  # "fast" or "exact"
    dtype: torch.dtype  # of the float weights and activations
    quantization: str | None  # "gguf", "int8", "int4" or None (float weights)
    kv_cache_dtype: torch.dtype  # what kv_cache_dtype="auto" means
    compile: str  # auto | on | off (auto: where the native decoder cannot run, in the fast CPU mode)
    bf16_copies: bool  # many-row matmuls on bfloat16 copies of the weights (where they pay: executors/measured)
    cpu_tier: str  # the kernel tier (kernels/cpu_features): generic, avx2, avx512, amx
    fast_cpu: bool  # the fast mode's CPU defaults (dtype auto on CPU)

    @property
    def executor(self) -> str:
        """Which executor runs the steps: cuda, cpu_exact, cpu_fast, or the plain PyTorch layers (cpu)."""
        if self.device.type == "cuda":
            return "cuda"
        if self.mode == "exact":
            return "cpu_exact"
        return "cpu_fast" if self.fast_cpu else "cpu"

    @property
    def batch_invariant(self) -> bool:
        return self.mode == "exact"


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for but no CUDA device is available")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ModelLoadError(f"unknown device {name!r} (use auto, cpu or cuda)")
    return torch.device(name)


def pick_mode(mode: str, dtype: str, device: torch.device) -> str:
    if mode not in MODES:
        raise ModelLoadError(f"unknown mode {mode!r} (use {', '.join(MODES)})")
    if mode == "auto":
        return "exact" if device.type == "cpu" and dtype == "float32" else "fast"
    if mode == "exact" and device.type != "cpu":
        raise ModelLoadError(f"the exact mode runs on CPU only; the device is {device}")
    if mode == "exact" and dtype not in ("auto", "float32"):
        raise ModelLoadError(f"the exact mode computes in float32; dtype {dtype} contradicts it")
    return mode


def pick_dtype(name: str, mode: str, device: torch.device, model_dtype: str | None) -> torch.dtype:
    if name != "auto":
        if name not in DTYPES:
            raise ModelLoadError(f"unknown dtype {name!r} (use auto, {', '.join(DTYPES)})")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # bf16 matmuls with few rows are slow on CPU; decode is few rows
    return torch.float16 if model_dtype == "float16" else torch.bfloat16


def pick_quantization(option: str | None, model_kind: str, fast_cpu: bool, device: torch.device) -> str | None:
    """Unset means automatic: a GGUF file in the fast CPU mode keeps its packed weights (a quarter of
    float32's bytes per decode step); anything else loads as float. What cannot run is refused here,
    before any weight is read."""
    if option == "none":
        return None
    if option is None:
        return "gguf" if fast_cpu and model_kind == "gguf" else None
    if option not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {option!r} (use {', '.join(QUANTIZATIONS)})")
    if device.type != "cpu":
        raise ModelLoadError(
            f"--quantization {option} runs on CPU only (its packed kernels are CPU kernels), but the "
            f"device is {device}; use --device cpu, or drop --quantization to run float weights on {device}"
        )
    if option == "gguf" and model_kind != "gguf":
        raise ModelLoadError("--quantization gguf keeps a GGUF file's own packed weights; this model is not a "
                             "GGUF file (use int8 or int4 to quantize a float checkpoint)")
    return option


def plan_execution(config: ModelConfig, model_kind: str, model_dtype: str | None = None) -> ExecutionPlan:
    """The plan for this config and model file kind ("gguf" or "hf"); model_dtype is the checkpoint's."""
    device = pick_device(config.device)
    mode = pick_mode(config.mode, config.dtype, device)
    dtype = pick_dtype(config.dtype, mode, device, model_dtype)
    if config.compile not in COMPILE_MODES:
        raise ModelLoadError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {config.compile!r}")
    # The fast CPU defaults apply to the default dtype; an explicit bfloat16 or float16 on CPU runs the
    # PyTorch layers in that dtype, with nothing else changed.
    fast_cpu = mode == "fast" and device.type == "cpu" and config.dtype == "auto"
    quantization = pick_quantization(config.quantization, model_kind, fast_cpu, device)
    # The fast CPU cache holds float16 (llama.cpp's default too): half the bytes a decode step reads at
    # depth; float16 keeps 3 more mantissa bits than bfloat16, and K/V values sit well in its range.
    kv_dtype = torch.float16 if fast_cpu else dtype
    return ExecutionPlan(
        device=device, mode=mode, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_dtype,
        compile=config.compile if fast_cpu else ("on" if config.compile == "on" else "off"),
        bf16_copies=fast_cpu and bf16_copies_pay(), cpu_tier=cpu_features.isa_tier(),
        fast_cpu=fast_cpu,
    )
