"""The `kvflow` command: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from kvflow.cli_options import add_engine_options, engine_options
from kvflow.errors import KvflowError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description="Run large language models fast, and read how.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed as it comes")
    add_engine_options(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--stats", action="store_true", help="print TTFT and tokens/s to stderr at the end")
    gen.set_defaults(handler=cmd_generate)

    chat = sub.add_parser("chat", help="an interactive chat in the terminal")
    add_engine_options(chat)
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--system", default=None)
    chat.set_defaults(handler=cmd_chat)

    from kvflow.launch import add_launch_parser

    add_launch_parser(sub)
    for register in _optional_commands():
        register(sub)
    return parser


def _optional_commands():
    registrations = []
    try:
        from kvflow.server.cli import add_serve_parser

        registrations.append(add_serve_parser)
    except ImportError:
        pass
    try:
        from kvflow.bench.cli import add_bench_parser
        from kvflow.bench.latency_cli import add_latency_parser
        from kvflow.bench.request_path import add_path_parser

        def add_bench(sub) -> None:
            bench = add_bench_parser(sub)
            add_latency_parser(bench)
            add_path_parser(bench)

        registrations.append(add_bench)
    except ImportError:
        pass
    return registrations


def cmd_generate(args: argparse.Namespace) -> int:
    from kvflow.llm import LLM
    from kvflow.sampling_params import SamplingParams

    llm = LLM(**engine_options(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    prompt = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = llm.apply_chat_template(messages + [{"role": "user", "content": prompt}])
    last = None
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.outputs[0].delta_text)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    if args.stats and last is not None:
        print(_stats_line(last), file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from kvflow.llm import LLM
    from kvflow.sampling_params import SamplingParams

    llm = LLM(**engine_options(args))
    llm.engine.warm_up()  # the first answer's TTFT, which this command prints, is then the model's own
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("kvflow chat: type a message, /reset to start over, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            user = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not user.strip():
            continue
        if user.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": user})
        answer, last = [], None
        for out in llm.stream(llm.apply_chat_template(history), params):
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
            answer.append(out.outputs[0].delta_text)
            last = out
        print()
        history.append({"role": "assistant", "content": "".join(answer)})
        if last is not None:
            print(_stats_line(last), file=sys.stderr)


def _stats_line(out) -> str:
    m = out.metrics
    n = m.num_generated_tokens
    ttft = (m.ttft or 0.0) * 1000
    decode = m.decode_time or 0.0
    rate = (n - 1) / decode if n > 1 and decode > 0 else 0.0
    cached = f", {m.num_cached_tokens} prompt tokens cached" if m.num_cached_tokens else ""
    return f"[TTFT {ttft:.0f} ms, {n} tokens, decode {rate:.1f} tok/s{cached}]"


def main(argv: list[str] | None = None) -> int:
    from kvflow.launch import split_client_args

    argv, client_args = split_client_args(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    if client_args:
        args.client_args = client_args
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(message)s"
    )
    _quiet_libraries()
    start = time.monotonic()
    try:
        handler = getattr(args, "handler", None) or args.func
        return int(handler(args) or 0)
    except KvflowError as exc:
        print(f"kvflow: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"kvflow: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted after {time.monotonic() - start:.1f} s", file=sys.stderr)
        return 130


def _quiet_libraries() -> None:
    import os
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", message=".*NumPy array is not writable.*")
