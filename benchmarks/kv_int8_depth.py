"""Decode at depth with the 8-bit KV cache against the 16-bit one, side by side on one loaded model.

The default model as `kvflow serve` runs it (dtype auto; its context is 8,192 tokens). At each depth a
random prompt of that many tokens is prefilled once per cache (one engine each), then batch-1 decode of
64 tokens on top of it is timed with the prompt served from the prefix cache, alternating the two caches
(ABBA), medians taken. Also the prefill of the depth itself, once per cache. Goal (issue 21): at depth 16K
the 8-bit cache's decode >= 1.6x the 16-bit cache's (this model stops at 8K: the deepest figure here is
the nearest).

    python benchmarks/kv_int8_depth.py [--depths 2048,4096,7936] [--repeats 4] [--threads 2] [--record]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

from results_file import publish, table_section

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.executors.model_setup import load_model
from kvflow.kernels.cpu_features import cpu_name, isa_tier

TOKENS = 64
DTYPES = ("float16", "int8")


def decode_rate(llm: LLM, prompt: list[int]) -> tuple[float, float]:
    """Batch-1 decode tok/s over TOKENS tokens after the prompt, and the prompt's prefill tok/s (computed part)."""
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=TOKENS + 1,
                                                                     ignore_eos=True))[0]
    m = out.metrics
    times = m.token_times
    computed = len(prompt) - m.num_cached_tokens
    return TOKENS / (times[-1] - times[0]), computed / m.prefill_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", default="2048,4096,7936")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--record", action="store_true", help="add the table to benchmarks/history/<today>.md (listed in RESULTS.md)")
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    loaded = load_model(ModelConfig(device="cpu", threads=args.threads, max_model_len=8192))
    rng = random.Random(0)
    vocab = loaded.arch.vocab_size
    rows = []
    for depth in depths:
        prompt = [rng.randrange(3, vocab) for _ in range(depth)]
        engines = {dt: LLM(loaded_model=loaded, kv_cache_dtype=dt, kv_cache_memory=(depth + 256) * 24 * 1024 * 2,
                           speculative_config="off")  # the caches' decode, not the drafts'
                   for dt in DTYPES}
        prefill = {dt: decode_rate(engines[dt], prompt)[1] for dt in DTYPES}  # fills the prefix cache
        rates: dict[str, list[float]] = {dt: [] for dt in DTYPES}
        for r in range(args.repeats):
            for dt in DTYPES if r % 2 == 0 else DTYPES[::-1]:
                rates[dt].append(decode_rate(engines[dt], prompt)[0])
        med = {dt: statistics.median(v) for dt, v in rates.items()}
        rows.append(f"| {depth} | {med['float16']:.1f} | {med['int8']:.1f} | {med['int8'] / med['float16']:.2f} | "
                    f"{prefill['float16']:.0f} | {prefill['int8']:.0f} |")
        print(rows[-1], {dt: [round(x, 1) for x in v] for dt, v in rates.items()}, flush=True)
        del engines
    intro = (f"`python benchmarks/kv_int8_depth.py --depths {args.depths} --repeats {args.repeats}`, "
             f"{time.strftime('%Y-%m-%d %H:%M')}, CPU: {cpu_name()} ({platform.machine()}, tier {isa_tier()}), "
             f"{args.threads} threads, default model, dtype auto. Batch-1 decode of {TOKENS} tokens after a cached "
             "random prompt of `depth` tokens (median, caches alternated), and that prompt's prefill once per cache.")
    publish(table_section("8-bit KV cache: decode at depth", intro,
                          ["depth", "tg float16 tok/s", "tg int8 tok/s", "int8 / float16", "prefill float16 tok/s",
                           "prefill int8 tok/s"], rows), args.record)


if __name__ == "__main__":
    main()
