"""`kvflow serve`: load the model, then serve the OpenAI and Ollama APIs over HTTP with uvicorn.

The port opens only once the model is loaded, so /health answers 200 as soon as it answers at all.
SIGTERM or SIGINT: stop accepting connections, let responses in flight finish (up to --shutdown-grace
seconds, then they are cancelled and their requests aborted), stop the engine and exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading

from kvflow.cli_options import add_engine_options, engine_options, parse_bytes


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    value = int(text)
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI and Ollama HTTP APIs")
    add_engine_options(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--uds", default=None, help="listen on this Unix socket instead of host:port")
    g.add_argument("--root-path", default="", help="serve every route under this prefix too (behind a proxy)")
    g.add_argument("--api-key", default=os.environ.get("KVFLOW_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $KVFLOW_API_KEY; /health stays open)")
    g.add_argument("--max-waiting", type=_positive_int, default=None,
                   help="at most N requests wait for the engine; more get 503 with Retry-After (default: no limit)")
    g.add_argument("--served-model-name", default=None, help="the model name the APIs report and accept")
    # (default None, read as serving's DEFAULT_MAX_BODY_BYTES: building the parser imports no server code,
    # so `kvflow launch` and `--help` start without torch)
    g.add_argument("--max-body-size", type=parse_bytes, default=None,
                   help="larger request bodies get 413 (default: 4MiB)")
    g.add_argument("--max-n", type=_positive_int, default=None, metavar="N",
                   help="the most choices (n) one request may ask for; more get a 400 naming n (default: 16)")
    g.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds to let responses in flight finish on SIGTERM/SIGINT")
    g.add_argument("--no-ui", action="store_true", help="no chat page at GET / (a line of text instead)")
    g.add_argument("--no-metrics", action="store_true",
                   help="no /metrics and no live data for the page (which then stays a plain chat)")
    g.add_argument("--strict-max-tokens", action="store_true",
                   help="a request whose max_tokens does not fit in the context left after its prompt gets a 400 "
                        "(default: max_tokens is cut to the room left, and the answer ends with reason 'length')")
    g.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--data-parallel-size", "--dp", type=_positive_int, default=1, metavar="N",
                   help="N engine cores (processes), each with its own copy of the model and KV cache (and, with "
                        "--tp, its own tensor-parallel ranks), on a share of the cores (--threads: per rank) or its "
                        "own GPUs; each request goes to the one that holds the longest part of its prompt")
    g.add_argument("--engine-process", default=os.environ.get("KVFLOW_ENGINE_PROCESS", "auto"),
                   choices=["auto", "on", "off"],
                   help="on: the engine core (model, scheduler, steps) runs in a process of its own, so HTTP work "
                        "never holds the GIL a step needs; off: on a thread of the server's process; auto: on where "
                        "the front end has a core of its own (CUDA, or --threads below the physical cores)")
    g.add_argument("--engine-restarts", type=_non_negative_int, default=0, metavar="N",
                   help="an engine core process that dies is started again, up to N times (its requests in flight "
                        "get an error; /health answers 503 until the new one is ready); past N, or with 0 (the "
                        "default), the server exits non-zero. Applies where the core has a process of its own")
    p.set_defaults(handler=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvflow.config import engine_config
    from kvflow.distributed import group
    from kvflow.engine import rank_worker
    from kvflow.engine.async_engine import AsyncEngine, build_off_the_main_thread
    from kvflow.engine.core_client import EngineCoreClient
    from kvflow.engine.data_parallel import DataParallelClient
    from kvflow.engine.engine import LLMEngine
    from kvflow.loader.resolve import DEFAULT_MODEL
    from kvflow.server.app import create_app
    from kvflow.server.serving import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_N, ServerSettings

    # --log-level sets kvflow's own lines too (at info: one per finished request, by its id); -v still means info.
    logging.getLogger("kvflow").setLevel(logging.INFO if args.verbose else args.log_level.upper())
    options = engine_config(**engine_options(args))
    if group.launched_by_torchrun() and int(os.environ["RANK"]) != 0:  # rank 0 serves; the others run its steps
        return rank_worker.torchrun_main(options.model)
    if args.data_parallel_size > 1:
        if group.launched_by_torchrun():
            raise SystemExit("kvflow serve: --data-parallel-size runs its replicas on this machine; across "
                             "machines, run one kvflow serve per replica behind a router (README)")
        served = DataParallelClient(options, args.data_parallel_size, log_level=logging.getLogger("kvflow").level,
                                    restarts=args.engine_restarts)
    elif _engine_process(args.engine_process, options) and not group.launched_by_torchrun():
        # the engine core in its own process (engine/core_process.py); this one keeps HTTP
        served = EngineCoreClient(options, log_level=logging.getLogger("kvflow").level,
                                  restarts=args.engine_restarts)
    else:
        served = AsyncEngine(build_off_the_main_thread(lambda: _warmed_up(LLMEngine(options))))
    engine = served.engine
    loaded = engine.loaded
    name = args.served_model_name or loaded.resolved.name
    aliases = {loaded.resolved.name, args.model or DEFAULT_MODEL}
    settings = ServerSettings(served_model_name=name, model_aliases=aliases, api_key=args.api_key,
                              max_waiting=args.max_waiting,
                              max_body_bytes=DEFAULT_MAX_BODY_BYTES if args.max_body_size is None else args.max_body_size,
                              root_path=args.root_path, ui=not args.no_ui, metrics=not args.no_metrics,
                              strict_max_tokens=args.strict_max_tokens, max_n=DEFAULT_MAX_N if args.max_n is None else args.max_n)
    app = create_app(served, settings)
    config = uvicorn.Config(app, host=args.host, port=args.port, uds=args.uds, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_grace, access_log=False)
    where = f"unix:{args.uds}" if args.uds else f"http://{args.host}:{args.port}{args.root_path}"
    print(f"kvflow serve: model {name} ({loaded.resolved.path})\n"
          f"  dtype {str(loaded.dtype).removeprefix('torch.')}, device {loaded.device}, "
          f"context {engine.max_model_len} tokens, KV cache {engine.kv_capacity_tokens} tokens\n"
          f"  listening on {where}  (OpenAI: /v1, Ollama: /api, /metrics, /health"
          f"{'' if args.no_ui else '; chat page: /'})",
          file=sys.stderr, flush=True)
    _say_rope_scaling(args.rope_scaling, loaded)
    _warn_past_trained_context(engine.max_model_len, loaded)
    server = _GracefulServer(config)
    died: list[str] = []
    if hasattr(served, "on_death"):  # no engine core left: finish the streams' error events, then exit 1
        served.on_death.append(died.append)
        served.on_death.append(lambda reason: setattr(server.server, "should_exit", True))
    server.run()
    if died or engine.failure is not None:
        print(f"kvflow serve: {died[0] if died else engine.failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def _say_rope_scaling(stated: dict | None, loaded) -> None:
    """The rotary scaling the model runs with, where --rope-scaling was given (auto's is known only now)."""
    if stated is None:
        return
    scaling = getattr(getattr(loaded, "arch", None), "rope_scaling", None)
    if not scaling:
        print("  rotary scaling: none (the context fits the model's own)", file=sys.stderr, flush=True)
        return
    original = scaling.get("original_max_position_embeddings")
    print(f"  rotary scaling: {scaling.get('rope_type')} x{scaling.get('factor', 1):g}"
          f"{f' over {original} tokens' if original else ''}", file=sys.stderr, flush=True)


def _warn_past_trained_context(max_model_len: int, loaded) -> None:
    """A warning when --max-model-len goes past the context the model was trained for: positions beyond it
    are ones the model never saw (agents' 20,000-token prompts on a model trained for 8,192), so answers
    there may degrade."""
    arch = getattr(loaded, "arch", None)
    trained = getattr(arch, "max_position_embeddings", None)
    if trained and max_model_len > trained:
        print(f"kvflow serve: warning: --max-model-len {max_model_len} is above the {trained} tokens this model "
              f"was trained for; past {trained} tokens its answers may degrade", file=sys.stderr, flush=True)


def _engine_process(choice: str, options) -> bool:
    """Whether the engine core gets a process of its own. Only where the front end then has a core to run
    on: when the steps use every core, the two processes take turns on them, and on a 2-core AMD EPYC that
    cost 12% of the batch-1 TPOT through HTTP against the single process (benchmarks/front_end_overhead.py),
    for 330 MiB more resident memory."""
    if choice != "auto":
        return choice == "on"
    from kvflow.executors.model_setup import physical_cores
    from kvflow.executors.plan import pick_device

    try:
        cuda = pick_device(options.model.device).type == "cuda"
    except Exception:  # noqa: BLE001 - a bad device is reported by the load itself
        return False
    threads = options.model.threads
    return cuda or (threads is not None and threads < physical_cores())


def _warmed_up(engine):
    engine.warm_up()  # the first user's request does not pay for the first step's page faults
    return engine


class _GracefulServer:
    """uvicorn.Server, except that a SIGTERM/SIGINT ends in a normal return (exit 0): uvicorn itself
    re-raises the captured signal after its graceful shutdown, which would kill the process."""

    def __init__(self, config) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                signals = (signal.SIGINT, signal.SIGTERM)
                previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
                try:
                    yield
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)

        self.server = Server(config)

    def run(self) -> None:
        self.server.run()
