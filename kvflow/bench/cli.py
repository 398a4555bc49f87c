"""``kvflow bench probe|serve|plot``: argument parsing and handlers.

``add_bench_parser(subparsers)`` adds the ``bench`` command to a top-level parser; each sub-command
sets ``args.func`` to its handler, which returns an exit status.  ``python -m kvflow.bench.cli`` runs
the same commands on their own.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvflow.bench.serve_dataset import parse_range


def _int_list(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",") if x.strip()]


def add_bench_parser(subparsers: Any) -> Any:
    """Add ``bench`` with its sub-commands to ``subparsers`` (from ``parser.add_subparsers()``).

    Returns the ``bench`` sub-command action, so more commands (``latency``) can be added to it."""
    bench = subparsers.add_parser("bench", help="measure the machine, servers and engines")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_probe(sub)
    _add_serve(sub)
    _add_plot(sub)
    return sub


def _add_probe(sub: Any) -> None:
    p = sub.add_parser("probe", help="memory bandwidth and matmul rate of this machine")
    p.add_argument("--threads", type=_int_list, default=None,
                   help="comma-separated thread counts, e.g. 1,2 (default: 1 and all torch threads)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--quick", action="store_true", help="small sizes and few reps (for tests)")
    p.add_argument("--out", default=None, help="JSON path (default: $KVFLOW_PROBE or ~/.cache/kvflow/probe.json)")
    p.set_defaults(func=cmd_probe)


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server with streaming requests")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--label", default=None, help="name of this server in reports and plots")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    load = p.add_argument_group("load (fixed concurrency, or Poisson arrivals capped by --concurrency)")
    load.add_argument("--concurrency", type=int, default=None, help="clients in flight (default 1)")
    load.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    load.add_argument("--num-prompts", type=int, default=64)
    lengths = p.add_argument_group("prompt and output lengths (tokens)")
    lengths.add_argument("--input-len", type=int, default=200)
    lengths.add_argument("--output-len", type=int, default=128)
    lengths.add_argument("--input-len-range", type=parse_range, default=None, metavar="A:B")
    lengths.add_argument("--output-len-range", type=parse_range, default=None, metavar="A:B")
    lengths.add_argument("--shared-prefix-len", type=int, default=0, help="first L tokens identical across prompts")
    lengths.add_argument("--tokenizer", default=None, help="HF tokenizer path for exact prompt lengths")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (metrics: ttft, tpot, e2e)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    agent = p.add_argument_group("agent scenario: growing conversations (--concurrency conversations at once)")
    agent.add_argument("--scenario", choices=("random", "agent"), default="random")
    agent.add_argument("--turns", type=int, default=40)
    agent.add_argument("--system-len", type=int, default=4000, help="system prompt + tool descriptions")
    agent.add_argument("--user-len", type=int, default=300, help="tokens of each user message")
    p.add_argument("--out", default=None, help="save the results as JSON here")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_serve)


def _add_plot(sub: Any) -> None:
    p = sub.add_parser("plot", help="PNG plots from latency, serve and trace results")
    p.add_argument("results", nargs="+", help="JSON results or .jsonl engine traces")
    p.add_argument("--out-dir", default="bench_plots")
    p.set_defaults(func=cmd_plot)


def cmd_probe(args: argparse.Namespace) -> int:
    from kvflow.machine.probe import run_probe, save_probe

    def log(line: str) -> None:
        print(line, flush=True)

    if not args.device.startswith("cuda"):
        from kvflow.kernels import cpu_features, packed_matmul

        print(f"CPU: {cpu_features.cpu_name()}; kernel tier {cpu_features.isa_tier()} (this CPU's: "
              f"{cpu_features.machine_tier()}); packed kernel: {packed_matmul.path() or 'none'}", flush=True)
    result = run_probe(threads=args.threads, device=args.device, quick=args.quick, log=log)
    path = save_probe(result, args.out)
    print(f"saved {path}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from kvflow.bench.serve import ServeConfig, run_serve
    from kvflow.bench.serve_report import format_summary, parse_goodput

    cfg = ServeConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        num_prompts=args.num_prompts,
        input_len=args.input_len_range or args.input_len,
        output_len=args.output_len_range or args.output_len,
        shared_prefix_len=args.shared_prefix_len,
        goodput=parse_goodput(args.goodput),
        seed=args.seed,
        tokenizer=args.tokenizer,
        scenario=args.scenario,
        turns=args.turns,
        system_len=args.system_len,
        user_len=args.user_len,
        label=args.label,
        timeout_s=args.timeout,
        progress=not args.no_progress,
    )
    doc = run_serve(cfg, args.out)
    print(format_summary(doc))
    if args.out:
        print(f"saved {args.out}")
    return 0 if doc["summary"]["completed"] else 1


def cmd_plot(args: argparse.Namespace) -> int:
    from kvflow.bench.plot import plot_results

    for path in plot_results(args.results, args.out_dir):
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvflow")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())

