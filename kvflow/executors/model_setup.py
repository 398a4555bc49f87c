"""From a ModelConfig to a model ready to run, and from a loaded model to the executor of one engine.

    load_model:     plan (executors/plan.py) -> read weights as planned (loader/) -> prepare_model
    prepare_model:  once per loaded model, what the plan's executor needs: huge pages for packed weights,
                    bfloat16 copies, the native decoder's structs, a compiled forward
    build_executor: per engine (each owns a KV cache): the executor the plan names
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvflow.config import ModelConfig
from kvflow.distributed.group import TensorParallelGroup
from kvflow.distributed.sharding import WeightSharder, install_reductions, shard_arch
from kvflow.executors import compile as compiling
from kvflow.executors.model_figures import prefill_matmul_kind, weight_bytes_read_per_step
from kvflow.executors.native_model import NativeModel, reason_unsupported
from kvflow.executors.plan import ExecutionPlan, plan_execution
from kvflow.executors.thresholds import ROW_THRESHOLDS
from kvflow.kernels import abi, packed_matmul, packed_weight
from kvflow.layers.linear import Linear
from kvflow.layers.quant.base import QuantLinear
from kvflow.layers.quant.packed_linear import PackedLinear
from kvflow.loader.model_loader import load_weights, open_model_files, read_arch, return_freed_memory
from kvflow.loader.packed_cache import PackedCache, cache_key, default_folder
from kvflow.loader.resolve import ResolvedModel, resolve_model
from kvflow.models.arch import ArchConfig
from kvflow.models.registry import model_class_for
from kvflow.models.rope_override import apply_rope_scaling

log = logging.getLogger("kvflow")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any
    arch: ArchConfig
    resolved: ResolvedModel
    plan: ExecutionPlan
    max_model_len: int
    native: NativeModel | None = None  # the native decoder's structs, where the fast CPU mode runs it
    compiled: Callable | None = None  # a torch.compile'd hidden_states, where the plan compiles
    # This rank's group where the model is split across ranks (arch is then this rank's share of the heads).
    tensor_parallel: TensorParallelGroup | None = None
    packed_cache: PackedCache | None = None  # where its packed weights came from or go (loader/packed_cache.py)

    @property
    def device(self) -> torch.device:
        return self.plan.device

    @property
    def dtype(self) -> torch.dtype:
        return self.plan.dtype

    @property
    def quantization(self) -> str | None:
        return self.plan.quantization

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.plan.kv_cache_dtype

    @property
    def batch_invariant(self) -> bool:
        return self.plan.batch_invariant

    def summary(self) -> ModelSummary:
        """What a process without the weights (the server's front end) needs to know of this model."""
        return ModelSummary(self.resolved, self.arch, self.plan, self.max_model_len,
                            num_parameters=sum(p.numel() for p in self.model.parameters()),
                            weight_bytes_per_step=weight_bytes_read_per_step(self.model),
                            prefill_matmuls=prefill_matmul_kind(self))


@dataclass(frozen=True)
class ModelSummary:
    """A loaded model's description without its weights: picklable, for the engine core's front end."""

    resolved: ResolvedModel
    arch: ArchConfig
    plan: ExecutionPlan
    max_model_len: int
    num_parameters: int
    weight_bytes_per_step: int  # bytes a batch-1 decode step reads (model_figures.weight_bytes_read_per_step)
    prefill_matmuls: str  # what a prefill chunk's matmuls run on (model_figures.prefill_matmul_kind)

    @property
    def device(self) -> torch.device:
        return self.plan.device

    @property
    def dtype(self) -> torch.dtype:
        return self.plan.dtype


def load_model(config: ModelConfig, with_tokenizer: bool = True,
               tensor_parallel: TensorParallelGroup | None = None) -> LoadedModel:
    """with_tokenizer=False: the weights alone (a tensor-parallel rank other than 0 never sees text).
    tensor_parallel: the group whose rank's share this process loads (None: the whole model), passed by who
    made the group, never read from the process: an engine of another size in the same process is no concern."""
    resolved = resolve_model(config.model)
    files = open_model_files(resolved)
    arch = apply_rope_scaling(read_arch(files), config.rope_scaling, config.max_model_len)  # --rope-scaling
    model_class_for(arch)  # refuses what this architecture's class cannot run, before the heavy reads
    with ThreadPoolExecutor(1, thread_name_prefix="kvflow-tokenizer") as pool:
        # The tokenizer builds (mostly Python: transformers' import, a 128K vocabulary) while the weights
        # load (mostly C++, which lets go of the GIL): a second or more off an 8B model's load.
        tokenizer = pool.submit(files.tokenizer) if with_tokenizer else None
        loaded = _load(config, files, resolved, arch, tensor_parallel)
        prepare_model(loaded)
        loaded.tokenizer = None if tokenizer is None else tokenizer.result()
    return loaded


def _load(config: ModelConfig, files, resolved: ResolvedModel, arch: ArchConfig,
          tp: TensorParallelGroup | None) -> LoadedModel:
    plan = plan_execution(config, resolved.kind, arch.torch_dtype)
    max_len = config.max_model_len or arch.max_position_embeddings
    sharder = None
    if tp is not None:  # this rank's heads and MLP columns only (kvflow/distributed/sharding.py)
        sharder = WeightSharder(arch, tp.rank, tp.world_size)
        arch = shard_arch(arch, tp.rank, tp.world_size)
    cache = open_packed_cache(config.packed_cache, resolved, plan.quantization, tp)
    model = load_weights(files, arch, plan.dtype, plan.quantization, plan.device, max_len, sharder, cache)
    if tp is not None:
        install_reductions(model, tp)
    log.info("loaded %s (%s) on %s in %s, %s mode", resolved.name, arch.architecture, plan.device,
             str(plan.dtype).split(".")[-1], plan.mode)
    return LoadedModel(model, None, arch, resolved, plan, max_len, tensor_parallel=tp, packed_cache=cache)


def open_packed_cache(where: str, resolved: ResolvedModel, quantization: str | None,
                      tp: TensorParallelGroup | None) -> PackedCache | None:
    """The packed-weight cache for a GGUF load whose weights stay packed, or None ("off", or nothing packed)."""
    if where == "off" or resolved.kind != "gguf" or quantization != "gguf" or not packed_matmul.available():
        return None
    folder = default_folder() if where == "auto" else where
    shard = None if tp is None else (tp.rank, tp.world_size)
    try:
        return PackedCache(folder, cache_key(resolved.path, shard))
    except OSError as exc:
        log.warning("packed-weight cache %s unusable (%s): packing every load", folder, exc)
        return None


def prepare_model(loaded: LoadedModel) -> None:
    """Make the loaded model ready for its plan's executor (once, however many engines share it)."""
    plan, model = loaded.plan, loaded.model
    if plan.device.type == "cpu" and abi.native() is not None:
        abi.native().kvflow_set_tuning(tuning=ROW_THRESHOLDS.kernel_tuning())
    if plan.fast_cpu:
        packed = [m.packed for m in model.modules() if isinstance(m, PackedLinear)]
        packed_weight.move_to_huge_pages(packed)
        # The native decoder runs a whole step in one C++ call: no room for the ranks' sums between layers.
        native = loaded.tensor_parallel is None and reason_unsupported(model) is None
        # Its dense path has no experts: a mixture of experts runs natively on the packed kernel alone, so
        # copies there would cost memory (and round differently from the steps that run) for nothing.
        # A compiled forward traces the layers' many-row path: the tiles' C call is not in it, copies are.
        compiled = plan.compile != "off" and loaded.tensor_parallel is None and compiling.should_compile(
            plan.compile, native, experts=loaded.arch.num_experts > 0)
        if plan.bf16_copies and not (native and loaded.arch.num_experts > 0):
            added = make_bf16_copies(model, ROW_THRESHOLDS.layers_dense_min_rows, tiles=not compiled)
            log.info("bfloat16 copies of the weights for many-row matmuls (+%.0f MiB)", added / 2**20)
        loaded.native = NativeModel(model) if native else None
        if loaded.native is not None:
            log.info("steps run natively (one C++ call a step); many-row steps on bfloat16 copies: %s",
                     loaded.native.dense_t is not None)
    if plan.compile != "off" and loaded.tensor_parallel is None and compiling.should_compile(plan.compile, loaded.native is not None,
                                                             experts=loaded.arch.num_experts > 0):
        loaded.compiled = compiling.compile_hidden_states(model)
        compiling.warm_up(model, loaded.compiled, plan.device)
    return_freed_memory()


def make_bf16_copies(model: torch.nn.Module, min_rows: int, tiles: bool = True) -> int:
    """Give every float32 Linear and packed layer (the packed output head aside: it only sees sampled rows) a
    bfloat16 copy for matmuls of at least min_rows rows, unless it multiplies its packed weights on AMX
    bfloat16 tiles at that rate without one (the copy would cost 2 bytes a weight: 16 GB for an 8B model).
    Returns the bytes added. A token's result then
    depends on how many rows its step had, which is why only the fast mode does it."""
    added = 0
    for name, module in model.named_modules():
        # A MoE expert sees only the rows routed to it (a few of a prompt's), and copies of every expert
        # would cost gigabytes: experts stay on the packed kernel. The router routes from its float32 weights.
        if ".experts." in name or name.endswith(".mlp.gate"):
            continue
        if isinstance(module, Linear) and module.weight.dtype == torch.float32:
            module.weight_bf16 = module.weight.detach().to(torch.bfloat16)
            module.bf16_min_rows = min_rows
            added += module.weight_bf16.numel() * 2
        elif isinstance(module, QuantLinear) and not name.startswith(("lm_head", "embed_tokens")):
            module.max_kernel_rows = min_rows - 1
            module.dense_from_packed = tiles and multiplies_packed_on_tiles(module)
            if module.dense_from_packed:
                continue  # as fast from the packed weights (AMX bfloat16 tiles): no copy
            module.cache_dense_bf16()
            added += module.dense_bf16.numel() * 2
    return added


def multiplies_packed_on_tiles(module: QuantLinear) -> bool:
    """Whether the layer's many-row matmuls run from its packed weights on bfloat16 tiles (tried on one row)."""
    x = torch.zeros(1, module.in_features, dtype=torch.bfloat16)
    return module.dense_bf16_into(x, torch.empty(1, module.out_features, dtype=torch.bfloat16))


def build_executor(loaded: LoadedModel, kv_caches: list, attention_backend: str = "auto", max_num_seqs: int = 64,
                   max_blocks_per_seq: int = 1, cuda_graphs: bool = True):
    """The executor the plan names, over this engine's KV cache."""
    from kvflow.executors.cpu_fast import CpuFastExecutor
    from kvflow.executors.cuda import CudaExecutor
    from kvflow.executors.layers import LayersExecutor

    kind = loaded.plan.executor
    if loaded.tensor_parallel is not None:
        # Graph capture would run the ranks' all_reduce before the other ranks have built their caches.
        cuda_graphs = False
    if kind == "cuda":
        return CudaExecutor(loaded, kv_caches, attention_backend, max_num_seqs, max_blocks_per_seq, cuda_graphs)
    if kind == "cpu_fast" and attention_backend == "auto":
        return CpuFastExecutor(loaded, kv_caches, attention_backend)
    return LayersExecutor(loaded, kv_caches, attention_backend)


def set_threads(threads: int | None) -> None:
    torch.set_num_threads(max(1, threads if threads is not None else physical_cores()))


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
