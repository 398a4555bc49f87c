"""kvflow's C++ paged attention on CPU, alone, at SmolLM2-135M's shapes (9 query heads, 3 KV heads, 64).

    python benchmarks/bench_cpu_attention.py [--threads 2] [--depth 4096] [--prompt 512] [--reps 15] [--record]

Two measures:
  decode  one new token over `depth` cached positions in each of 30 layers' caches (float16, blocks
          scattered at random), as a decode step at depth reads them: milliseconds per step and the
          bytes of K/V read per second, against the machine's memory bandwidth.
  prefill a fresh `prompt`-token sequence, one layer: the exact mode's C++ kernel on every row, the
          fast mode's many-row attention (bfloat16 on AMX tiles, K/V stored first) and PyTorch's
          float32 flash attention on the same rows (what the PyTorch layers use), timed round-robin in
          one loop so a drifting host shifts all of them together.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch
from bench_quant_linear import time_round_robin
from results_file import publish

from kvflow.kernels import cpu_attention, many_rows_attention
from kvflow.layers.attention.metadata import AttentionMetadata
from kvflow.layers.attention.sdpa import _sdpa

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
PREFILL_LABELS = {"exact": "exact mode, C++ kernel on every row", "fast": "fast mode, bfloat16 on AMX tiles (many-row path)",
                  "flash": "PyTorch flash, float32"}
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

    return time_round_robin({"step": step}, reps)["step"] * 1e-3


def prefill_layer_ms(prompt: int, reps: int) -> dict[str, float]:
    """One layer's attention for a fresh prompt: the exact mode's C++ kernel on every row, the fast mode's
    many-row attention (bfloat16 flash) and PyTorch's float32 flash kernel, milliseconds each."""
    blocks = prompt // BLOCK + 1
    k_cache = torch.zeros(blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(prompt, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=1)
    q, k, v = q.view(prompt, HEADS, HEAD_DIM), k.view(prompt, KV_HEADS, HEAD_DIM), v.view(prompt, KV_HEADS, HEAD_DIM)
    meta = metadata([prompt], [prompt], torch.arange(prompt), torch.arange(blocks, dtype=torch.int32)[None])
    out = torch.empty(prompt, HEADS, HEAD_DIM)
    out_bf16 = torch.empty(prompt, HEADS * HEAD_DIM, dtype=torch.bfloat16)
    layer = SimpleNamespace(k_cache=k_cache, v_cache=v_cache, scale=SCALE)

    def exact() -> None:
        cpu_attention.store_and_attend(q, k, v, k_cache, v_cache, meta, SCALE, out, all_rows=True)

    def fast() -> None:
        many_rows_attention.store_and_attend(qkv, HEADS, KV_HEADS, layer, meta, out, out_bf16)

    def flash() -> None:  # on the rows as the float16 cache rounds them, as the PyTorch layers attend
        _sdpa(q, k.half().float(), v.half().float(), SCALE, causal=True)

    micros = time_round_robin({"exact": exact, "fast": fast, "flash": flash}, reps)
    return {name: t / 1e3 for name, t in micros.items()}


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
        prefill = prefill_layer_ms(args.prompt, args.reps)
    kv_bytes = LAYERS * (args.depth + 1) * KV_HEADS * HEAD_DIM * 2 * 2
    lines = [
        f"### CPU attention kernel ({time.strftime('%Y-%m-%d %H:%M')}, {args.threads} threads)",
        "",
        f"`python benchmarks/bench_cpu_attention.py --threads {args.threads} --depth {args.depth} "
        f"--prompt {args.prompt}`: SmolLM2-135M's heads, float16 cache, medians of {args.reps}.",
        "",
        "| measure | time | / PyTorch flash (float32) |",
        "|---|---|---|",
        f"| decode step at depth {args.depth}, 30 layers | {step_ms:.2f} ms ({kv_bytes / step_ms / 1e6:.1f} GB/s of K/V) | - |",
        *[f"| prefill of {args.prompt} tokens, one layer: {label} | {prefill[name]:.2f} ms | "
          f"{prefill[name] / prefill['flash']:.2f} |" for name, label in PREFILL_LABELS.items()],
        "",
    ]
    publish("\n".join(lines), args.record)


if __name__ == "__main__":
    main()
