"""What 8-bit matmul inputs buy and cost in the fast mode (executors/thresholds.py), on this CPU's tier.

1. Speed: the packed kernel alone on the default model's shapes (4-bit 3072x576 gate/up, 4-bit 576x1536
   down, 8-bit 49152x576 head) at 1 to 512 rows, with 16-bit and with 8-bit inputs (medians of 7).
2. Quality: 16 prompts, 48 greedy tokens in one batch, against the exact mode (float32 weights from the
   same file): how many outputs are identical and how long the common prefix is, with the fast mode's
   policy and with 16-bit inputs everywhere; and four short chat answers under the policy.

    python benchmarks/eight_bit_inputs.py [--threads 2] [--record]     (KVFLOW_ISA=avx2 for that tier)
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch
from results_file import publish

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SHAPES = ((4, 3072, 576), (4, 576, 1536), (8, 49152, 576))
ROWS = (1, 2, 8, 64, 512)
QUESTIONS = ("What is the capital of France?", "What is the capital of Italy?", "Who wrote Hamlet?",
             "What is the largest planet?")


def kernel_rates(threads: int) -> list[str]:
    from kvflow.executors.thresholds import ROW_THRESHOLDS
    from kvflow.kernels import abi, packed_matmul

    lib = abi.native()
    lib.kvflow_set_tuning(tuning=ROW_THRESHOLDS.kernel_tuning())
    lines = ["| weights | rows | 16-bit inputs GFLOP/s | 8-bit inputs GFLOP/s | 8-bit / 16-bit |", "|---|---|---|---|---|"]
    g = torch.Generator().manual_seed(0)
    for bits, n, k in SHAPES:
        pw = packed_matmul.random_weight(n, k, bits)
        for m in ROWS:
            if bits == 8 and m > 8:
                continue  # the head only ever sees the rows that sample
            x, y = torch.randn(m, k, generator=g), torch.empty(m, n)
            rates = []
            for input_bits in (16, 8):
                args = dict(w=ctypes.byref(pw.struct), x=x.data_ptr(), x_stride=x.stride(0), m=m, y=y.data_ptr(),
                            y_stride=y.stride(0), input_bits=input_bits, num_threads=threads)
                lib.kvflow_packed_matmul(**args)
                times = []
                for _ in range(7):
                    start = time.perf_counter()
                    lib.kvflow_packed_matmul(**args)
                    times.append(time.perf_counter() - start)
                rates.append(2 * m * n * k / statistics.median(times) / 1e9)
            lines.append(f"| Q{bits} {n}x{k} | {m} | {rates[0]:.0f} | {rates[1]:.0f} | {rates[1] / rates[0]:.2f} |")
    return lines


def quality() -> list[str]:
    from engine_helpers import PROMPTS, make_llm

    from kvflow import SamplingParams
    from kvflow.config import ModelConfig
    from kvflow.executors.model_setup import load_model

    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    exact = make_llm(load_model(ModelConfig(dtype="float32", device="cpu", max_model_len=4096)))
    reference = exact.generate(PROMPTS, params)
    fast_loaded = load_model(ModelConfig(device="cpu", max_model_len=4096))
    lines = ["| fast mode inputs | identical to exact | mean common prefix (of 48) |", "|---|---|---|"]
    answers = {}
    for name in ("16-bit everywhere", "the policy"):
        llm = make_llm(fast_loaded)
        if name.startswith("16"):
            llm.engine.runner.executor.eight_bit_min_rows = 0
        outs = llm.generate(PROMPTS, params)
        same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, reference))
        prefix = [next((i for i, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)) if x != y),
                       48) for a, b in zip(outs, reference)]
        lines.append(f"| {name} | {same}/{len(PROMPTS)} | {statistics.mean(prefix):.1f} |")
        answers[name] = [llm.chat([{"role": "user", "content": q}], SamplingParams(temperature=0, max_tokens=10))[0]
                         .outputs[0].text.strip() for q in QUESTIONS]
    lines += ["", "Chat answers (10 tokens, greedy) under the policy: "
              + "; ".join(f"{q!r} -> {a!r}" for q, a in zip(QUESTIONS, answers["the policy"])) + "."]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", action="store_true", help="add the tables to benchmarks/history/<today>.md (listed in RESULTS.md)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kvflow.kernels import cpu_features

    lines = [f"### 8-bit inputs ({time.strftime('%Y-%m-%d %H:%M')}, {args.threads} threads)", "",
             f"CPU {cpu_features.cpu_name()}, kernel tier `{cpu_features.isa_tier()}` (the CPU's own: "
             f"`{cpu_features.machine_tier()}`). `python benchmarks/eight_bit_inputs.py --threads {args.threads}`.", "",
             *kernel_rates(args.threads), "", *quality(), ""]
    publish("\n".join(lines), args.record)


if __name__ == "__main__":
    main()
