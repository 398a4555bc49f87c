"""load_model: from a ModelConfig to a ready model, its tokenizer and its shape."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from kvflow.config import ModelConfig
from kvflow.errors import ModelLoadError
from kvflow.kernels import packed_matmul
from kvflow.kernels.decoder_step import FusedDecoderStep
from kvflow.layers.linear import cpu_has_amx, enable_amx_prefill
from kvflow.layers.quant.packed_linear import PackedLinear
from kvflow.loader import gguf_file, hf_folder, quantized_loading
from kvflow.loader.resolve import ResolvedModel, resolve_model
from kvflow.loader.tokenizer import load_tokenizer
from kvflow.models import compiled
from kvflow.models.arch import ArchConfig
from kvflow.models.registry import check_architecture_name, model_class_for

log = logging.getLogger("kvflow")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any
    arch: ArchConfig
    resolved: ResolvedModel
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    quantization: str | None = None  # the scheme in effect (after "automatic" was resolved)
    kv_cache_dtype: torch.dtype | None = None  # what kv_cache_dtype="auto" means for this load
    # The exact mode (dtype float32 on CPU): kernels chosen so a token's result never depends on its batch.
    batch_invariant: bool = False


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for but no CUDA device is available")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ModelLoadError(f"unknown device {name!r} (use auto, cpu or cuda)")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device, arch: ArchConfig) -> torch.dtype:
    if name != "auto":
        if name not in DTYPES:
            raise ModelLoadError(f"unknown dtype {name!r} (use auto, {', '.join(DTYPES)})")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # bf16 matmuls with few rows are slow on CPU; decode is few rows
    return torch.float16 if arch.torch_dtype == "float16" else torch.bfloat16


def set_threads(threads: int | None) -> None:
    if threads is None:
        threads = physical_cores()
    torch.set_num_threads(max(1, threads))


def physical_cores() -> int:
    try:
        cores = set()
        with open("/proc/cpuinfo") as f:
            phys = core = None
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                    cores.add((phys, core))
        return max(1, min(len(cores) or os.cpu_count() or 1, len(os.sched_getaffinity(0))))
    except OSError:
        return os.cpu_count() or 1


def read_model_files(resolved: ResolvedModel):
    """(hf config dict, weight iterator factory, packed-weight iterator factory, tokenizer factory): cheap
    checks first, heavy reads later. The weight factory skips the GGUF names it is given (loaded packed)."""
    if resolved.kind == "gguf":
        reader = gguf_file.open_gguf(resolved.path)
        cfg = gguf_file.hf_config_from_gguf(reader, resolved.path)
        return (
            cfg,
            lambda skip=(): gguf_file.iter_gguf_weights(reader, cfg, skip),
            lambda: gguf_file.iter_gguf_raw(reader, cfg),
            lambda: load_tokenizer(resolved, reader),
        )
    cfg = hf_folder.read_config(resolved.path)
    weights = lambda skip=(): hf_folder.iter_weights(resolved.path)  # noqa: E731
    return cfg, weights, lambda: iter(()), lambda: load_tokenizer(resolved)


def read_arch(resolved: ResolvedModel, cfg: dict) -> ArchConfig:
    try:
        arch = ArchConfig.from_hf_config(cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{resolved.path}: config is missing or has a bad field: {exc}") from exc
    return arch


def load_model(config: ModelConfig) -> LoadedModel:
    resolved = resolve_model(config.model)
    cfg, weights, raw_weights, tokenizer_factory = read_model_files(resolved)
    check_architecture_name(cfg)  # refuse unsupported models before reading any field they may lack
    arch = read_arch(resolved, cfg)
    cls = model_class_for(arch)
    if resolved.kind == "hf":
        hf_folder.weight_files(resolved.path)
    tokenizer = tokenizer_factory()
    device = pick_device(config.device)
    fast_cpu = config.dtype == "auto" and device.type == "cpu"
    quantization = quantized_loading.pick_quantization(config.quantization, resolved.kind, fast_cpu)
    quantized_loading.check_quantization(quantization, resolved.kind, device)
    dtype = pick_dtype(config.dtype, device, arch)
    max_len = config.max_model_len or arch.max_position_embeddings
    with default_dtype(dtype), torch.device(device):
        model = cls(arch, max_positions=max_len)
    try:
        with torch.no_grad():
            packed = ()
            if quantization == "gguf":  # packed layers first, so no float copy of them is ever read
                packed = quantized_loading.pack_gguf(model, raw_weights(), dtype)
            model.load_weights((name, t.to(device=device, dtype=dtype)) for name, t in weights(packed))
            quantized_loading.quantize_linears(model, quantization)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{resolved.path}: {exc}") from exc
    model.eval()
    log.info("loaded %s (%s) on %s in %s", resolved.name, arch.architecture, device, str(dtype).split(".")[-1])
    if fast_cpu and quantization is not None:
        packed_matmul.move_to_huge_pages([m.packed for m in model.modules() if isinstance(m, PackedLinear)])
        model.fused_step = FusedDecoderStep.for_model(model)
    fused = getattr(model, "fused_step", None)
    if fused is not None:
        log.info("steps of up to %d rows run as one fused C++ call", fused.max_rows)
    if fast_cpu and cpu_has_amx():
        # Fast mode: prefill chunks and big batches in bf16 on AMX. dtype="float32" stays bit-stable.
        added = enable_amx_prefill(model)
        log.info("AMX prefill: bf16 copies of the weights for many-row matmuls (+%.0f MiB)", added / 2**20)
    # Compiling pays where many small PyTorch ops make up a step; the fused step has none left to fuse.
    if compiled.should_compile(config.compile, fast_cpu and fused is None):
        compiled.compile_model(model)
        compiled.warm_up(model, device)
    return_freed_memory()
    # The fast mode's cache holds K/V in float16 (llama.cpp's default too): half the bytes a decode step
    # reads at depth; float16 keeps 3 more mantissa bits than bfloat16, and K/V values sit well in range.
    kv_dtype = torch.float16 if fast_cpu else dtype
    exact_cpu = device.type == "cpu" and config.dtype == "float32"
    return LoadedModel(model, tokenizer, arch, resolved, dtype, device, max_len, quantization, kv_dtype, exact_cpu)


def return_freed_memory() -> None:
    """Hand the loader's freed staging buffers back to the OS. Packing and dequantizing allocate a few
    hundred MB of temporaries; glibc keeps freed heap memory resident unless asked (malloc_trim)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
