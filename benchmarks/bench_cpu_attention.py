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

import torch
from bench_quant_linear import time_round_robin
from results_file import publish

from kvflow.kernels import paged_attention
from kvflow.layers.attention.sdpa import _sdpa

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
PREFILL_LABELS = {"exact": "C++ kernel on every row (exact mode; native decoder without AMX)",
                  "fast": "bfloat16 on AMX tiles (native decoder, many-row steps)", "flash": "PyTorch flash, float32"}
SCALE = HEAD_DIM**-0.5


def step(query_lens: list[int], seq_lens: list[int], slots: torch.Tensor, tables: torch.Tensor):
    """The kernel's step struct, with the tensors it points at (kept alive beside it)."""
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    keep = (slots, starts, lens, tables)
    return paged_attention.step_struct(slots, starts, lens, tables), keep


class DecodeSetup:
    """One sequence's `rows` new query rows at `depth` cached positions, in each of 30 layers' caches
    (float16, blocks in a random order, stored in `layout` as engine/kv_cache_alloc does: "head" or
    "token"), with the structs the kernel reads; `place` puts each cache tensor where it should live (as
    it is, or on huge pages). The values depend on `seed` only, not on the layout."""

    def __init__(self, depth: int, rows: int = 1, place=lambda t: t, layout: str = "head", seed: int = 0) -> None:
        torch.manual_seed(seed)
        blocks = (depth + rows) // BLOCK + 2

        def cache() -> torch.Tensor:
            values = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).half()
            return place(values.transpose(1, 2).contiguous()).transpose(1, 2) if layout == "head" else place(values)

        self.caches = [(cache(), cache()) for _ in range(LAYERS)]
        table = torch.randperm(blocks).to(torch.int32)[None]
        pos = torch.arange(depth, depth + rows)
        slots = table[0, pos // BLOCK].long() * BLOCK + pos % BLOCK
        self.meta, self._keep = step([rows], [depth + rows], slots, table)
        self.layers = [paged_attention.layer_struct(k, v, HEADS, SCALE) for k, v in self.caches]
        self.q = torch.randn(rows, HEADS, HEAD_DIM)
        self.k, self.v = torch.randn(rows, KV_HEADS, HEAD_DIM), torch.randn(rows, KV_HEADS, HEAD_DIM)


def decode_step_ms(depth: int, reps: int) -> float:
    setup = DecodeSetup(depth)
    out = torch.empty(1, HEADS, HEAD_DIM)

    def decode() -> None:
        for layer in setup.layers:
            paged_attention.store_and_attend(layer, setup.meta, setup.q, setup.k, setup.v, out)

    return time_round_robin({"step": decode}, reps)["step"] * 1e-3


def prefill_layer_ms(prompt: int, reps: int) -> dict[str, float]:
    """One layer's attention for a fresh prompt: the C++ kernel on every row, the AMX tiles (where they
    run) and PyTorch's float32 flash kernel, milliseconds each."""
    blocks = prompt // BLOCK + 1
    # Head-major blocks, as engine/kv_cache_alloc lays out a CPU cache.
    k_cache = torch.zeros(blocks, KV_HEADS, BLOCK, HEAD_DIM, dtype=torch.float16).transpose(1, 2)
    v_cache = torch.zeros(blocks, KV_HEADS, BLOCK, HEAD_DIM, dtype=torch.float16).transpose(1, 2)
    qkv = torch.randn(prompt, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=1)
    q, k, v = q.view(prompt, HEADS, HEAD_DIM), k.view(prompt, KV_HEADS, HEAD_DIM), v.view(prompt, KV_HEADS, HEAD_DIM)
    meta, _keep = step([prompt], [prompt], torch.arange(prompt), torch.arange(blocks, dtype=torch.int32)[None])
    out = torch.empty(prompt, HEADS, HEAD_DIM)
    out_bf16 = torch.empty(prompt, HEADS * HEAD_DIM, dtype=torch.bfloat16)
    layer = paged_attention.layer_struct(k_cache, v_cache, HEADS, SCALE)

    def exact() -> None:
        paged_attention.store_and_attend(layer, meta, q, k, v, out, all_rows=True)

    def fast() -> None:  # as the native decoder does it: K/V stored (and one-token rows attended), then tiles
        paged_attention.store_and_attend(layer, meta, q, k, v, out)
        paged_attention.prompt_attention_bf16(layer, meta, qkv, out_bf16)

    def flash() -> None:  # on the rows as the float16 cache rounds them, as the PyTorch layers attend
        _sdpa(q, k.half().float(), v.half().float(), SCALE, causal=True)

    runs = {"exact": exact, "flash": flash}
    if paged_attention.prompt_attention_bf16(layer, meta, qkv, out_bf16):  # the tiles run on this CPU
        runs["fast"] = fast
    micros = time_round_robin(runs, reps)
    return {name: t / 1e3 for name, t in micros.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--record", action="store_true", help="add the table to benchmarks/history/<today>.md (listed in RESULTS.md)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not paged_attention.available():
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
          f"{prefill[name] / prefill['flash']:.2f} |" for name, label in PREFILL_LABELS.items() if name in prefill],
        "",
    ]
    publish("\n".join(lines), args.record)


if __name__ == "__main__":
    main()
