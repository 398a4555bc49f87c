"""``kvflow bench latency``: llama-bench's pp/tg figures measured through the engine, each against its roofline.

- ppN at depth d: prefill N new tokens after d tokens already sit in the KV cache (held there by the
  prefix cache), timed from the step that starts the chunk to the first token.
- tgN at depth d and batch b: b sequences, each with d tokens of context, decode N tokens together;
  tokens/s = b * (N - 1) / (time from the first to the last decode step).

Rooflines: prefill cannot beat (matmul rate / FLOPs per token); decode cannot beat
(bandwidth / bytes read per step) * batch, where a step reads every weight once plus each sequence's KV.
The bandwidth of a decode test is the probe's read rate taken again right before and right after each of
its runs (their mean, the median over runs): on a shared host the rate moves from one minute to the next
(on the Zen 4 EPYC of sessions 27 and 28, between about 32 and 58 GB/s), and a rate read once at the start
put the same decode speed anywhere between half its ceiling and above it.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvflow.config import engine_config
from kvflow.executors.model_figures import prefill_matmul_kind, weight_bytes_read_per_step
from kvflow.executors.model_setup import load_model
from kvflow.kernels import cpu_features, packed_matmul
from kvflow.llm import LLM
from kvflow.machine.probe import (
    bandwidth_bytes_per_s,
    load_probe,
    matmul_flop_per_s,
    read_rate,
    run_probe,
    save_probe,
)
from kvflow.machine.roofline import ModelShape
from kvflow.sampling_params import SamplingParams


def _random_prompt(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(10, vocab - 10, (n,), generator=gen).tolist()


def measure_prefill(llm: LLM, n_prompt: int, depth: int, gen: torch.Generator) -> float:
    """Seconds to prefill n_prompt new tokens on top of depth cached ones."""
    engine = llm.engine
    vocab = engine.loaded.arch.vocab_size
    context = _random_prompt(depth, vocab, gen)
    if depth:
        llm.generate({"prompt_token_ids": context}, SamplingParams(max_tokens=1, temperature=0))
    out = llm.generate({"prompt_token_ids": context + _random_prompt(n_prompt, vocab, gen)},
                       SamplingParams(max_tokens=1, temperature=0))[0]
    assert out.metrics.num_cached_tokens >= depth - engine.scheduler.block_size, "depth was not cached"
    return out.metrics.prefill_time


def measure_decode(llm: LLM, n_gen: int, depth: int, batch: int, gen: torch.Generator) -> float:
    """Decode tokens/s for batch sequences decoding together, each with depth tokens (at least 1) of context.

    Counted over the window where every sequence is decoding: from the last first-token to the first end."""
    vocab = llm.engine.loaded.arch.vocab_size
    params = SamplingParams(max_tokens=n_gen, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": _random_prompt(max(depth, 1), vocab, gen)} for _ in range(batch)]
    outs = llm.generate(prompts, params)
    start = max(o.metrics.token_times[0] for o in outs)
    end = min(o.metrics.token_times[-1] for o in outs)
    tokens = sum(sum(1 for t in o.metrics.token_times if start < t <= end) for o in outs)
    if end <= start or tokens == 0:
        raise RuntimeError("decode window is empty: raise n_gen or the token budget")
    return tokens / (end - start)


ADJACENT_READ_BYTES = 256 << 20  # the array a decode run's read rate is taken on: far past any cache


def run_latency(
    model: str | None,
    prompts: list[int],
    n_gen: int,
    depths: list[int],
    batches: list[int],
    reps: int = 3,
    probe: dict | None = None,
    **engine_options: Any,
) -> dict:
    prompts = [n for n in prompts if n > 0]  # llama-bench's -p 0 / -n 0: skip that kind of test
    longest = max(max(prompts, default=1), 1) + max(depths) + n_gen + 32
    engine_options.setdefault("max_num_batched_tokens", max(max(prompts, default=0) + max(depths), 2048))
    # llama-bench's figures are plain decoding: drafts only where --speculative-config asks for them.
    engine_options.setdefault("speculative_config", "off")
    engine_options.setdefault("max_num_seqs", max(batches))
    engine_options["max_model_len"] = max(longest, engine_options.get("max_model_len") or 0)
    config = engine_config(model=model, **engine_options)
    loaded = load_model(config.model)
    shape = ModelShape.from_hf_config(loaded.arch.raw)
    if config.cache.kv_cache_memory is None:  # room for the largest batch at the deepest context, twice over
        elem = (loaded.kv_cache_dtype or loaded.dtype).itemsize
        engine_options["kv_cache_memory"] = int(2 * max(batches) * longest * shape.kv_bytes_per_token(elem))
    llm = LLM(loaded_model=loaded, **engine_options)
    weight_bytes = weight_bytes_read_per_step(loaded.model)
    kv_bytes = shape.kv_bytes_per_token(llm.engine.runner.kv_element_bytes)
    if probe is None:
        probe = load_probe()
    if probe is None:  # no saved probe yet: measure one (a few seconds) and keep it for next time
        probe = run_probe()
        save_probe(probe)
    threads = torch.get_num_threads()
    bandwidth = bandwidth_bytes_per_s(probe, threads=threads)
    prefill_dtype = prefill_matmul_kind(loaded)
    flops_rate = matmul_flop_per_s(probe, prefill_dtype, threads=threads)
    if flops_rate is None:  # an older probe, or one taken where this kind was not timed
        flops_rate = matmul_flop_per_s(probe, "f32", threads=threads)
    gen = torch.Generator().manual_seed(0)
    read_array = torch.ones(ADJACENT_READ_BYTES // 4, device=loaded.device) if n_gen > 0 else None
    results = []
    measure_prefill(llm, 32, 0, gen)  # warm-up: first-touch of weights and caches
    for depth in depths:
        for n in prompts:
            times = [measure_prefill(llm, n, depth, gen) for _ in range(reps)]
            tps = n / statistics.median(times)
            roof = flops_rate / (shape.prefill_flops(n, depth, all_logits=False) / n)
            results.append(_row(f"pp{n}", n, 0, depth, 1, tps, roof))
        for batch in batches if n_gen > 0 else []:
            rates, reads = [], []
            for _ in range(reps):
                before = read_rate(read_array, reps=3, warmup=1)
                rates.append(measure_decode(llm, n_gen, depth, batch, gen))
                reads.append((before + read_rate(read_array, reps=3, warmup=1)) / 2)
            tps, read = statistics.median(rates), statistics.median(reads)
            per_step = weight_bytes + kv_bytes * batch * (depth + n_gen / 2)
            results.append({**_row(f"tg{n_gen}", 0, n_gen, depth, batch, tps, read / per_step * batch),
                            "read_bytes_per_s": read})
    return {
        "kind": "latency",
        "model": loaded.resolved.name,
        "dtype": str(loaded.dtype).split(".")[-1],
        "mode": loaded.plan.mode,
        "cpu_tier": loaded.plan.cpu_tier if loaded.device.type == "cpu" else None,
        "cpu": cpu_features.cpu_name() if loaded.device.type == "cpu" else None,
        "packed_kernel": packed_matmul.path() if loaded.quantization else None,
        "prefill_matmuls": prefill_dtype,
        "threads": threads,
        "weight_bytes_per_step": weight_bytes,
        "kv_bytes_per_token": kv_bytes,
        "bandwidth_bytes_per_s": bandwidth,
        "matmul_flop_per_s": flops_rate,
        "probe": probe,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "speculative": _speculation(llm),
        "results": results,
    }


def _speculation(llm: LLM) -> dict | None:
    """With --speculative-config: what it verified and kept over the whole run (the tg tests' figures
    include it)."""
    spec = llm.engine.speculator
    if spec is None:
        return None
    drafted, kept = spec.num_draft_tokens, spec.num_accepted_tokens
    return {"method": spec.config.method, "draft_tokens": drafted, "accepted_tokens": kept,
            "acceptance_rate": kept / drafted if drafted else None}


def _row(test: str, n_prompt: int, n_gen: int, depth: int, batch: int, tps: float, roof: float) -> dict:
    return {
        "test": test, "n_prompt": n_prompt, "n_gen": n_gen, "depth": depth, "batch": batch,
        "tokens_per_s": tps, "roofline_tokens_per_s": roof, "fraction_of_roofline": tps / roof if roof else None,
    }


def markdown_table(report: dict) -> str:
    tier = f", CPU tier {report['cpu_tier']} ({report['cpu']})" if report.get("cpu_tier") else ""
    lines = [
        f"model {report['model']} ({report['dtype']}, {report.get('mode', '?')} mode), {report['threads']} threads"
        f"{tier}, {report['weight_bytes_per_step'] / 2**20:.0f} MiB of weights read per decode step, prefill "
        f"matmuls {report.get('prefill_matmuls', '?')}",
        "",
        "| test | depth | batch | tokens/s | roofline tokens/s | % of roofline | read GB/s around the runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        frac = r["fraction_of_roofline"]
        read = f"{r['read_bytes_per_s'] / 1e9:.1f}" if r.get("read_bytes_per_s") else "-"
        lines.append(
            f"| {r['test']} | {r['depth']} | {r['batch']} | {r['tokens_per_s']:,.1f} | "
            f"{r['roofline_tokens_per_s']:,.0f} | {100 * frac:.0f}% | {read} |"
        )
    spec = report.get("speculative")
    if spec:
        rate = "-" if spec["acceptance_rate"] is None else f"{100 * spec['acceptance_rate']:.0f}%"
        lines += ["", f"speculative decoding ({spec['method']}): {spec['accepted_tokens']} of {spec['draft_tokens']} "
                      f"draft tokens kept ({rate})"]
    return "\n".join(lines)


def save_report(report: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return path
