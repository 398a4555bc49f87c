"""A/B of one kernel crossover (a KvflowTuning field, executors/thresholds.py) through the fast CPU executor.

Decode steps of N rows (N sequences, one new token each, at a fixed context) run through
CpuFastExecutor.execute with the field at value A and at value B, alternating A/B and B/A each round;
prints the median step time of each and their ratio per row count.

    python benchmarks/ab_kernel_tuning.py --field parallel_min_rows --a 1 --b 1000000 [--rows 1,4,8,16,32,48]
        [--context 64] [--rounds 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from kvflow import LLM
from kvflow.executors.thresholds import ROW_THRESHOLDS
from kvflow.kernels import abi, cpu_features


def decode_batch(rows: int, context: int, block_size: int) -> list:
    """Scheduler-shaped entries for `rows` sequences decoding at `context`, each on its own blocks."""
    per_seq = -(-(context + 1) // block_size)
    return [SimpleNamespace(request=SimpleNamespace(all_token_ids=list(range(100, 101 + context)), request_id=f"r{i}"),
                            start=context, num_tokens=1, block_ids=list(range(i * per_seq, (i + 1) * per_seq)),
                            sample=True) for i in range(rows)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--field", required=True, choices=[f for f, _ in abi.KvflowTuning._fields_])
    ap.add_argument("--a", type=int, required=True)
    ap.add_argument("--b", type=int, required=True)
    ap.add_argument("--rows", default="1,4,8,16,32,48")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(kv_cache_memory=512 << 20, threads=args.threads, speculative_config="off")
    runner = llm.engine.runner
    native = abi.native()
    base = {f: getattr(ROW_THRESHOLDS, f) for f, _ in abi.KvflowTuning._fields_}

    def use(value: int) -> None:
        native.kvflow_set_tuning(tuning=abi.KvflowTuning(**{**base, args.field: value}))

    print(f"{cpu_features.cpu_name()} (tier {cpu_features.isa_tier()}), {args.threads} threads, context {args.context}")
    print(f"| rows | {args.field}={args.a} ms | {args.field}={args.b} ms | A/B |\n|---|---|---|---|")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = runner.prepare(decode_batch(rows, args.context, runner.block_size))
            times: dict[int, list[float]] = {args.a: [], args.b: []}
            for value in (args.a, args.b):  # warm-up
                use(value)
                runner.executor.execute(inputs)
            for i in range(args.rounds):
                for value in (args.a, args.b) if i % 2 == 0 else (args.b, args.a):
                    use(value)
                    start = time.perf_counter()
                    runner.executor.execute(inputs)
                    times[value].append(time.perf_counter() - start)
            a, b = statistics.median(times[args.a]), statistics.median(times[args.b])
            print(f"| {rows} | {a * 1e3:.3f} | {b * 1e3:.3f} | {a / b:.3f} |")
    use(base[args.field])


if __name__ == "__main__":
    main()
