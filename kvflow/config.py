"""Engine configuration: one EngineConfig made of small dataclasses, passed down everywhere."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvflow.rope_scaling import parse_rope_scaling


@dataclass
class ModelConfig:
    """What to load and how to run it."""

    model: str | None = None  # name, path, alias or hub id; None means the default model
    # fast | exact | auto (auto: exact where dtype is float32 on CPU, else fast); see executors/plan.py.
    mode: str = "auto"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None  # None: the model's own context length
    # Rotary scaling in place of the model's own (models/rope_override.py): {"rope_type": "yarn" | "linear",
    # "factor": ..., ...}, as vLLM's --rope-scaling; None: the model's own.
    rope_scaling: dict | None = None
    # None: automatic (a GGUF file's Q4_x/Q5_x/Q8_0/K-quant/IQ4 weights stay packed in the default fast mode on CPU);
    # "none": float weights; "gguf": packed GGUF weights; "int8" | "int4": quantize a float checkpoint.
    quantization: str | None = None
    threads: int | None = None  # CPU threads; None: the physical cores
    # auto | on | off: torch.compile the model (auto: on CPU in the default fast mode). The environment
    # variable KVFLOW_COMPILE sets the default (the test suite runs eager unless a test asks).
    compile: str = field(default_factory=lambda: os.environ.get("KVFLOW_COMPILE", "auto"))
    seed: int = 0
    # Ranks the model is split across by attention heads and MLP columns (kvflow/distributed); 1: one process.
    tensor_parallel_size: int = 1
    # Where a GGUF model's packed weights are kept for later loads (loader/packed_cache.py): "auto" (kvflow's
    # cache folder), "off", or a folder. The environment variable KVFLOW_PACKED_CACHE sets the default.
    packed_cache: str = field(default_factory=lambda: os.environ.get("KVFLOW_PACKED_CACHE", "auto"))


@dataclass
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: a share of free memory
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | float32 | bfloat16 | float16 | int8 (CPU; kv_int8.py)
    enable_prefix_caching: bool = True
    # The prefix cache's disk tier (engine/prefix_store.py): full blocks saved under this folder, found again
    # after an eviction or a restart; bounded by prefix_cache_disk bytes (None: 16 GiB or half the free space).
    prefix_cache_dir: str | None = None
    prefix_cache_disk: int | None = None
    num_blocks: int | None = None  # set once the cache is sized (tests may force it)


@dataclass
class SchedulerConfig:
    """One token budget per step."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 8192  # filled from ModelConfig once the model is known
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no cap per request beyond the step budget
    # While sequences decode, prompts are prefilled so that their tokens come on average at most this many
    # times slower than with their decodes alone (step times predicted from the steps seen;
    # engine/step_budget.py). 0: the token budget alone bounds a step.
    max_decode_slowdown: float = 2.0
    # ... and no step with prompt rows beside decoders takes longer than this (or max_decode_slowdown times
    # their decode time, if more): the longest wait between two of their tokens.
    max_step_ms: float = 200.0
    # Which waiting request is admitted next: "fcfs" (arrival order) or "lpm" (longest prefix match: the one
    # with the most prompt tokens in the prefix cache, among the first LPM_WINDOW waiting, unless the head
    # has been passed over LPM_MAX_PASSES times or was preempted; engine/scheduler.py).
    scheduling_policy: str = "lpm"


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trace_file: str | None = None
    # vLLM's dict, its JSON, or a kvflow.spec.config.SpeculativeConfig; "auto": n-gram lookup that drafts only
    # where it pays, on CPU (spec/config.resolve); None or "off": none.
    speculative_config: object = "auto"


def engine_config(**options) -> EngineConfig:
    """Build an EngineConfig from flat, vLLM-named options (LLM(...) keyword arguments, CLI flags)."""
    config = EngineConfig()
    sections = (config.model, config.cache, config.scheduler)
    for name, value in options.items():
        if name in ("trace_file", "speculative_config"):
            setattr(config, name, value)
            continue
        owners = [s for s in sections if hasattr(s, name)]
        if not owners:
            raise TypeError(f"unknown engine option {name!r}")
        for owner in owners:
            setattr(owner, name, value)
    if config.scheduler.max_num_batched_tokens < 1 or config.scheduler.max_num_seqs < 1:
        raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
    slowdown = config.scheduler.max_decode_slowdown
    if not (slowdown == 0 or slowdown > 1):
        raise ValueError(f"max_decode_slowdown must be 0 (off) or more than 1, not {slowdown}")
    if config.scheduler.max_step_ms <= 0:
        raise ValueError(f"max_step_ms must be > 0, not {config.scheduler.max_step_ms}")
    if config.model.rope_scaling is not None:  # checked (and its short form read) before any load
        config.model.rope_scaling = parse_rope_scaling(config.model.rope_scaling)
    if config.cache.block_size < 1:
        raise ValueError("block_size must be >= 1")
    if config.scheduler.scheduling_policy not in ("fcfs", "lpm"):
        raise ValueError(f"scheduling_policy must be fcfs or lpm, got {config.scheduler.scheduling_policy!r}")
    return config
