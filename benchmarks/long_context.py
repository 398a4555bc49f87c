"""Prefill and decode at depth on a 32K-context model shape, kvflow (16- and 8-bit KV cache) against llama.cpp.

    python benchmarks/long_context.py [--depths 0,4096,16384] [--type Q8_0] [--threads 2] [--dir DIR] [--record]

The shape is Qwen2.5-0.5B's (24 layers, hidden 896, 14 query and 2 KV heads of 64, a 151,936-token vocabulary,
context 32,768), with random weights written as a GGUF by model_shapes.write_f16 and quantized by llama.cpp's
own quantizer (the peer's virtualenv). At each depth d, each engine (a fresh process each) holds d tokens of
context, then prefills 512 new tokens on top (pp512 at depth d, llama-bench's -d) and decodes 64 more
(tg64 at depth d + 512). llama.cpp through llama-cpp-python (F16 cache); kvflow with `kv_cache_dtype`
float16 and int8, its context served from the prefix cache. Goals (issue 21): pp512 at depth 16K and 32K
>= 1.5x llama.cpp; decode at depth 16K with the 8-bit cache >= 1.6x the 16-bit cache's.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from model_shapes import QUANTIZE, Shape, last_json, python_of_peer, write_f16
from results_file import publish, table_section
from side_by_side import ensure_llamacpp

from kvflow.kernels.cpu_features import cpu_name, isa_tier

SHAPE = Shape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936, tied=True,
              rope_base=1000000.0)
CONTEXT = 32768
NEW, GEN = 512, 64

PEER = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, depth, new, gen = sys.argv[1], *map(int, sys.argv[2:6])
llm = Llama(model_path=path, n_ctx=depth + new + gen + 64, n_threads=threads, n_threads_batch=threads,
            n_batch=512, verbose=False)
tokens = [100 + (i * 7919) % 20000 for i in range(depth + new)]
llm.eval(tokens[:8]); llm.reset()  # warm-up
if depth:
    llm.eval(tokens[:depth])
t = time.perf_counter(); llm.eval(tokens[depth:]); pp = new / (time.perf_counter() - t)
t = time.perf_counter()
for i in range(gen):
    llm.eval([200 + i])
print(json.dumps({"pp": pp, "tg": gen / (time.perf_counter() - t)}))
"""

OURS = r"""
import json, sys
from kvflow import LLM, SamplingParams
path, threads, depth, new, gen, kv = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6]
llm = LLM(path, threads=threads, max_model_len=depth + new + gen + 64, max_num_seqs=1, kv_cache_dtype=kv,
          max_num_batched_tokens=512, speculative_config="off")  # as llama.cpp: no drafts
llm.engine.warm_up()
tokens = [100 + (i * 7919) % 20000 for i in range(depth + new)]
if depth:
    llm.generate({"prompt_token_ids": tokens[:depth]}, SamplingParams(max_tokens=1, temperature=0))
out = llm.generate({"prompt_token_ids": tokens}, SamplingParams(max_tokens=gen + 1, temperature=0, ignore_eos=True))[0]
m = out.metrics
assert m.num_cached_tokens >= depth - 16, m.num_cached_tokens
times = m.token_times
print(json.dumps({"pp": (len(tokens) - m.num_cached_tokens) / m.prefill_time, "tg": gen / (times[-1] - times[0])}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="0,4096,16384")
    ap.add_argument("--type", default="Q8_0", help="llama.cpp file type (Q8_0, Q4_0, Q4_K_M...)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write the GGUF files (default: a temporary folder)")
    ap.add_argument("--record", action="store_true", help="add the table to benchmarks/history/<today>.md (listed in RESULTS.md)")
    args = ap.parse_args()
    ensure_llamacpp()
    folder = Path(args.dir or tempfile.mkdtemp(prefix="kvflow-long-"))
    path = folder / f"qwen2.5-0.5b-shape-{args.type}.gguf"
    if not path.exists():
        f16 = folder / "qwen2.5-0.5b-shape-F16.gguf"
        write_f16(SHAPE, f16, context=CONTEXT)
        subprocess.run([python_of_peer(), "-c", QUANTIZE, str(f16), str(path), args.type, str(args.threads)], check=True)
        f16.unlink()
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        common = [str(path), str(args.threads), str(depth), str(NEW), str(GEN)]
        peer = last_json([python_of_peer(), "-c", PEER, *common])
        f16 = last_json([sys.executable, "-c", OURS, *common, "float16"])
        int8 = last_json([sys.executable, "-c", OURS, *common, "int8"])
        rows.append(f"| {depth} | {peer['pp']:.1f} | {f16['pp']:.1f} | {f16['pp'] / peer['pp']:.2f} | {int8['pp']:.1f} | "
                    f"{peer['tg']:.1f} | {f16['tg']:.1f} | {int8['tg']:.1f} | {f16['tg'] / peer['tg']:.2f} | "
                    f"{int8['tg'] / f16['tg']:.2f} |")
        print(rows[-1], flush=True)
    intro = (f"`python benchmarks/long_context.py --depths {args.depths} --type {args.type}`, "
             f"{time.strftime('%Y-%m-%d %H:%M')}, CPU: {cpu_name()} ({platform.machine()}, tier {isa_tier()}), "
             f"{args.threads} threads. Qwen2.5-0.5B's shape (random weights, {args.type}, context {CONTEXT}); pp{NEW} at "
             f"depth d and tg{GEN} at depth d + {NEW}, each engine in its own process, one run each.")
    publish(table_section("Long context: prefill and decode at depth", intro,
                          ["depth", "pp512 llama.cpp", "pp512 kvflow f16", "ratio", "pp512 kvflow int8",
                           "tg llama.cpp", "tg kvflow f16", "tg kvflow int8", "f16 / llama.cpp", "int8 / f16"], rows),
            args.record)


if __name__ == "__main__":
    main()
