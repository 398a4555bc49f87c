"""Packed-integer linear kernels against dense F.linear, for SmolLM2-135M's shapes (issue 7).

    python benchmarks/bench_quant_linear.py [--threads 2] [--rows 1,8,32,512] [--reps 15]

Every variant of one (shape, rows) cell is timed round-robin in the same loop and the median is printed
in microseconds, so a host whose speed drifts shifts all columns together. Columns:
  f32 dense / bf16 dense   F.linear with the dequantized weight (float32: 4 bytes a weight; bf16: 2)
  i4 kern    _weight_int4pack_mm_for_cpu, group 32 (Q4_1, Q4_0), bf16 activations
  i8 kern    _weight_int8pack_mm, per-channel int8 (gpt-fast int8; Q8_0 would need requantizing)
  q8 2xi4    Q8_0 exactly, as two int4 halves in one int4 kernel call (Int8BlockLinear.kernel_mm)
  i4 deq+mm  dequantize to bf16 and multiply through oneDNN (the prefill path, no cached copy)
  kv Q4_1 / kv Q8_0   kvflow's own kernel (kernels/packed_matmul): VNNI below 16 rows, AMX int8 from 16
  Q4_1 auto / Q8_0 auto   the layers' forward with float32 in and out, path chosen by row count
The int kernels' float32-activation path is a scalar loop (50-100x slower); the layers convert to bf16.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvflow.executors.thresholds import ROW_THRESHOLDS
from kvflow.kernels import abi, packed_matmul, packed_weight
from kvflow.layers.quant import build_quant_linear, quantize_weight

SHAPES = {  # name: (in, out)
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "lm_head": (576, 49152),
}
SLOW_KERNEL_WORK = 576 * 3072 * 128  # the int kernels are FMA loops: skip cells far past their crossover


def time_round_robin(fns: dict, reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm up right before timing: idle memory reads slowly once
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def cell(k: int, n: int, rows: int, reps: int) -> dict[str, float]:
    w = torch.randn(n, k) * 0.05
    q41 = build_quant_linear(quantize_weight(w, "int4", 32), kernel="torch")
    q80 = build_quant_linear(quantize_weight(w, "int8", 32), kernel="torch")
    i8 = build_quant_linear(quantize_weight(w, "int8"))
    wb = w.bfloat16()
    x = torch.randn(rows, k)
    xb = x.bfloat16()
    fns = {"f32 dense": lambda: F.linear(x, w), "bf16 dense": lambda: F.linear(xb, wb)}
    if rows * n * k <= SLOW_KERNEL_WORK or rows <= 8:
        fns["i4 kern"] = lambda: q41.kernel_mm(xb)
        fns["i8 kern"] = lambda: i8.kernel_mm(xb)
        fns["q8 2xi4"] = lambda: q80.kernel_mm(xb)
    fns["i4 deq+mm"] = lambda: q41._tiled_mm(xb)
    if packed_matmul.available():
        for name, scheme in (("kv Q4_1", "int4"), ("kv Q8_0", "int8")):
            bq = quantize_weight(w, scheme, 32)
            bq.scale, bq.offset = bq.scale.half().float(), bq.offset.half().float()  # float16 scales, as GGUF
            pw = packed_weight.pack(bq.q, bq.scale, bq.offset, bq.group_size, bq.bits)
            fns[name] = lambda pw=pw: packed_matmul.matmul(x, pw)
    fns["Q4_1 auto"] = lambda: q41(x)
    fns["Q8_0 auto"] = lambda: q80(x)
    return time_round_robin(fns, reps if rows < 512 else max(3, reps // 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", default="1,8,32,512")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if abi.native() is not None:  # the kernels' crossovers as the engine sets them
        abi.native().kvflow_set_tuning(tuning=ROW_THRESHOLDS.kernel_tuning())
    torch.manual_seed(0)
    cols = ["f32 dense", "bf16 dense", "i4 kern", "i8 kern", "q8 2xi4", "i4 deq+mm", "kv Q4_1", "kv Q8_0",
            "Q4_1 auto", "Q8_0 auto"]
    print(f"threads={args.threads}, median microseconds, torch {torch.__version__}")
    print(f"| shape (in->out) | M | {' | '.join(cols)} |")
    print("|---|---|" + "---|" * len(cols))
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        for rows in (int(r) for r in args.rows.split(",")):
            res = cell(k, n, rows, args.reps)
            vals = " | ".join(f"{res[c]:,.0f}" if c in res else "-" for c in cols)
            print(f"| {name} ({k}->{n}) | {rows} | {vals} |", flush=True)


if __name__ == "__main__":
    main()
