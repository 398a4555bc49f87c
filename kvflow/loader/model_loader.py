"""Reading a model: its files, its shape and its weights, in the dtype and scheme the caller asks for.

The loader decides nothing about how the model will run: kvflow/executors/plan.py chooses the dtype,
the quantization scheme and the device, and kvflow/executors/model_setup.py calls in here to read.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvflow.errors import ModelLoadError
from kvflow.loader import gguf_file, hf_folder, quantized_loading
from kvflow.loader.load_progress import LoadProgress, model_bytes
from kvflow.loader.packed_cache import PackedCache
from kvflow.loader.resolve import ResolvedModel
from kvflow.loader.tokenizer import load_tokenizer
from kvflow.models.arch import ArchConfig
from kvflow.models.registry import check_architecture_name, model_class_for


@dataclass
class ModelFiles:
    """A resolved model's files, opened: the config at once, weights and tokenizer when asked."""

    resolved: ResolvedModel
    hf_config: dict
    weights: Callable  # weights(skip=()) -> iterator of (HF name, float tensor); skips GGUF names loaded packed
    raw_weights: Callable  # () -> iterator of gguf_file.RawTensor (GGUF files only)
    tokenizer: Callable  # () -> tokenizer
    num_tensors: int | None = None  # for the progress bar (GGUF files; None: not counted)


def open_model_files(resolved: ResolvedModel) -> ModelFiles:
    """Cheap checks first (config, architecture name, weight files present), heavy reads later."""
    if resolved.kind == "gguf":
        reader = gguf_file.open_gguf(resolved.path)
        cfg = gguf_file.hf_config_from_gguf(reader, resolved.path)
        files = ModelFiles(resolved, cfg, lambda skip=(): gguf_file.iter_gguf_weights(reader, cfg, skip),
                           lambda: gguf_file.iter_gguf_raw(reader, cfg), lambda: load_tokenizer(resolved, reader),
                           num_tensors=len(reader.tensors))
    else:
        cfg = hf_folder.read_config(resolved.path)
        files = ModelFiles(resolved, cfg, lambda skip=(): hf_folder.iter_weights(resolved.path), lambda: iter(()),
                           lambda: load_tokenizer(resolved))
    check_architecture_name(cfg)  # refuse unsupported models before reading any field they may lack
    if resolved.kind == "hf":
        hf_folder.weight_files(resolved.path)
    return files


def read_arch(files: ModelFiles) -> ArchConfig:
    try:
        return ArchConfig.from_hf_config(files.hf_config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{files.resolved.path}: config is missing or has a bad field: {exc}") from exc


def load_weights(files: ModelFiles, arch: ArchConfig, dtype: torch.dtype, quantization: str | None,
                 device: torch.device, max_positions: int, sharder=None,
                 packed_cache: PackedCache | None = None) -> torch.nn.Module:
    """The model with its weights read: packed layers first (quantization "gguf": no float copy of them
    is ever read; from packed_cache where an earlier load wrote them), then every float tensor, then
    in-place quantization ("int8", "int4"). With a sharder (tensor parallelism), arch is this rank's share
    and every tensor is cut to it as it is read."""
    cls = model_class_for(arch)
    with default_dtype(dtype), torch.device(device):
        model = cls(arch, max_positions=max_positions)
    model.weight_sharder = sharder
    path = files.resolved.path
    progress = LoadProgress(path.name, files.num_tensors, model_bytes(path))
    try:
        with torch.no_grad():
            packed = ()
            if quantization == "gguf":
                raws = progress.track(files.raw_weights())
                if sharder is not None:
                    raws = (cut for cut in map(sharder.narrow_raw, raws) if cut is not None)
                packed = quantized_loading.pack_gguf(model, raws, dtype, packed_cache)
            # (Integer tensors keep their type: gpt-oss's MXFP4 blocks and scales, which the model decodes.)
            model.load_weights((name, t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device))
                               for name, t in progress.track(files.weights(packed)))
            quantized_loading.quantize_linears(model, quantization)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{files.resolved.path}: {exc}") from exc
    finally:
        progress.close()
    return model.eval()


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
