"""kvflow's C++ paged attention on CPU, alone, at SmolLM2-135M's shapes (9 query heads, 3 KV heads, 64).

    python benchmarks/bench_cpu_attention.py [--threads 2] [--depth 4096] [--prompt 512] [--reps 15] [--record]

Two measures:
  decode  one new token over `depth` cached positions in each of 30 layers' caches (float16, blocks
          scattered at random), as a decode step at depth reads them: milliseconds per step and the
          bytes of K/V read per second, against the machine's memory bandwidth.
  prefill a fresh `prompt`-token sequence, every row attending (the many-row path's all_rows call), per
          layer, against PyTorch's float32 flash attention on the same rows (what the PyTorch layers
          use), timed round-robin in one loop so a drifting host shifts both together.
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_quant_linear import time_round_robin
from prefill_vs_transformers import median_seconds
from results_file import publish

from kvflow.kernels import cpu_attention
from kvflow.layers.attention.metadata import AttentionMetadata
from kvflow.layers.attention.sdpa import _sdpa

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5


def metadata(query_lens: list[int], seq_lens: list[int], slots: torch.Tensor, tables: torch.Tensor):
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(query_start_loc=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, slot_mapping=slots,
                             block_tables=tables)


def decode_step_ms(depth: int, reps: int) -> float:
    blocks = depth // BLOCK + 2
    caches = [(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).half(), torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).half())
              for _ in range(LAYERS)]
    table = torch.randperm(blocks).to(torch.int32)[None]
    slot = torch.tensor([int(table[0, depth // BLOCK]) * BLOCK + depth % BLOCK])
    meta = metadata([1], [depth + 1], slot, table)
    q, k, v = torch.randn(1, HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM)
    out = torch.empty(1, HEADS, HEAD_DIM)

    def step() -> None:
        for k_cache, v_cache in caches:
            cpu_attention.store_and_attend(q, k, v, k_cache, v_cache, meta, SCALE, out)

    return median_seconds(step, reps) * 1e3


def prefill_layer_ms(prompt: int, reps: int) -> tuple[float, float]:
    blocks = prompt // BLOCK + 1
    k_cache = torch.zeros(blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    q, k, v = torch.randn(prompt, HEADS, HEAD_DIM), torch.randn(prompt, KV_HEADS, HEAD_DIM), torch.randn(prompt, KV_HEADS, HEAD_DIM)
    meta = metadata([prompt], [prompt], torch.arange(prompt), torch.arange(blocks, dtype=torch.int32)[None])
    out = torch.empty(prompt, HEADS, HEAD_DIM)

    def ours() -> None:
        cpu_attention.store_and_attend(q, k, v, k_cache, v_cache, meta, SCALE, out, all_rows=True)

    def flash() -> None:  # on the rows as the float16 cache rounds them, as the PyTorch layers attend
        _sdpa(q, k.half().float(), v.half().float(), SCALE, causal=True)

    micros = time_round_robin({"ours": ours, "flash": flash}, reps)
    return micros["ours"] / 1e3, micros["flash"] / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_attention.available():
        raise SystemExit("the C++ kernels are not available here (no compiler?)")
    torch.manual_seed(0)
    with torch.inference_mode():
        step_ms = decode_step_ms(args.depth, args.reps)
        ours_ms, flash_ms = prefill_layer_ms(args.prompt, args.reps)
    kv_bytes = LAYERS * (args.depth + 1) * KV_HEADS * HEAD_DIM * 2 * 2
    lines = [
        f"### CPU attention kernel ({time.strftime('%Y-%m-%d %H:%M')}, {args.threads} threads)",
        "",
        f"`python benchmarks/bench_cpu_attention.py --threads {args.threads} --depth {args.depth} "
        f"--prompt {args.prompt}`: SmolLM2-135M's heads, float16 cache, medians of {args.reps}.",
        "",
        "| measure | kvflow kernel | PyTorch flash (float32) | ratio |",
        "|---|---|---|---|",
        f"| decode step at depth {args.depth}, 30 layers | {step_ms:.2f} ms ({kv_bytes / step_ms / 1e6:.1f} GB/s of K/V) | - | - |",
        f"| prefill of {args.prompt} tokens, one layer | {ours_ms:.2f} ms | {flash_ms:.2f} ms | {ours_ms / flash_ms:.2f} |",
        "",
    ]
    publish("\n".join(lines), args.record)


if __name__ == "__main__":
    main()
