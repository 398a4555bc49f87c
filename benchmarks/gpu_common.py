"""What the GPU check's steps share (benchmarks/gpu_check.py): the shapes measured, the JSON sink, timing,
and kvflow's model and paged-cache inputs built by hand (random weights, zero-filled "depth" context)."""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing kvflow

from kvflow.layers.attention.metadata import AttentionMetadata  # noqa: E402
from kvflow.loader.model_loader import default_dtype  # noqa: E402

BLOCK_SIZE = 16
TG_TOKENS = 128

# Hugging Face config fields of the two benchmarked shapes.
MODELS = {
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
        rms_norm_eps=1e-5,
    ),
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
}
TINY_MODEL = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5,
)


# ---- shapes ----------------------------------------------------------------------------------------------
def hf_config(fields: dict, max_positions: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": max_positions,
            "bos_token_id": 1, "eos_token_id": 2, **fields}


def shapes(tiny: bool) -> dict:
    """What to measure: prompt lengths (batch 1), decode batches, depths, decode length."""
    if tiny:
        return {"pp": [16], "tg_batches": [1, 2], "depths": [0, 24], "tg": 4, "models": {"tiny": TINY_MODEL}}
    return {"pp": [512, 4096], "tg_batches": [1, 32, 256], "depths": [0, 8192], "tg": TG_TOKENS, "models": MODELS}


def plan(s: dict) -> list[tuple[str, int, int, int]]:
    """(test, batch, depth, new tokens), cheapest first so a time-out cuts the costly tail."""
    rows = [(f"pp{n}", 1, d, n) for d in s["depths"] for n in s["pp"]]
    rows += [(f"tg{s['tg']}", b, d, s["tg"]) for d in s["depths"] for b in s["tg_batches"]]
    return rows


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes


# ---- output ----------------------------------------------------------------------------------------------
class Sink:
    """Appends one JSON row per line to OUT/<name>.jsonl and echoes it."""

    def __init__(self, out: Path, name: str) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"{name}.jsonl"
        self.path.write_text("")

    def __call__(self, **row) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    fn: Callable[[], object], device: torch.device, reps: int, warm: Callable[[], object] | None = None
) -> float:
    """Median seconds of fn() after one warm-up call (of `warm`, a shorter run, when given)."""
    (warm or fn)()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def share_of_time(deadline: float, models_left: int) -> float:
    """This model's deadline: an equal share of what is left, so the last model is not starved."""
    now = time.monotonic()
    return now + max(0.0, deadline - now) / models_left




# ---- kvflow ----------------------------------------------------------------------------------------------
def random_kvflow_model(cfg: dict, dtype: torch.dtype, device: torch.device):
    """kvflow's Llama with random weights (matrices ~ N(0, 0.02), norms 1), built on the device."""
    from kvflow.models.arch import ArchConfig
    from kvflow.models.llama import LlamaForCausalLM

    arch = ArchConfig.from_hf_config(cfg)
    with default_dtype(dtype), torch.device(device):
        model = LlamaForCausalLM(arch, max_positions=cfg["max_position_embeddings"])
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    return model.eval(), arch


def bind_cache(model, arch, backend, num_blocks: int, dtype: torch.dtype, device: torch.device) -> None:
    from kvflow.engine.kv_cache_alloc import allocate_kv_cache

    caches = allocate_kv_cache(arch, num_blocks, BLOCK_SIZE, dtype, device)  # zeros: the "depth" context
    for layer, (k_cache, v_cache) in zip(model.attention_layers, caches):
        layer.k_cache, layer.v_cache, layer.backend = k_cache, v_cache, backend


def contiguous_tables(batch: int, context: int, device: torch.device) -> torch.Tensor:
    """Sequence i owns blocks [i * w, (i + 1) * w): enough for `context` tokens each."""
    width = math.ceil(context / BLOCK_SIZE)
    return torch.arange(batch * width, dtype=torch.int32, device=device).view(batch, width)


def prefill_meta(n: int, depth: int, tables: torch.Tensor, device: torch.device) -> AttentionMetadata:
    pos = torch.arange(depth, depth + n, device=device)
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([depth + n], dtype=torch.int32, device=device),
        query_lens_cpu=[n], seq_lens_cpu=[depth + n],
        slot_mapping=tables[0, 0].long() * BLOCK_SIZE + pos,
        block_tables=tables[:1],
    )


def decode_meta(pos: torch.Tensor, host_len: int, tables: torch.Tensor) -> AttentionMetadata:
    """One decode step for every row; blocks are contiguous so a slot is the row's first slot + position."""
    batch = pos.shape[0]
    return AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=pos.device),
        seq_lens=(pos + 1).int(),
        query_lens_cpu=[1] * batch, seq_lens_cpu=[host_len] * batch,
        slot_mapping=tables[:, 0].long() * BLOCK_SIZE + pos,
        block_tables=tables,
    )


def decode_loop(model, forward, tables: torch.Tensor, depth: int, steps: int, first: torch.Tensor) -> list:
    """Greedy decode `steps` tokens for every row from position `depth`, on the device: no host sync."""
    ids = first
    pos = torch.full_like(first, depth)
    out = []
    for i in range(steps):
        hidden = forward(ids, pos, decode_meta(pos, depth + i + 1, tables))
        ids = model.compute_logits(hidden).argmax(-1)
        out.append(ids)
        pos = pos + 1
    return out


def kv_plan(rows, cfg: dict, device: torch.device) -> tuple[dict, int]:
    """Which (batch, depth, n) fit in the free memory, and the blocks the largest of them needs."""
    per_block = kv_bytes_per_token(cfg) * BLOCK_SIZE
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * 0.85 - (6 << 30)  # leave room for activations, logits and graph pools
    else:
        budget = 1 << 30
    fits, need = {}, 1
    for _, batch, depth, n in rows:
        blocks = batch * math.ceil((depth + n) / BLOCK_SIZE)
        fits[(batch, depth, n)] = blocks * per_block <= budget
        if fits[(batch, depth, n)]:
            need = max(need, blocks)
    return fits, need


def models_within_budget(s: dict, deadline: float, emit: Sink, engine: str):
    """(name, HF config, this model's deadline) for each model to measure; the rest are reported skipped."""
    max_ctx = max(s["depths"]) + max(s["pp"] + [s["tg"]])
    for i, (name, fields) in enumerate(s["models"].items()):
        if time.monotonic() > deadline:
            emit(engine=engine, model=name, skipped="time budget spent")
            continue
        yield name, hf_config(fields, max_ctx), share_of_time(deadline, len(s["models"]) - i)


def rows_within_budget(rows, fits: dict, deadline: float, emit: Sink, engine: str, model: str):
    """(row key, test, batch, depth, new tokens) for each planned row that fits and has time left."""
    for test, batch, depth, n in rows:
        key = dict(engine=engine, model=model, test=test, batch=batch, depth=depth)
        if not fits[(batch, depth, n)]:
            emit(**key, skipped="KV cache does not fit in memory")
        elif time.monotonic() > deadline:
            emit(**key, skipped="time budget spent")
        else:
            yield key, test, batch, depth, n


def bench_setup(out: Path, budget: float, tiny: bool, name: str):
    """(device, dtype, deadline, sink, shapes) for a benchmark step: bf16 on CUDA, float32 on a CPU smoke run."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtype, time.monotonic() + budget, Sink(out, name), shapes(tiny)
