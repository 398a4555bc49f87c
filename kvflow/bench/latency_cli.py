"""``kvflow bench latency``: argument parsing (llama-bench's flags) and the handler."""

from __future__ import annotations

import argparse
from typing import Any


def _ints(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",") if x.strip()]


def add_latency_parser(bench_sub: Any) -> None:
    from kvflow.cli_options import add_engine_options

    p = bench_sub.add_parser("latency", help="prefill (pp) and decode (tg) tokens/s against the roofline")
    p.add_argument("-p", "--n-prompt", type=_ints, default=[128, 512, 2048], help="prompt sizes, e.g. 128,512")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="tokens generated per decode test")
    p.add_argument("-d", "--depth", type=_ints, default=[0], help="tokens already in the cache, e.g. 0,4096")
    p.add_argument("-b", "--batch", type=_ints, default=[1], help="decode batch sizes, e.g. 1,8,32")
    p.add_argument("-r", "--reps", type=int, default=3, help="repetitions; the median is reported")
    p.add_argument("--probe", default=None, help="probe JSON to use (default: the saved one, or a quick probe)")
    p.add_argument("--out", default=None, help="write the JSON report here")
    add_engine_options(p)
    p.set_defaults(func=cmd_latency, speculative_config="off")  # plain decoding unless asked, as llama-bench's


def cmd_latency(args: argparse.Namespace) -> int:
    from kvflow.bench.latency import markdown_table, run_latency, save_report
    from kvflow.cli_options import engine_options
    from kvflow.machine.probe import load_probe

    options = engine_options(args)
    model = options.pop("model")
    probe = load_probe(args.probe) if args.probe else None
    report = run_latency(model, args.n_prompt, args.n_gen, args.depth, args.batch, args.reps, probe, **options)
    print(markdown_table(report))
    if args.out:
        print(f"saved {save_report(report, args.out)}")
    return 0
