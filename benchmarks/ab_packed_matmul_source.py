"""A/B of the packed matmul between two versions of the kernel sources, on one tier, in one process.

The working tree's csrc/ and a git revision's are each built into a library for the tier asked (default:
the one KVFLOW_ISA or this CPU gives); both multiply the same rows by the same packed Q4_1-like weights of
the default model's layer shapes (576 -> 960 fused q/k/v, 576 -> 3072 fused gate/up, 1536 -> 576 down),
calls alternated, medians printed in microseconds, and the outputs compared (bit for bit, or how far
apart relative to the largest).

    python benchmarks/ab_packed_matmul_source.py --base HEAD [--tier generic] [--rows 1,4,64]
        [--threads 2] [--rounds 30] [--input-bits 16] [--bits 4] [--avx2-vnni]

--avx2-vnni builds the working tree's avx2 library with the VNNI path (build.AVX2_VNNI_EVEX_FLAGS), to
compare it with plain AVX2 (--base HEAD --tier avx2) on a CPU with AVX-512 but not AVX-VNNI.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import torch
from ab_attention_source import library, sources_at

from kvflow.kernels import build, cpu_features, packed_weight
from kvflow.layers.quant import quantize_weight

SHAPES = ((960, 576), (3072, 576), (576, 1536))  # (n, k) of SmolLM2-135M's packed layers


def run(lib, weights: list, xs: list[torch.Tensor], ys: list[torch.Tensor], input_bits: int, threads: int) -> float:
    """Seconds for the layers' matmuls, one after another."""
    t = time.perf_counter()
    for pw, x, y in zip(weights, xs, ys):
        assert lib.kvflow_packed_matmul(w=ctypes.byref(pw.struct), x=x.data_ptr(), x_stride=x.stride(0), m=x.shape[0],
                                        y=y.data_ptr(), y_stride=y.stride(0), input_bits=input_bits,
                                        num_threads=threads) == 0
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the git revision to compare the working tree against")
    ap.add_argument("--tier", default=cpu_features.isa_tier(), choices=cpu_features.runnable_tiers())
    ap.add_argument("--rows", default="1,4,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--input-bits", type=int, default=16, choices=(8, 16))
    ap.add_argument("--bits", type=int, default=4, choices=(4, 6, 8), help="the weights' code width")
    ap.add_argument("--block", type=int, default=32, choices=(16, 32), help="inputs per scale (Q6_K: 16)")
    ap.add_argument("--avx2-vnni", action="store_true", help="the working tree with the AVX2 tier's VNNI path")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvflow-ab-"))
    tree_flags = build.AVX2_VNNI_EVEX_FLAGS if args.avx2_vnni else ()
    libs = {args.base: library(sources_at(args.base, work / "base"), work / "base.so", args.tier),
            "working tree": library(build.CSRC, work / "tree.so", args.tier, tree_flags)}
    g = torch.Generator().manual_seed(0)
    weights = []
    for n, k in SHAPES:
        bq = quantize_weight(torch.randn(n, k, generator=g) * 0.05, "int4" if args.bits == 4 else "int8", args.block)
        q = bq.q >> 2 if args.bits == 6 else bq.q  # 6-bit codes: the 8-bit ones' top six bits
        offset = bq.offset.half().float() if args.bits == 4 else -128.0 * bq.scale.half().float()
        weights.append(packed_weight.pack(q, bq.scale.half().float(), offset, bq.group_size, args.bits))
    print(f"packed matmul, tier {args.tier}{' (tree: VNNI path)' if args.avx2_vnni else ''} "
          f"({cpu_features.cpu_name()}), {args.threads} threads, {args.bits}-bit codes, "
          f"{args.input_bits}-bit inputs; median of {args.rounds} rounds, microseconds for the three layers")
    print(f"| rows | {args.base} | working tree | base / tree | outputs |\n|---|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(m, pw.k, generator=g) for pw in weights]
        outs = {name: [torch.empty(m, pw.n) for pw in weights] for name in libs}

        times = {name: [] for name in libs}
        for _ in range(args.rounds + 2):  # the first two warm up
            for name, lib in libs.items():
                times[name].append(run(lib, weights, xs, outs[name], args.input_bits, args.threads))
        med = {name: statistics.median(ts[2:]) * 1e6 for name, ts in times.items()}
        # bitwise equal, or how far apart relative to the largest output (a change of rounding shows as ~1e-7)
        apart = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*outs.values()))
        print(f"| {m} | {med[args.base]:.0f} | {med['working tree']:.0f} | "
              f"{med[args.base] / med['working tree']:.2f} | {'bitwise equal' if apart == 0 else f'{apart:.1e}'} |")


if __name__ == "__main__":
    main()
